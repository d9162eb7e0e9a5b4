"""benchmarks/compare_timelines.py on two stored profile_layer.py timelines (CPU): parsing, the
launch-order pairing (kernels with a same-named partner paired, the rest one-sided), totals."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import compare_timelines as ct  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
BEFORE = os.path.join(RESULTS, "2026-11-30_timeline_S1_fp8_2xH200.txt")
AFTER = os.path.join(RESULTS, "2026-11-30_timeline_S1_fp8_after_2xH200.txt")


def _header_total(path):
    """The 'N kernels, X ms of kernel time' line profile_layer.py prints above its timeline."""
    with open(path) as f:
        line = next(l for l in f if l.startswith("profiled forward+backward:"))
    kernels = int(line.split(":")[1].split("kernels")[0])
    ms = float(line.split("kernels,")[1].split("ms")[0])
    return kernels, ms


def test_reads_the_first_timeline_whole():
    for path in (BEFORE, AFTER):
        kernels = ct.read_timeline(path)
        n, ms = _header_total(path)
        assert len(kernels) == n
        assert sum(k.dur_us for k in kernels) / 1e3 == pytest.approx(ms, abs=0.01)


def test_pairs_in_launch_order_without_cross_name_pairs():
    a, b = ct.read_timeline(BEFORE), ct.read_timeline(AFTER)
    pairs = ct.pair_kernels(a, b)
    assert [k for k, _ in pairs if k] == a and [k for _, k in pairs if k] == b  # every kernel once, in order
    assert all(ka.name == kb.name for ka, kb in pairs if ka and kb)
    # the dY quantize pass the pull absorbed is one-sided; the SwiGLU backward is paired
    assert any(ka and not kb and ka.name == "_quantize_rows_kernel" for ka, kb in pairs)
    assert any(ka and kb and ka.name == "_swiglu_backward_kernel" for ka, kb in pairs)


def test_report_lists_moves_and_totals(tmp_path):
    a, b = ct.read_timeline(BEFORE), ct.read_timeline(AFTER)
    text = ct.report(a, b, min_delta_us=10)
    last = text.splitlines()[-1]
    assert f"({len(a)} -> {len(b)} kernels)" in last
    assert "_swiglu_backward_kernel" in text and "_quantize_rows_kernel" in text
    assert len(ct.report(a, b, show_all=True).splitlines()) > len(text.splitlines())
    empty = tmp_path / "none.txt"
    empty.write_text("no timeline here\n")
    with pytest.raises(ValueError, match="no timeline"):
        ct.read_timeline(str(empty))
