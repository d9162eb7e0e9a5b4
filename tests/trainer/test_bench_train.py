"""benchmarks/bench_train.py end to end on CPU: three variants of a tiny recipe, a few steps each,
profiled steps included; the table and the JSON carry every column."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_bench_train(args: list[str], cwd: str) -> subprocess.CompletedProcess:
    """bench_train.py's command line in a subprocess with this checkout first on the path; it must succeed."""
    proc = subprocess.run(
        args,
        cwd=cwd,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_bench_train_cpu(tmp_path):
    small = {
        "model.num_layers": 2,
        "model.hidden_size": 128,
        "model.num_attention_heads": 4,
        "model.ffn_hidden_size": 128,
        "model.seq_length": 32,
        "moe.ffn_hidden_size": 128,
        "train.micro_batch_size": 2,
    }
    args = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "bench_train.py"),
        os.path.join(ROOT, "recipes", "tiny_moe_cpu.yaml"),
        "--steps",
        "5",
        "--profile-steps",
        "2",
        "--out",
        str(tmp_path),
    ]
    for k, v in small.items():
        args += ["--set", f"{k}={v}"]
    proc = run_bench_train(args, cwd=ROOT)
    assert "| variant | tokens/s | MFU |" in proc.stdout
    out = json.load(open(tmp_path / "bench_train.json"))
    assert out["profiled_steps"] == [2, 3]
    assert out["untimed_steps"] == [2, 3, 4]  # the step after the profiled ones holds the trace export (CUDA)
    rows = {r["variant"]: r for r in out["rows"]}
    assert set(rows) == {"bf16", "fp8", "stock"}
    for name, r in rows.items():
        assert r["steps"] == 5 and len(r["losses"]) == 5
        assert r["tokens_per_s"] > 0 and r["mfu"] is None  # no peak known for a CPU
        prof = r["profile_rank0"]
        assert prof["steps"] == [2, 3] and prof["moe_ranges"] == 2 * 2 * 2  # 2 steps x 2 MoE layers x (fwd, bwd)
        assert r["gpu_busy_fraction"] is None and r["peak_memory_gib"] is None  # CPU: no GPU numbers
        assert prof["peer_wait_s"] == 0.0 and "peer_wait_ms_per_step" in r and "expert_load_imbalance" in r
    for name in ("bf16", "fp8"):  # same seed and data: the losses follow stock's closely
        assert rows[name]["loss_reference"] == "stock"
        assert rows[name]["loss_max_rel_diff"] < 1e-2
        assert abs(rows[name]["loss_tail_mean_rel_diff"]) < 1e-2

    # a later call's variant joins the earlier rows (--with), compared with one of them; an earlier
    # row that failed is left out with a note, and rows run with other overrides say which
    earlier = dict(out, overrides=out["overrides"] + ["train.grad_accum_steps=1"])
    earlier["rows"] = [
        r | {"error": "megamoe-train exited with 1"} if r["variant"] == "stock" else r for r in out["rows"]
    ]
    # bf16's row as an older file wrote it, without its own overrides (it takes the file's); the
    # others keep theirs, which win over the file's
    earlier["rows"] = [
        {k: v for k, v in r.items() if k != "overrides"} if r["variant"] == "bf16" else r for r in earlier["rows"]
    ]
    json.dump(earlier, open(tmp_path / "earlier.json", "w"))
    later = tmp_path / "later"
    args[args.index("--out") + 1] = str(later)
    args += ["--variants", "fp8", "--reference", "bf16", "--loss-tail", "3"]
    args += ["--with", str(tmp_path / "earlier.json")]
    proc = run_bench_train(args, cwd=ROOT)
    assert "last-3 mean loss" in proc.stdout and "vs bf16" in proc.stdout
    assert "- stock of " in proc.stdout and "left out: megamoe-train exited with 1" in proc.stdout
    assert "- bf16 ran with --set " in proc.stdout and "train.grad_accum_steps=1" in proc.stdout
    assert "fp8 (earlier) ran with" not in proc.stdout
    rows = {r["variant"]: r for r in json.load(open(later / "bench_train.json"))["rows"]}
    assert set(rows) == {"fp8", "bf16", "fp8 (earlier)"}
    assert rows["bf16"]["overrides"] == earlier["overrides"] and rows["fp8"]["overrides"] == out["overrides"]
    # every row of a written file names its own overrides: joined again, none takes the file's
    assert all(r["overrides"] == out["overrides"] for r in out["rows"])
    assert rows["fp8"]["losses"] == rows["fp8 (earlier)"]["losses"]  # same code, seed and data
    assert rows["fp8"]["loss_reference"] == "bf16" and "loss_reference" not in rows["bf16"]


def test_bench_train_another_tree_and_repeats(tmp_path):
    """--tree runs each variant with another checkout's trainer too (here this one, through the
    subprocess path), --repeat alternates them: rows 'bf16#1', 'bf16@other#1', 'bf16#2', ..."""
    small = {
        "model.num_layers": 2,
        "model.hidden_size": 64,
        "model.num_attention_heads": 4,
        "model.ffn_hidden_size": 128,
        "model.seq_length": 32,
        "moe.ffn_hidden_size": 64,
        "train.micro_batch_size": 2,
    }
    args = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "bench_train.py"),
        os.path.join(ROOT, "recipes", "tiny_moe_cpu.yaml"),
        "--steps",
        "3",
        "--profile-steps",
        "0",
        "--variants",
        "bf16",
        "--tree",
        f"other={ROOT}",
        "--repeat",
        "2",
        "--out",
        str(tmp_path),
    ]
    for k, v in small.items():
        args += ["--set", f"{k}={v}"]
    run_bench_train(args, cwd=str(tmp_path))
    rows = json.load(open(tmp_path / "bench_train.json"))["rows"]
    assert [r["variant"] for r in rows] == ["bf16#1", "bf16@other#1", "bf16#2", "bf16@other#2"]
    assert all(r["steps"] == 3 for r in rows)
    assert len({tuple(r["losses"]) for r in rows}) == 1  # same code, seed and data


def test_trace_summary_counts_peer_wait():
    """summarize_trace on a hand-made trace: the device barrier's spinning is reported as peer
    wait (and still counts as busy and kernel time), MoE ranges attribute kernels by launch."""
    from megamoe_trainer.profiling import MOE_FORWARD, PEER_WAIT_KERNEL, summarize_trace

    def kernel(name, ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    def launch(ts, corr):
        return {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "tid": 1,
            "ts": ts,
            "dur": 1,
            "args": {"correlation": corr},
        }

    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "user_annotation", "name": MOE_FORWARD, "tid": 1, "ts": 0, "dur": 50},
            launch(10, 1),
            kernel("gemm", 100, 300, 1),
            launch(20, 2),
            kernel(PEER_WAIT_KERNEL, 400, 600, 2),
            launch(60, 3),
            kernel("adam", 1000, 200, 3),
        ]
    }
    s = summarize_trace(trace, wall_s=2e-3)
    assert s["kernel_s"] == pytest.approx(1.1e-3) and s["busy_s"] == pytest.approx(1.1e-3)
    assert s["peer_wait_s"] == pytest.approx(0.6e-3)
    assert s["moe_kernel_s"] == pytest.approx(0.9e-3)  # the gemm and the barrier were launched in the range
    assert [k["name"] for k in s["top_moe_kernels"]] == [PEER_WAIT_KERNEL, "gemm"]
    assert [k["name"] for k in s["top_other_kernels"]] == ["adam"]
