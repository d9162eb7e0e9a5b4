"""An independent dense MoE: the function mega_moe must compute, written as directly as possible
(token loop per expert, Megatron's [gate; up] fc1 order, autograd for every gradient).

Quantized recipes apply the recipe's quantize-dequantize with a straight-through gradient to
x, the expert weights and the L2 input, which is what the recipe defines. With a quantized
dgrad (recipe.grad_format: fp8, mxfp8_mxfp4) each expert GEMM's input gradient is computed from
the output gradient as the recipe stores it and the weight as the recipe quantizes it for the
dgrad, the master weight transposed and blocked along the dgrad's reduction dim
(quant.quantize_weight_t; for fp8 the forward's values); dgrad_quant=False gives the plain fp32
gradient against the forward's weights.
With a quantized wgrad (recipe.wgrad_format, fp8) each expert GEMM's weight gradient reads the
output gradient (rounded to the compute dtype) and the GEMM's input quantized in 128-row blocks
along the expert's rows, which is why dense_moe_ranks sees every rank's tokens at once: an
expert's rows are every source rank's (token, slot) pairs in (rank, token, slot) order, the
owner's pool order (wgrad_quant=False gives the plain fp32 product)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megamoe_train.quant import (
    dequantize_weight,
    fake_quantize_act,
    fake_quantize_grad,
    fake_quantize_tokens,
    quantize_weight,
    quantize_weight_t,
)


def _ste(t, fq):
    return t + (fq(t.detach()).to(t.dtype) - t).detach()


class _ExpertLinear(torch.autograd.Function):
    """a @ w^T over one expert's rows. Backward: the input gradient reads the output gradient
    through fq_dgrad and the weight as w_dgrad (quantized dgrad: the weight quantized for it, same
    shape as w), the weight gradient reads the output gradient through fq_wgrad_out and a through
    fq_wgrad_in (quantized wgrad); None = unquantized (w_dgrad None: w)."""

    @staticmethod
    def forward(ctx, a, w, w_dgrad, fq_dgrad, fq_wgrad_out, fq_wgrad_in):
        ctx.save_for_backward(a, w, w if w_dgrad is None else w_dgrad)
        ctx.fq = (fq_dgrad, fq_wgrad_out, fq_wgrad_in)
        return a @ w.t()

    @staticmethod
    def backward(ctx, grad_out):
        a, w, w_dgrad = ctx.saved_tensors
        fq_dgrad, fq_wgrad_out, fq_wgrad_in = ctx.fq
        dgrad = (fq_dgrad(grad_out) if fq_dgrad else grad_out) @ w_dgrad
        if fq_wgrad_out:
            wgrad = fq_wgrad_out(grad_out).t() @ fq_wgrad_in(a)
        else:
            wgrad = grad_out.t() @ a
        return dgrad, wgrad, None, None, None, None


def _linear(a, w, fq, w_dgrad=None):
    return a @ w.t() if fq is None else _ExpertLinear.apply(a, w, w_dgrad, *fq)


def swiglu_act(x, w1, w2, clamp, fq=None, w1_dgrad=None):
    """silu(gate) * up of x under fc1 w1 ([gate; up]); w2 only gives the width."""
    inter = w2.shape[-1]
    h = _linear(x, w1, fq, w1_dgrad)
    g, u = h[:, :inter], h[:, inter:]
    if clamp is not None:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    return F.silu(g) * u


def _grad_quantizers(cfg, dgrad_quant: bool, wgrad_quant: bool):
    """(fq_dgrad, fq_wgrad_out, fq_wgrad_in) for the expert GEMMs, or None if all are plain."""
    recipe = cfg.precision
    fq_dgrad = (lambda g: fake_quantize_grad(g, recipe)) if recipe.quantized_dgrad and dgrad_quant else None
    fq_wgrad_out = fq_wgrad_in = None
    if recipe.quantized_wgrad and wgrad_quant:
        fq_wgrad_out = lambda g: fake_quantize_tokens(g.to(cfg.dtype), recipe)  # noqa: E731
        fq_wgrad_in = lambda a: fake_quantize_tokens(a, recipe)  # noqa: E731
    if fq_dgrad is None and fq_wgrad_out is None:
        return None
    return fq_dgrad, fq_wgrad_out, fq_wgrad_in


def _dgrad_weight(w, recipe):
    """The value [E, N, K] (like w) a quantized dgrad reads for master weights w: quantize_weight_t's."""
    return dequantize_weight(*quantize_weight_t(w.detach().float(), recipe), recipe).mT


