"""mxfp8_mxfp4 weight preparation: the E2M1 Triton kernel (backends/triton_weight_prep.py's
quantize_e2m1_blocks) against quant.py bit for bit, in the Triton interpreter on CPU
(tests/weight_prep_fp4_cases.py in a subprocess, skipped without triton) and on the GPU at larger
odd shapes (marked `gpu`); and on the GPU, transform_weights running it once per weight version."""

import os

import pytest
import torch
from weight_prep_cases import assert_same_bits
from weight_prep_fp4_cases import (
    FIELDS,
    check_blocks,
    check_expert_weights,
    check_without_transposed,
    fp4_master,
)

from megamoe_train.config import MegaMoEConfig
from megamoe_train.weights import clear_weight_cache, quantize_expert_weights, transform_weights


def mx_config(e, inter, hidden):
    return MegaMoEConfig(
        num_experts=e, hidden=hidden, intermediate=inter, topk=1, num_max_tokens_per_rank=8, recipe="mxfp8_mxfp4"
    )


@pytest.fixture(autouse=True)
def empty_cache():
    clear_weight_cache()
    yield
    clear_weight_cache()


def test_kernel_matches_quant_in_triton_interpreter():
    pytest.importorskip("triton")
    from interpreted import run_interpreted

    run_interpreted("weight_prep_fp4_cases.py", "fp4 weight prep: kernel == quant.py in the Triton interpreter")


def test_cpu_tensors_take_the_torch_ops_unless_asked():
    """CPU weights take the torch ops by default (no triton needed); use_kernel=True on them
    outside the interpreter says why it cannot run."""
    w1, w2 = fp4_master(2, 128, 96, torch.float32, seed=1), fp4_master(2, 96, 64, torch.float32, seed=2)
    cfg = mx_config(2, 64, 96)
    a = transform_weights(w1, w2, cfg)
    b = quantize_expert_weights(w1, w2, cfg, use_kernel=False)
    for name in FIELDS:
        assert_same_bits(getattr(a, name), getattr(b, name), name)
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs the kernel on CPU tensors")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        quantize_expert_weights(w1, w2, cfg, use_kernel=True)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, chunk",
    [((4, 2752, 2080), 8), ((3, 2080, 1376), None), ((2, 352, 7136), 16), ((4, 4096, 4096), 8)],
    ids=["w1_I1376_H2080", "w2_H2080_I1376", "E2_N352_K7136", "E4_N4096_K4096"],
)
def test_kernel_matches_quant_on_gpu(shape, chunk):
    check_blocks(*shape, device="cuda", chunk=chunk, seed=sum(shape))


@pytest.mark.gpu
def test_kernel_paths_on_gpu():
    check_blocks(2, 320, 224, device="cuda", chunk=32, seed=7, tile=(128, 32))
    check_blocks(1, 64, 64, device="cuda", seed=8, tile=(32, 32))
    check_expert_weights(4, 1376, 2080, device="cuda", seed=9)
    check_without_transposed("cuda")


@pytest.mark.gpu
def test_transform_weights_runs_the_kernel_once_per_version_on_gpu(monkeypatch):
    """On CUDA the cached transform runs the kernel (one pass per weight, the dgrad's transposed
    copies included), gives quant.py's bits, hits the cache while the parameters are unchanged and
    runs it again after an in-place update (a new version), which makes new transposed copies and
    new derived operands of them too."""
    from megamoe_train.backends import triton_weight_prep

    calls = []
    real = triton_weight_prep.quantize_e2m1_blocks
    monkeypatch.setattr(triton_weight_prep, "quantize_e2m1_blocks", lambda *a, **k: calls.append(1) or real(*a, **k))
    E, I, H = 2, 384, 640  # the expert GEMM's operands (mx_dgrad_gemm_operands) need multiples of 128
    cfg = mx_config(E, I, H)
    w1 = fp4_master(E, 2 * I, H, torch.bfloat16, 21, "cuda").requires_grad_()
    w2 = fp4_master(E, H, I, torch.bfloat16, 22, "cuda").requires_grad_()
    first = transform_weights(w1, w2, cfg)
    assert len(calls) == 2 and transform_weights(w1, w2, cfg) is first and len(calls) == 2
    first_shifts = first.mx_dgrad_gemm_operands()
    with torch.no_grad():
        w1.mul_(-2.0)
        w2.mul_(0.5)
    second = transform_weights(w1, w2, cfg)
    assert second is not first and len(calls) == 4
    oracle = quantize_expert_weights(w1, w2, cfg, use_kernel=False)
    for name in FIELDS:
        assert_same_bits(getattr(second, name), getattr(oracle, name), name)
    second_shifts = second.mx_dgrad_gemm_operands()
    assert second_shifts[0] is second.w1_t and not torch.equal(second_shifts[5], first_shifts[5])
