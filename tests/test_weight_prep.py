"""fp8 weight preparation: the FP8 dgrad operands (w1_t, w2_t) of the torch path against their
definition; the Triton kernel against the torch path bit for bit, in the Triton interpreter on
CPU (skipped without triton) and on the GPU at real sizes (marked `gpu`)."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from interpreted import interpreter_env
from weight_prep_cases import assert_same_bits, check_expert_weights, master_weight

from megamoe_train.config import MegaMoEConfig
from megamoe_train.precision import RECIPES
from megamoe_train.quant import dequantize_weight, quantize_weight
from megamoe_train.weights import (
    clear_weight_cache,
    deinterleave_gate_up,
    quantize_expert_weights,
    transform_weights,
)

FP8 = RECIPES["fp8"]
HERE = os.path.dirname(os.path.abspath(__file__))


def _has_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked install
        return False


def fp8_config(e, inter, hidden, recipe="fp8"):
    return MegaMoEConfig(
        num_experts=e, hidden=hidden, intermediate=inter, topk=1, num_max_tokens_per_rank=8, recipe=recipe
    )


@pytest.fixture(autouse=True)
def empty_cache():
    clear_weight_cache()
    yield
    clear_weight_cache()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_dgrad_operands_match_their_definition(dtype):
    """CPU (the torch path): w1_t is fc1 quantized in master order, transposed, with its scales
    transposed; dequantized it is deinterleave(dequantize(w1)) transposed, bit for bit."""
    E, I, H = 2, 256, 384
    w1 = master_weight(E, 2 * I, H, dtype, seed=11)
    w2 = master_weight(E, H, I, dtype, seed=12)
    ew = transform_weights(w1, w2, fp8_config(E, I, H))
    assert ew.w1_t.dtype == ew.w2_t.dtype == torch.float8_e4m3fn
    assert ew.w1_t.shape == (E, H, 2 * I) and ew.w1_t_scales.shape == (E, H // 128, 2 * I // 128)
    assert ew.w2_t.shape == (E, I, H) and ew.w2_t_scales.shape == (E, I // 128, H // 128)
    assert ew.w1_t_scales.dtype == ew.w2_t_scales.dtype == torch.float32
    for t in (ew.w1_t, ew.w1_t_scales, ew.w2_t, ew.w2_t_scales):
        assert t.is_contiguous()

    for master, data_t, scales_t in ((w1, ew.w1_t, ew.w1_t_scales), (w2, ew.w2_t, ew.w2_t_scales)):
        data, scales = quantize_weight(master, FP8)
        assert_same_bits(data_t, data.mT.contiguous(), "data transposed")
        assert_same_bits(scales_t, scales.mT.contiguous(), "scales transposed")
    w1_t_value = dequantize_weight(ew.w1_t, ew.w1_t_scales, FP8)
    assert_same_bits(w1_t_value, deinterleave_gate_up(ew.dequantize_w1(), ew.chunk).mT.contiguous(), "dequantized w1_t")
    assert_same_bits(
        dequantize_weight(ew.w2_t, ew.w2_t_scales, FP8), ew.dequantize_w2().mT.contiguous(), "dequantized w2_t"
    )
    # An up-row block lands transposed in columns I.. of w1_t, with the scale of that block.
    assert ew.w1_t_scales[1, 2, I // 128] == ew.w1_scales[1, 1, 2]  # up chunk 0 is interleaved row block 1


def test_dgrad_operands_only_with_a_quantized_dgrad():
    w1 = torch.randn(2, 512, 256)
    w2 = torch.randn(2, 256, 256)
    ew = transform_weights(w1, w2, fp8_config(2, 256, 256, "bf16"))
    assert ew.w1_t is None and ew.w1_t_scales is None and ew.w2_t is None and ew.w2_t_scales is None
    for recipe in ("fp8", "mxfp8_mxfp4"):  # (mxfp8_mxfp4's: tests/test_weights.py)
        ew = transform_weights(w1, w2, fp8_config(2, 256, 256, recipe))
        assert ew.w1_t is not None and ew.w2_t is not None
    with pytest.raises(ValueError, match="does not quantize"):
        quantize_expert_weights(w1, w2, fp8_config(2, 256, 256, "bf16"))
    with pytest.raises(ValueError, match="w2: expected shape"):
        quantize_expert_weights(w1, w2[:, :128], fp8_config(2, 256, 256))


def test_cpu_tensors_take_the_torch_path_by_default():
    """Without use_kernel, CPU weights never need triton: same bits as use_kernel=False."""
    w1, w2 = master_weight(1, 256, 128, torch.float32, 3), master_weight(1, 128, 128, torch.float32, 4)
    cfg = fp8_config(1, 128, 128)
    a = transform_weights(w1, w2, cfg)
    b = quantize_expert_weights(w1, w2, cfg, use_kernel=False)
    for name in ("w1", "w1_scales", "w1_t", "w2_t_scales"):
        assert_same_bits(getattr(a, name), getattr(b, name), name)
    for x, y in zip(a.compute_copies(torch.bfloat16), b.compute_copies(torch.bfloat16)):
        assert_same_bits(x, y, "compute copies")


@pytest.mark.skipif(not _has_triton(), reason="needs triton (its CPU interpreter)")
def test_kernel_matches_torch_in_triton_interpreter():
    """The kernels on CPU tensors under TRITON_INTERPRET=1, in a process of their own (the
    interpreter is chosen when triton compiles the kernels)."""
    env = dict(interpreter_env(), PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "weight_prep_cases.py")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # fp32 masters take the torch ops on CUDA (master_dtypes)
@pytest.mark.parametrize("shape", [(4, 2048, 4096), (2, 1408, 7168)], ids=["E4_I2048_H4096", "E2_I1408_H7168"])
def test_kernel_matches_torch_on_gpu(shape, dtype):
    E, I, H = shape
    check_expert_weights(E, I, H, dtype, seed=sum(shape), device="cuda")


@pytest.mark.gpu
def test_kernel_edge_cases_on_gpu():
    from weight_prep_cases import check_chunk_and_strides, check_every_rounding, check_nan_block, check_rows_per_step

    check_every_rounding("cuda")
    check_nan_block("cuda")
    check_chunk_and_strides("cuda")
    check_rows_per_step("cuda", rows=(None, 16, 32, 64))


@pytest.mark.gpu
def test_transform_weights_uses_the_kernel_on_gpu(monkeypatch):
    """On CUDA the cached transform and compute_copies run the kernels (and give the torch bits)."""
    from megamoe_train.backends import triton_weight_prep

    calls = []
    for name in ("quantize_blocks", "dequantize_blocks"):
        real = getattr(triton_weight_prep, name)
        monkeypatch.setattr(
            triton_weight_prep, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k)
        )
    E, I, H = 2, 256, 512
    w1 = master_weight(E, 2 * I, H, torch.bfloat16, 21, "cuda")
    w2 = master_weight(E, H, I, torch.bfloat16, 22, "cuda")
    ew = transform_weights(w1, w2, fp8_config(E, I, H))
    copies = ew.compute_copies(torch.bfloat16)
    assert calls == ["quantize_blocks", "quantize_blocks", "dequantize_blocks", "dequantize_blocks"]
    oracle = quantize_expert_weights(w1, w2, fp8_config(E, I, H), use_kernel=False)
    assert_same_bits(ew.w1_t, oracle.w1_t, "w1_t")
    for a, b in zip(copies, oracle.compute_copies(torch.bfloat16, use_kernel=False)):
        assert_same_bits(a, b, "compute copies")
