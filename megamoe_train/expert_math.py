"""Expert math shared by both executors and the protocol's shared-expert path: SwiGLU on an
interleaved fc1 output, its backward, and the dense shared-expert MLP. Plain torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import quantize_act


def split_gate_up(h: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up columns of an interleaved fc1 output [n, 2I] -> two [n, I] tensors."""
    n, width = h.shape
    pairs = h.view(n, width // (2 * chunk), 2, chunk)
    return pairs[:, :, 0, :].reshape(n, width // 2), pairs[:, :, 1, :].reshape(n, width // 2)


def join_gate_up(g: torch.Tensor, u: torch.Tensor, chunk: int) -> torch.Tensor:
    n, half = g.shape
    return torch.stack((g.view(n, half // chunk, chunk), u.view(n, half // chunk, chunk)), dim=2).reshape(n, 2 * half)


def swiglu(h: torch.Tensor, chunk: int, clamp: float | None) -> torch.Tensor:
    """silu(min(g, c)) * clamp(u, -c, c) of an interleaved [n, 2I] pre-activation, in float32."""
    g, u = split_gate_up(h.float(), chunk)
    if clamp is not None:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    return F.silu(g) * u


def swiglu_backward(h: torch.Tensor, chunk: int, clamp: float | None, grad_s: torch.Tensor) -> torch.Tensor:
    """d(pre-activation) [n, 2I] (interleaved) from d(silu(g)*u) [n, I], in float32."""
    g, u = split_gate_up(h.float(), chunk)
    g_mask = u_mask = None
    if clamp is not None:
        g_mask, u_mask = g <= clamp, (u >= -clamp) & (u <= clamp)  # torch.clamp's gradient rule
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    sig = torch.sigmoid(g)
    silu_g = g * sig
    grad_g = grad_s * u * sig * (1 + g * (1 - sig))
    grad_u = grad_s * silu_g
    if clamp is not None:
        grad_g, grad_u = grad_g * g_mask, grad_u * u_mask
    return join_gate_up(grad_g, grad_u, chunk)


def store_act(a32: torch.Tensor, recipe, dtype: torch.dtype):
    """How an activation row is stored for the next GEMM or for peers: the recipe's quantization
    (data, scales), or a cast to the compute dtype (data, None)."""
    return quantize_act(a32 if recipe.quantized else a32.to(dtype), recipe)


def shared_forward(x, w1, w2, clamp, compute_dtype):
    """Dense shared-expert MLP (fc1 [gate; up]): GEMMs in compute_dtype with fp32 accumulation,
    SwiGLU in fp32. Returns (out in compute_dtype, pre-activation)."""
    h = x.to(compute_dtype) @ w1.to(compute_dtype).t()
    s = swiglu(h, w2.shape[1], clamp)  # [gate; up] is the interleave with one chunk of width W
    return s.to(compute_dtype) @ w2.to(compute_dtype).t(), h


def shared_backward(x, w1, w2, h, clamp, grad_out, compute_dtype):
    """(dx, dw1, dw2) of shared_forward."""
    width = w2.shape[1]
    cd = compute_dtype
    grad_out = grad_out.to(cd)
    s = swiglu(h, width, clamp).to(cd)
    grad_w2 = grad_out.t() @ s
    grad_h = swiglu_backward(h, width, clamp, (grad_out @ w2.to(cd)).float()).to(cd)
    return grad_h @ w1.to(cd), grad_h.t() @ x.to(cd), grad_w2
