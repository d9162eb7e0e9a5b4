"""megamoe_trainer.adam_kernel (AdamW writing the bf16 model params) against torch's AdamW plus
megatron's main -> model copy: on CPU under Triton's interpreter, on CUDA directly, and a short
CUDA training run with the kernel against one without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)

from interpreted import run_interpreted  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_adam_kernel_interpreted():
    run_interpreted("adam_kernel_checks.py", "adam kernel checks passed")


@pytest.mark.gpu
@needs_cuda
def test_adam_kernel_cuda():
    import adam_kernel_checks as checks

    checks.check_update_matches_torch("cuda")
    checks.check_update_without_copy_and_bad_input("cuda")
    checks.check_optimizer_step_matches_torch_and_copy("cuda")


@pytest.mark.gpu
@needs_cuda
def test_training_with_the_adam_kernel_matches_torch_adam(tmp_path):
    """The tiny recipe in fp8 on one GPU, 5 steps at a large learning rate: megatron's bf16
    optimizer stepped by the kernel (the default, announced in the first line) and by torch's fused
    AdamW plus megatron's copy give the same losses and gradient norms (the first step's exactly:
    same weights). fp8, because its quantized expert weights are cached on the parameters'
    versions: a kernel write they did not see would leave the experts frozen and the losses apart."""
    pytest.importorskip("megatron.core")
    runs = {}
    for name, on in (("kernel", "true"), ("torch", "false")):
        run = str(tmp_path / name)
        args = [os.path.join(ROOT, "recipes", "tiny_moe_cpu.yaml"), "--run-dir", run, "--steps", "5", "--no-resume",
                "--set", "parallel.device=cuda", "--set", "parallel.world_size=1", "--set", "parallel.expert_parallel=1",
                "--set", "model.dtype=bf16", "--set", "run.checkpoint=false", "--set", "run.plot_every=0",
                "--set", "run.log_every=1",
                "--set", "moe.megamoe_recipe=fp8", "--set", "train.lr=1e-2", "--set", "train.warmup_steps=1",
                "--set", f"train.adam_writes_model_params={on}"]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-m", "megamoe_trainer", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
        assert ("AdamW kernel writes the bf16 params" in proc.stdout) == (on == "true"), proc.stdout
        with open(os.path.join(run, "metrics.jsonl")) as f:
            runs[name] = [json.loads(line) for line in f if line.strip()]
    kernel, ref = runs["kernel"], runs["torch"]
    assert len(kernel) == len(ref) == 5
    assert kernel[0]["loss"] == ref[0]["loss"]
    for a, b in zip(kernel, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), (a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-2), (a["grad_norm"], b["grad_norm"])