def dense_moe_ranks(xs, idxs, tws, w1, w2, cfg, shared=None, dgrad_quant=True, wgrad_quant=True):
    """Every rank's tokens at once: xs[r] [T_r, H], idxs[r] [T_r, K], tws[r] [T_r, K]; w1 [E, 2I, H]
    and w2 [E, H, I] of ALL experts; shared: per rank (shared_w1, shared_w2) or None. Returns y
    per rank."""
    recipe = cfg.precision
    f32 = torch.float32
    fq = _grad_quantizers(cfg, dgrad_quant, wgrad_quant)
    w1d = w2d = None  # the weights the dgrads read, where the recipe quantizes them for it
    if recipe.quantized:
        fq_act = lambda t: fake_quantize_act(t, recipe)  # noqa: E731
        fq_w = lambda t: dequantize_weight(*quantize_weight(t, recipe), recipe)  # noqa: E731
        xqs = [_ste(x.to(f32), fq_act) for x in xs]
        w1q, w2q = _ste(w1.to(f32), fq_w), _ste(w2.to(f32), fq_w)
        if fq is not None and fq[0] is not None:
            w1d, w2d = _dgrad_weight(w1, recipe), _dgrad_weight(w2, recipe)
    else:  # the bf16 recipe keeps weights and activations in the compute dtype
        xqs = [x.to(cfg.dtype).to(f32) for x in xs]
        w1q, w2q = (t.to(cfg.dtype).to(f32) for t in (w1, w2))
    ys = [torch.zeros(x.shape[0], cfg.hidden, dtype=f32) for x in xs]
    for e in range(cfg.num_experts):
        routed = [(idx == e).nonzero(as_tuple=True) for idx in idxs]  # (tokens, slots) per rank
        counts = [tokens.numel() for tokens, _ in routed]
        if not sum(counts):
            continue
        x_e = torch.cat([xq[tokens] for xq, (tokens, _) in zip(xqs, routed)])
        w_e = torch.cat([tw[tokens, slots] for tw, (tokens, slots) in zip(tws, routed)])
        pick = lambda w: None if w is None else w[e]  # noqa: E731
        a = swiglu_act(x_e, w1q[e], w2q[e], cfg.activation_clamp, fq, pick(w1d)) * w_e[:, None]
        if recipe.quantized:
            a = _ste(a, fq_act)
        elif cfg.dtype != f32:
            a = a.to(cfg.dtype).to(f32)  # the L2 input travels in the compute dtype
        out = _linear(a, w2q[e], fq, pick(w2d)).split(counts)
        for r, (tokens, _) in enumerate(routed):
            ys[r] = ys[r].index_add(0, tokens, out[r])
    for r, x in enumerate(xs):
        sw1, sw2 = shared[r] if shared else (None, None)
        if sw1 is not None:
            ys[r] = ys[r] + swiglu_act(x.to(f32), sw1.to(f32), sw2.to(f32), cfg.activation_clamp) @ sw2.to(f32).t()
    return ys


def dense_moe(
    x, topk_idx, topk_weights, w1, w2, cfg, shared_w1=None, shared_w2=None, dgrad_quant=True, wgrad_quant=True
):
    """One rank's tokens: x [T,H], topk_idx [T,K], topk_weights [T,K], w1 [E,2I,H] and w2 [E,H,I] of
    ALL experts. (With a quantized wgrad, gradients of w1 / w2 need dense_moe_ranks over all ranks.)"""
    return dense_moe_ranks(
        [x], [topk_idx], [topk_weights], w1, w2, cfg, [(shared_w1, shared_w2)], dgrad_quant, wgrad_quant
    )[0]
