"""AdamW that also writes the model's bf16 copy of each parameter, in one pass (Triton, CUDA).

Megatron's bf16 optimizer keeps fp32 main params for Adam and, after each step, copies them into
the model's bf16 params (`_copy_main_params_to_model_params`): a second pass that reads every fp32
main param again (4 bytes) and writes 2. Here the Adam pass, which has the updated value in
registers, writes the bf16 copy itself: per element it reads param, grad, exp_avg, exp_avg_sq
(16 bytes) and writes param, exp_avg, exp_avg_sq and the copy (14 bytes), one launch per tensor.
The moments may also be kept in bf16 (DeepSeek-V3's recipe; Megatron's precision-aware optimizer
offers the same with Transformer Engine): read into fp32, updated in fp32, stored rounded to nearest
even, 22 bytes per element instead of 30.

The math is torch's AdamW (`torch.optim.AdamW`, the fused CUDA kernel's order of operations), in
fp32 with IEEE-rounded division and square root:
    g = grad / grad_scale                      (grad_scale: the clip coefficient's inverse, or none)
    param -= lr * weight_decay * param
    exp_avg = beta1 * exp_avg + (1 - beta1) * g
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
    param -= (lr / (1 - beta1^t)) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^t) + eps)
    model_param = bf16(param)                  (round to nearest even, as a copy would)
with the scalar factors (lr * weight_decay, 1 - beta, the bias corrections) computed on the host in
double from the step count t and rounded to fp32 once. bf16 moments: the step uses the fp32 moments
it computed; the next step reads them rounded. A bf16 value changes only where the update exceeds
half its rounding step (2^-9 to 2^-8 of it), so exp_avg_sq stops short of g^2 by up to
2^-8 / (1 - beta2) of itself: 8% at DeepSeek-V3's beta2 = 0.95, 39% at 0.99, and at 0.999 it can
no longer decay at all. The trainer refuses bf16 moments above beta2 = 0.99.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["adamw_update", "BLOCK", "MOMENT_DTYPES"]

BLOCK = 4096  # elements per program: 16 KB of each fp32 stream, enough bytes in flight per SM
MOMENT_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _adamw_kernel(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    copy_ptr,
    grad_scale_ptr,
    n,
    lr_weight_decay,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    step_size,
    bias_correction2_sqrt,
    HAS_SCALE: tl.constexpr,
    HAS_COPY: tl.constexpr,
    M_BF16: tl.constexpr,
    V_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(param_ptr + offs, mask=mask)
    g = tl.load(grad_ptr + offs, mask=mask)
    m = tl.load(exp_avg_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask).to(tl.float32)
    if HAS_SCALE:
        g = tl.div_rn(g, tl.load(grad_scale_ptr))
    p = p - lr_weight_decay * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - tl.div_rn(step_size * m, denom)
    tl.store(param_ptr + offs, p, mask=mask)
    if M_BF16:
        m = m.to(tl.bfloat16, fp_downcast_rounding="rtne")
    if V_BF16:
        v = v.to(tl.bfloat16, fp_downcast_rounding="rtne")
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    if HAS_COPY:
        tl.store(copy_ptr + offs, p.to(copy_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    model_copy: torch.Tensor | None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One AdamW step of `param` (fp32, in place) and its moments (fp32 or bf16 each) at step count
    `step` (1 for the first), writing `model_copy` (a bf16 tensor of param's numel) where given.
    All contiguous, on one device."""
    n = param.numel()
    for name, t, dtypes in (
        ("grad", grad, (torch.float32,)),
        ("exp_avg", exp_avg, MOMENT_DTYPES),
        ("exp_avg_sq", exp_avg_sq, MOMENT_DTYPES),
    ):
        if t.dtype not in dtypes or t.numel() != n or not t.is_contiguous() or t.device != param.device:
            kinds = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(
                f"adamw_update: {name} must be a contiguous {kinds} tensor of param's numel and device, "
                f"got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
    if param.dtype != torch.float32 or not param.is_contiguous():
        raise ValueError(f"adamw_update: param must be contiguous fp32, got {param.dtype}")
    if model_copy is not None and (
        model_copy.numel() != n or not model_copy.is_contiguous() or model_copy.dtype != torch.bfloat16
    ):
        raise ValueError(
            f"adamw_update: model_copy must be a contiguous bf16 tensor of param's numel, "
            f"got {model_copy.dtype} {tuple(model_copy.shape)}"
        )
    if step < 1:
        raise ValueError(f"adamw_update: step counts from 1, got {step}")
    if n == 0:
        return
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        model_copy if model_copy is not None else param,
        grad_scale if grad_scale is not None else param,
        n,
        lr * weight_decay,
        beta1,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        eps,
        lr / bias_correction1,
        bias_correction2_sqrt,
        HAS_SCALE=grad_scale is not None,
        HAS_COPY=model_copy is not None,
        M_BF16=exp_avg.dtype == torch.bfloat16,
        V_BF16=exp_avg_sq.dtype == torch.bfloat16,
        BLOCK=BLOCK,
        num_warps=8,
    )
    # A kernel's writes are invisible to autograd's version counters, which caches key on (the fp8
    # expert weights are re-quantized when the bf16 parameter's version moves): count them as the
    # in-place torch ops they replace would.
    written = [param, exp_avg, exp_avg_sq] + ([model_copy] if model_copy is not None else [])
    torch.autograd.graph.increment_version(written)
