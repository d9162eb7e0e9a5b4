"""benchmarks/bench_layer.py's bookkeeping on CPU: the verdict of the correctness check and the
floor's FLOP and byte counts (no process group, no GPU)."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_layer as bl  # noqa: E402


def test_verdict_covers_the_backward():
    ok = dict(err_y=5e-3, err_dx=6e-3, err_dtw=4e-3)
    assert bl.case_agrees(ok, "bf16")
    # a backward that disagrees is a MISMATCH though y agrees (it used to pass: only y was compared)
    assert not bl.case_agrees(dict(ok, err_dx=0.5), "bf16")
    assert not bl.case_agrees(dict(ok, err_dtw=float("nan")), "bf16")
    fp8 = dict(err_y=9.1e-2, err_dx=7.7e-2, err_dtw=9.2e-2, err_y_ours_vs_bf16=6.4e-2)  # the largest stored errors
    assert bl.case_agrees(fp8, "fp8")
    assert not bl.case_agrees(dict(fp8, err_y_ours_vs_bf16=0.2), "fp8")


def test_floor_counts():
    H, I = 4096, 2048
    rates = dict(gemm_bf16_tflops=800.0, gemm_fp8_tflops=1400.0, nvlink_gbps=400.0, hbm_gbps=None)
    # rank 0 busier in GEMMs, rank 1 with more rows arriving
    stats = dict(
        per_rank=[
            dict(recv_rows=50_000, dispatch_in=1000, combine_in=3000),
            dict(recv_rows=40_000, dispatch_in=9000, combine_in=2000),
        ]
    )
    # (recipe, forward rate, dgrad rate, wgrad rate, activation bytes): the format each GEMM pair runs in
    cases = (
        ("bf16", 800.0, 800.0, 800.0, 2),
        ("fp8", 1400.0, 1400.0, 800.0, 1),  # bf16 wgrads
        ("fp8_e4m3_wgrad", 1400.0, 1400.0, 1400.0, 1),
        ("mxfp8_mxfp4", 1400.0, 1400.0, 800.0, 1),  # e2m1 weights and MXFP8 gradients run as e4m3 MMAs
    )
    for recipe, fwd_rate, dgrad_rate, wgrad_rate, act in cases:
        f_fwd, f_all, detail = bl.floor_ms(stats, H, I, recipe, rates)
        flops = 6.0 * 50_000 * H * I  # L1 2*rows*H*2I + L2 2*rows*I*H
        gemm = flops / (fwd_rate * 1e12) * 1e3
        gemm_all = gemm + flops / (dgrad_rate * 1e12) * 1e3 + flops / (wgrad_rate * 1e12) * 1e3
        # rank 1: in = 9000 dispatch rows (activation format) + 2000 combine rows (bf16); out the reverse
        fwd_bytes = max(9000 * H * act + 2000 * H * 2, 2000 * H * act + 9000 * H * 2)
        link_fwd = fwd_bytes / 400e9 * 1e3
        link_all = (fwd_bytes + (9000 + 2000) * H * 2) / 400e9 * 1e3
        assert detail["gemm_fwd_ms"] == pytest.approx(gemm)
        assert detail["gemm_fwdbwd_ms"] == pytest.approx(gemm_all)
        assert detail["nvlink_fwd_ms"] == pytest.approx(link_fwd)
        assert detail["nvlink_fwdbwd_ms"] == pytest.approx(link_all)
        assert f_fwd == pytest.approx(max(gemm, link_fwd))
        assert f_all == pytest.approx(max(gemm_all, link_all))
        # the weight gradients added into fp32 main_grads: 8 bytes per parameter at the HBM rate
        params = 10**9
        f_fwd_mg, f_all_mg, detail = bl.floor_ms(stats, H, I, recipe, dict(rates, hbm_gbps=4000.0), params)
        assert detail["main_grad_ms"] == pytest.approx(8e9 / 4000e9 * 1e3) and f_fwd_mg == pytest.approx(f_fwd)
        assert f_all_mg == pytest.approx(max(gemm_all, link_all, 2.0))
        assert bl.floor_ms(stats, H, I, recipe, dict(rates, hbm_gbps=None), params)[1] is None


def test_every_recipe_has_a_baseline_and_tolerances():
    """bench_layer measures every recipe (it once failed with KeyError on the newer ones)."""
    from megamoe_train.precision import RECIPES

    for recipe in RECIPES:
        assert bl.NATIVE_RECIPE[recipe] in ("bf16", "fp8") and recipe in bl.TOL
        assert recipe == "bf16" or recipe in bl.TOL_VS_BF16
    with pytest.raises(SystemExit):
        bl.parse_args(["--recipes", "fp4"])


def test_main_grad_run_on_cpu(tmp_path):
    """--main-grad (the trainer's way: wgrads added into fp32 main_grads) runs end to end, checked
    against torch-native, with the case labelled; two real gloo processes."""
    import json
    import subprocess

    out = tmp_path / "rows.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_layer.py"), "--tiny", "--recipes", "bf16"]
    cmd += ["--routing", "uniform", "--phases", "fwdbwd", "--main-grad", "--no-floor", "--iters", "3"]
    cmd += ["--budget-s", "0.1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["cases"]
    assert [(r["recipe"], r["phase"], r["verdict"]) for r in rows] == [("bf16, main_grad", "fwdbwd", "ok")]
