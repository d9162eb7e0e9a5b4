"""An independent dense MoE: the function mega_moe must compute, written as directly as possible
(token loop per expert, Megatron's [gate; up] fc1 order, autograd for every gradient).

Quantized recipes apply the recipe's quantize-dequantize with a straight-through gradient to
x, the expert weights and the L2 input, which is what the recipe defines. With a quantized
dgrad (recipe.grad_format, fp8) each expert GEMM's input gradient is computed from the
output gradient as the recipe stores it (dgrad_quant=False gives the plain fp32 gradient)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megamoe_train.quant import dequantize_weight, fake_quantize_act, fake_quantize_grad, quantize_weight


def _ste(t, fq):
    return t + (fq(t.detach()).to(t.dtype) - t).detach()


class _QuantizedDgradLinear(torch.autograd.Function):
    """a @ w^T whose input gradient reads the output gradient through fq (quantized dgrad);
    the weight gradient reads it unquantized."""

    @staticmethod
    def forward(ctx, a, w, fq):
        ctx.save_for_backward(a, w)
        ctx.fq = fq
        return a @ w.t()

    @staticmethod
    def backward(ctx, grad_out):
        a, w = ctx.saved_tensors
        return ctx.fq(grad_out) @ w, grad_out.t() @ a, None


def _linear(a, w, fq_grad):
    return a @ w.t() if fq_grad is None else _QuantizedDgradLinear.apply(a, w, fq_grad)


def swiglu_act(x, w1, w2, clamp, fq_grad=None):
    """silu(gate) * up of x under fc1 w1 ([gate; up]); w2 only gives the width."""
    inter = w2.shape[-1]
    h = _linear(x, w1, fq_grad)
    g, u = h[:, :inter], h[:, inter:]
    if clamp is not None:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    return F.silu(g) * u


def dense_moe(x, topk_idx, topk_weights, w1, w2, cfg, shared_w1=None, shared_w2=None, dgrad_quant=True):
    """x [T,H], topk_idx [T,K], topk_weights [T,K], w1 [E,2I,H] and w2 [E,H,I] of ALL experts."""
    recipe = cfg.precision
    f32 = torch.float32
    fq_grad = (lambda g: fake_quantize_grad(g, recipe)) if recipe.quantized_dgrad and dgrad_quant else None
    if recipe.quantized:
        fq_act = lambda t: fake_quantize_act(t, recipe)
        fq_w = lambda t: dequantize_weight(*quantize_weight(t, recipe), recipe)
        xq = _ste(x.to(f32), fq_act)
        w1q, w2q = _ste(w1.to(f32), fq_w), _ste(w2.to(f32), fq_w)
    else:  # the bf16 recipe keeps weights and activations in the compute dtype
        xq, w1q, w2q = (t.to(cfg.dtype).to(f32) for t in (x, w1, w2))
    y = torch.zeros(x.shape[0], cfg.hidden, dtype=f32)
    for e in range(cfg.num_experts):
        tokens, slots = (topk_idx == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        a = swiglu_act(xq[tokens], w1q[e], w2q[e], cfg.activation_clamp, fq_grad) * topk_weights[tokens, slots, None]
        if recipe.quantized:
            a = _ste(a, fq_act)
        elif cfg.dtype != f32:
            a = a.to(cfg.dtype).to(f32)  # the L2 input travels in the compute dtype
        y = y.index_add(0, tokens, _linear(a, w2q[e], fq_grad))
    if shared_w1 is not None:
        y = y + swiglu_act(x.to(f32), shared_w1.to(f32), shared_w2.to(f32), cfg.activation_clamp) @ shared_w2.to(f32).t()
    return y
