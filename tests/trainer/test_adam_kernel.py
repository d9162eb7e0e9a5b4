"""megamoe_trainer.perf.adam_kernel (AdamW writing the bf16 model params) against torch's AdamW plus
megatron's main -> model copy: on CPU under Triton's interpreter, on CUDA directly, and a short
CUDA training run with the kernel against one without it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)

from interpreted import run_interpreted  # noqa: E402

from megamoe_trainer.report import read_metrics  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_adam_kernel_interpreted():
    run_interpreted("adam_kernel_checks.py", "adam kernel checks passed")


def test_bf16_moments_compile_to_round_to_nearest_even_on_hopper():
    """The compiled kernel (sm90, no GPU needed) with bf16 moments: bf16 loads and stores, every
    conversion to bf16 round-to-nearest-even (the interpreter truncates, so only this sees it)."""
    import re

    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from megamoe_trainer.perf import adam_kernel as ak

    kernel = ak._adamw_kernel
    signature = {
        "param_ptr": "*fp32",
        "grad_ptr": "*fp32",
        "exp_avg_ptr": "*bf16",
        "exp_avg_sq_ptr": "*bf16",
        "copy_ptr": "*bf16",
        "grad_scale_ptr": "*fp32",
        "n": "i64",
    }
    signature.update(
        dict.fromkeys(
            (
                "lr_weight_decay",
                "beta1",
                "one_minus_beta1",
                "beta2",
                "one_minus_beta2",
                "eps",
                "step_size",
                "bias_correction2_sqrt",
            ),
            "fp32",
        )
    )
    constants = dict(HAS_SCALE=True, HAS_COPY=True, M_BF16=True, V_BF16=True, BLOCK=ak.BLOCK)
    signature.update(dict.fromkeys(constants, "constexpr"))
    src = ASTSource(
        fn=kernel, signature=signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()}
    )
    ptx = compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8)).asm["ptx"]
    conversions = set(re.findall(r"cvt\.[a-z.]*\.bf16\.f32", ptx))
    assert conversions == {"cvt.rn.bf16.f32"}, conversions
    assert "ld.global.b16" in ptx and "st.global.b16" in ptx


@pytest.mark.gpu
@needs_cuda
def test_adam_kernel_cuda():
    import adam_kernel_checks as checks

    for moments_dtype in (torch.float32, torch.bfloat16):
        checks.check_update_matches_torch("cuda", moments_dtype)
        checks.check_optimizer_step_matches_torch_and_copy("cuda", moments_dtype)
    checks.check_update_without_copy_and_bad_input("cuda")


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
        args = [
            os.path.join(ROOT, "recipes", "tiny_moe_cpu.yaml"),
            "--run-dir",
            run,
            "--steps",
            "5",
            "--no-resume",
            "--set",
            "parallel.device=cuda",
            "--set",
            "parallel.world_size=1",
            "--set",
            "parallel.expert_parallel=1",
            "--set",
            "model.dtype=bf16",
            "--set",
            "run.checkpoint=false",
            "--set",
            "run.plot_every=0",
            "--set",
            "run.log_every=1",
            "--set",
            "moe.megamoe_recipe=fp8",
            "--set",
            "train.lr=1e-2",
            "--set",
            "train.warmup_steps=1",
            "--set",
            f"perf.adam_writes_model_params={on}",
        ]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(
            [sys.executable, "-m", "megamoe_trainer", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
        assert ("AdamW kernel writes the bf16 params" in proc.stdout) == (on == "true"), proc.stdout
        runs[name] = read_metrics(os.path.join(run, "metrics.jsonl"))
    kernel, ref = runs["kernel"], runs["torch"]
    assert len(kernel) == len(ref) == 5
    assert kernel[0]["loss"] == ref[0]["loss"]
    for a, b in zip(kernel, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), (a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-2), (a["grad_norm"], b["grad_norm"])


def _tiny_cuda_run(run_dir, *overrides, steps=5):
    """The tiny recipe in fp8 on one GPU at a large learning rate; returns its metrics records and stdout."""
    args = [
        os.path.join(ROOT, "recipes", "tiny_moe_cpu.yaml"),
        "--run-dir",
        str(run_dir),
        "--steps",
        str(steps),
        "--set",
        "parallel.device=cuda",
        "--set",
        "parallel.world_size=1",
        "--set",
        "parallel.expert_parallel=1",
        "--set",
        "model.dtype=bf16",
        "--set",
        "run.plot_every=0",
        "--set",
        "run.log_every=1",
        "--set",
        "moe.megamoe_recipe=fp8",
        "--set",
        "train.lr=1e-2",
        "--set",
        "train.warmup_steps=1",
    ]
    for o in overrides:
        args += ["--set", o] if "=" in o else [o]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "megamoe_trainer", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return read_metrics(os.path.join(run_dir, "metrics.jsonl")), proc.stdout


@pytest.mark.gpu
@needs_cuda
def test_training_with_bf16_moments(tmp_path):
    """train.adam_moments_dtype=bf16: announced in the first line; the first step's loss equal to
    fp32 moments' (same weights), the next ones close; a run stopped at step 3 and resumed (the
    checkpoint holds bf16 moments, the load casts them to fp32, the next step back, all exact)
    continues as the run that did not stop (to 1e-3: the GPU's own run-to-run differences; moments
    lost at the resume move the loss by more at this learning rate)."""
    pytest.importorskip("megatron.core")
    fp32, _ = _tiny_cuda_run(tmp_path / "fp32", "--no-resume", "run.checkpoint=false")
    straight, out = _tiny_cuda_run(
        tmp_path / "bf16", "--no-resume", "run.checkpoint=false", "train.adam_moments_dtype=bf16"
    )
    assert "AdamW kernel writes the bf16 params (moments in bf16)" in out, out
    assert straight[0]["loss"] == fp32[0]["loss"]
    for a, b in zip(straight, fp32):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2), (a["loss"], b["loss"])
    resumed_dir = tmp_path / "bf16_resumed"
    _tiny_cuda_run(resumed_dir, "--no-resume", "train.adam_moments_dtype=bf16", "--stop-at", "3")
    resumed, out = _tiny_cuda_run(resumed_dir, "--resume", "train.adam_moments_dtype=bf16")
    by_step = {r["step"]: r for r in resumed}
    assert sorted(by_step) == [1, 2, 3, 4, 5], sorted(by_step)
    for r in straight[3:]:
        assert by_step[r["step"]]["loss"] == pytest.approx(r["loss"], rel=1e-3), (
            r["step"],
            by_step[r["step"]]["loss"],
            r["loss"],
        )
