"""megamoe_trainer.perf.dense_wgrad: Megatron's gradient-accumulation fusion for the dense linear layers
without APEX. CPU: the fallback math (the bits of Megatron's unfused wgrad plus DDP's add), shape
checks, the installation into Megatron's layers; the trainer's bitwise A/B is in
tests/trainer/test_cli.py. The CUDA path (the CUTLASS accumulating GEMM) is checked under `gpu`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megamoe_trainer.perf import dense_wgrad  # noqa: E402


def _operands(rows, out, inp, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inp, generator=g).to(device, torch.bfloat16)
    dy = torch.randn(rows, out, generator=g).to(device, torch.bfloat16)
    main_grad = torch.randn(out, inp, generator=g).to(device)  # what earlier micro-batches left
    return x, dy, main_grad


@pytest.mark.parametrize("accum_dtype", [torch.float32, torch.bfloat16])
def test_fallback_is_the_unfused_bits(accum_dtype):
    x, dy, main_grad = _operands(37, 24, 40)
    main_grad = main_grad.to(accum_dtype)
    want = main_grad.clone().add_(dy.t().matmul(x))  # Megatron's bf16 wgrad, then DDP's add
    fn = dense_wgrad.wgrad_gemm_accum_fp32 if accum_dtype == torch.float32 else dense_wgrad.wgrad_gemm_accum_fp16
    fn(x, dy, main_grad)
    assert torch.equal(main_grad, want)


def test_shapes_are_checked():
    x, dy, main_grad = _operands(8, 16, 32)
    with pytest.raises(ValueError, match=r"main_grad \[out, in\] expected"):
        dense_wgrad.wgrad_gemm_accum_fp32(x, dy, main_grad.t().contiguous())
    with pytest.raises(ValueError, match="expected"):
        dense_wgrad.wgrad_gemm_accum_fp32(x[:7], dy, main_grad)


def test_installed_into_megatron_layers():
    from megatron.core.tensor_parallel import layers

    apex = layers._grad_accum_fusion_available and not dense_wgrad.dense_wgrad_fusion_installed()
    assert dense_wgrad.use_dense_wgrad_fusion() and dense_wgrad.use_dense_wgrad_fusion()  # idempotent
    assert layers._grad_accum_fusion_available
    assert dense_wgrad.dense_wgrad_fusion_installed() is not apex  # APEX's own extension stays


@pytest.mark.gpu
@pytest.mark.parametrize("rows, out, inp", [(8192, 6144, 2048), (8192, 2048, 8192), (1000, 256, 136), (64, 8, 8)])
def test_cuda_accumulates_the_fp32_product(rows, out, inp):
    """On sm90 the CUTLASS GEMM adds the fp32 product into main_grad (APEX's semantics): against a
    float64 product; neighbours of main_grad untouched; the bf16 fallback's error is larger."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megamoe_train.backends import cutlass_gemm

    dev = torch.device("cuda", torch.cuda.current_device())
    if not cutlass_gemm.available(dev):
        pytest.skip("needs the CUTLASS extension on sm90")
    x, dy, start = _operands(rows, out, inp, dev, seed=rows)
    padded = torch.full((out + 2, inp), float("nan"), device=dev)  # rows around main_grad stay NaN
    main_grad = padded[1:-1]
    main_grad.copy_(start)
    dense_wgrad.wgrad_gemm_accum_fp32(x, dy, main_grad)
    torch.cuda.synchronize()
    exact = start.double() + dy.double().t() @ x.double()
    err = ((main_grad.double() - exact).norm() / exact.norm()).item()
    bf16_err = ((start + dy.t().matmul(x)).double() - exact).norm().item() / exact.norm().item()
    assert err < 1e-5 and err <= bf16_err, (err, bf16_err)
    assert padded[0].isnan().all() and padded[-1].isnan().all()
