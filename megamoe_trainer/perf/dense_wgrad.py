"""Megatron's gradient-accumulation fusion for the dense linear layers, without APEX (recipe key
`perf.dense_wgrad_fusion`).

With `gradient_accumulation_fusion`, Megatron's linear layers (attention, the dense MLP, the
output layer) hand their weight gradient straight to `main_grad` (DDP's fp32 accumulator)
through APEX's `fused_weight_gradient_mlp_cuda` extension, and flag `grad_added_to_main_grad`
so DDP's hook skips its own `main_grad += grad`. Without APEX, Megatron refuses the setting, and
every micro-batch pays a bf16 weight gradient written, read back and added into fp32 main_grad
(on the DeepSeek-V3 proxy over 2 H200s the add alone is ~4.3 ms per step).

`use_dense_wgrad_fusion()` gives Megatron's linear layers that extension's two functions, made
of what this repository has:
- `wgrad_gemm_accum_fp32(input, grad_output, main_grad)`: main_grad += grad_output^T @ input,
  on CUDA by the accumulating CUTLASS GEMM the MegaMoE experts use (one group: the fp32 product
  added unrounded in the epilogue, as APEX does); elsewhere, or for operands that GEMM does not
  take, the bf16 product added (the bits of Megatron's unfused path and DDP's add).
- `wgrad_gemm_accum_fp16(input, grad_output, main_grad)`: the same into a 16-bit main_grad.
Process-global and idempotent; call it before the model is built (Megatron's layers check the
extension in their constructors), then set `gradient_accumulation_fusion=True` in the config.
"""

from __future__ import annotations

import types

import torch

__all__ = ["use_dense_wgrad_fusion", "dense_wgrad_fusion_installed", "wgrad_gemm_accum_fp32", "wgrad_gemm_accum_fp16"]

# (rows, device) -> int32 [1] holding rows: the one group's end, read by the GEMM on the device
_GROUP_ENDS: dict[tuple, torch.Tensor] = {}


def _cutlass_accumulate(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> bool:
    """main_grad += grad_output^T @ total_input by the CUTLASS K-grouped GEMM, if it takes them."""
    from megamoe_train.backends import cutlass_gemm

    dev = main_grad.device
    ok = (
        total_input.dtype == grad_output.dtype == torch.bfloat16
        and main_grad.dtype == torch.float32
        and main_grad.is_contiguous()
        and total_input.is_contiguous()
        and grad_output.is_contiguous()
        and main_grad.shape[0] % 8 == 0
        and main_grad.shape[1] % 8 == 0
        and cutlass_gemm.takes(total_input, grad_output, main_grad)
    )
    if not ok:
        return False
    rows = total_input.shape[0]
    ends = _GROUP_ENDS.get((rows, dev))
    if ends is None:
        ends = _GROUP_ENDS[(rows, dev)] = torch.full((1,), rows, dtype=torch.int32, device=dev)
    variant, swizzle = cutlass_gemm.bf16_wgrad_accumulate_config(rows)
    cutlass_gemm.bf16_wgrad_grouped_gemm_accumulate(
        grad_output, total_input, ends, main_grad.view(1, *main_grad.shape), variant, swizzle
    )
    return True


def _check(total_input, grad_output, main_grad):
    if (
        total_input.dim() != 2
        or grad_output.dim() != 2
        or main_grad.dim() != 2
        or main_grad.shape != (grad_output.shape[1], total_input.shape[1])
        or total_input.shape[0] != grad_output.shape[0]
    ):
        raise ValueError(
            f"dense wgrad fusion: input [T, in], grad_output [T, out] and main_grad [out, in] expected, got "
            f"{list(total_input.shape)}, {list(grad_output.shape)} and {list(main_grad.shape)}"
        )


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad (fp32 [out, in]) += grad_output [T, out]^T @ total_input [T, in]."""
    _check(total_input, grad_output, main_grad)
    if not _cutlass_accumulate(total_input, grad_output, main_grad):
        main_grad.add_(grad_output.t().matmul(total_input))


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad (fp16 / bf16 [out, in]) += grad_output^T @ total_input."""
    _check(total_input, grad_output, main_grad)
    main_grad.add_(grad_output.t().matmul(total_input))


_extension = types.SimpleNamespace(
    wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32, wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16
)


def use_dense_wgrad_fusion() -> bool:
    """Give Megatron's linear layers the functions above as `fused_weight_gradient_mlp_cuda`
    (where APEX's real one is imported, it stays). Returns whether the layers can fuse."""
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "_grad_accum_fusion_available", False):
        return True
    layers.fused_weight_gradient_mlp_cuda = _extension
    layers._grad_accum_fusion_available = True
    return True


def dense_wgrad_fusion_installed() -> bool:
    from megatron.core.tensor_parallel import layers

    return getattr(layers, "fused_weight_gradient_mlp_cuda", None) is _extension
