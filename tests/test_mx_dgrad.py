"""The mxfp8_mxfp4 recipe's dgrads in the oracle (backends/reference.py): the two dgrad GEMMs read
the output gradient as MXFP8 (e4m3, 1x32 ue8m0 blocks along the GEMM's K) and the weights as the
E2M1 copies of the transposed master weights (quant.quantize_weight_t: W2^T [I, H] blocked along
H, W1^T [H, 2I] in master order blocked along 2I); the wgrads read the unquantized gradients.
Checked on CPU against a float64 dense computation of the same definition, written per (token,
slot) from the routing and the master weights: T not a multiple of any tile, masked slots, an
empty expert, H and I multiples of 32 but not of 128, with and without the clamp."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megamoe_train import MegaMoEConfig
from megamoe_train.backends.reference import ReferenceExecutor, ReferencePoolInputs
from megamoe_train.plan import build_plan
from megamoe_train.precision import RECIPES
from megamoe_train.quant import (
    dequantize_weight,
    fake_quantize_act,
    fake_quantize_grad,
    quantize_act,
    quantize_weight,
    quantize_weight_t,
)
from megamoe_train.weights import transform_weights

MX = RECIPES["mxfp8_mxfp4"]
EMPTY_EXPERT = 2


def _problem(T, E, H, I, K, clamp, seed):
    cfg = MegaMoEConfig(
        num_experts=E,
        hidden=H,
        intermediate=I,
        topk=K,
        num_max_tokens_per_rank=T + 3,
        recipe=MX.name,
        dtype=torch.float32,
        activation_clamp=clamp,
    )
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])
    ids[ids >= EMPTY_EXPERT] += 1  # no slot on EMPTY_EXPERT
    ids[torch.rand(T, K, generator=g) < 0.25] = -1  # masked slots
    ids[0] = -1  # a token routed nowhere
    # per-row magnitudes spread over a few binades, so the 1x32 scales differ along both axes
    spread = (
        lambda *shape: (
            torch.randn(*shape, generator=g)
            * torch.exp2(  # noqa: E731
                torch.randint(-4, 5, shape[:-1], generator=g).float()
            ).unsqueeze(-1)
        )
    )
    return dict(
        cfg=cfg,
        ids=ids,
        x=spread(T, H),
        tw=torch.rand(T, K, generator=g) + 0.1,
        gy=spread(T, H),
        w1=spread(E, 2 * I, H) * H**-0.5,
        w2=spread(E, H, I) * I**-0.5,
    )


def _reference_backward(p):
    """The reference executor's forward + backward of one rank holding every expert: per pool row,
    (token, slot), dX and d(topk weight); and grad_w1, grad_w2."""
    cfg, ids = p["cfg"], p["ids"]
    T, K = ids.shape
    ids_full = torch.full((1, cfg.num_max_tokens_per_rank, K), -1, dtype=torch.int64)
    ids_full[0, :T] = ids
    plan = build_plan(ids_full, 0, cfg.num_experts, 1)
    P = plan.pool_rows
    token = torch.full((P,), -1, dtype=torch.long)
    live = int(plan.num_rows)
    real = plan.row_recv[:live] >= 0
    token[:live][real] = plan.recv_token.long()[plan.row_recv[:live][real].long()]
    slot = plan.row_slot.long()
    present = token >= 0
    x_q, x_s = quantize_act(p["x"], MX)  # the stored input rows (MXFP8)
    pool_x = torch.zeros(P, cfg.hidden, dtype=torch.uint8)
    pool_s = torch.zeros(P, cfg.hidden // 32, dtype=torch.uint8)
    pool_x[present], pool_s[present] = x_q.view(torch.uint8)[token[present]], x_s[token[present]]
    row_w = torch.zeros(P)
    row_w[present] = p["tw"][token[present], slot[present]]
    pool_grad = torch.zeros(P, cfg.hidden)
    pool_grad[present] = p["gy"][token[present]]
    weights = transform_weights(p["w1"], p["w2"], cfg)
    ref = ReferenceExecutor()
    pool = ReferencePoolInputs(pool_x.view(torch.float8_e4m3fn), pool_s, row_w)
    _, state = ref.experts_forward(cfg, weights, plan, pool)
    dx, dtw, grad_w1, grad_w2 = ref.experts_backward(cfg, weights, plan, state, pool_grad)
    return token[present], slot[present], dx[present], dtw[present], grad_w1, grad_w2


def _dense_backward(p, dgrad_weights="transposed", quantized_grads=True):
    """float64, per (token, slot) routed to expert e: x_q the stored input, h = x_q W1[e]^T and
    s = SwiGLU(h) on the forward's weights (E2M1 along H / I); dA = Q(dY) W2d[e], d(topk weight) =
    dA . s, dH = SwiGLU'(h)^T (dA * topk weight) [gate | up], dX = Q(dH) W1d[e], with Q the MXFP8
    quantize-dequantize and W1d, W2d the dgrad's weights: "transposed" quantize_weight_t's (the
    recipe), "forward" the forward's; quantized_grads=False: Q the identity. The wgrads: dW2[e] =
    sum dY a_q^T (a_q the stored L2 input), dW1[e] = sum dH x_q^T, unquantized gradients."""
    cfg, ids = p["cfg"], p["ids"]
    f64 = torch.float64
    I = cfg.intermediate
    fwd = lambda w: dequantize_weight(*quantize_weight(w, MX), MX).to(f64)  # noqa: E731
    w1f, w2f = fwd(p["w1"]), fwd(p["w2"])
    if dgrad_weights == "transposed":
        dgrad = lambda w: dequantize_weight(*quantize_weight_t(w, MX), MX).mT.to(f64)  # noqa: E731
        w1d, w2d = dgrad(p["w1"]), dgrad(p["w2"])
    else:
        w1d, w2d = w1f, w2f
    q = (lambda t: fake_quantize_grad(t.float(), MX).to(f64)) if quantized_grads else (lambda t: t)  # noqa: E731
    clamp = cfg.activation_clamp
    grad_w1, grad_w2 = torch.zeros(w1f.shape, dtype=f64), torch.zeros(w2f.shape, dtype=f64)
    out = {}
    for t, k in (ids >= 0).nonzero().tolist():
        e = int(ids[t, k])
        x_q = fake_quantize_act(p["x"][t], MX).to(f64)
        h = (x_q @ w1f[e].t()).requires_grad_()
        g, u = h[:I], h[I:]
        if clamp is not None:
            g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
        s = F.silu(g) * u
        w = float(p["tw"][t, k])
        dy = p["gy"][t].to(f64)
        da = q(dy) @ w2d[e]
        (dh,) = torch.autograd.grad(s, h, da * w)
        a_q = fake_quantize_act((s * w).detach().float(), MX).to(f64)
        out[t, k] = (q(dh) @ w1d[e], (da * s).sum().detach())
        grad_w2[e] += torch.outer(dy, a_q)
        grad_w1[e] += torch.outer(dh, x_q)
    return out, grad_w1, grad_w2


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(
    "shape, clamp, seed",
    [((37, 4, 96, 64, 3), None, 1), ((53, 5, 160, 96, 2), 1.5, 2), ((29, 3, 64, 32, 2), 0.75, 3)],
    ids=["T37_E4_H96_I64", "T53_E5_H160_I96_clamp", "T29_E3_H64_I32_clamp"],
)
def test_oracle_mx_dgrads_against_float64(shape, clamp, seed):
    T, E, H, I, K = shape
    p = _problem(T, E, H, I, K, clamp, seed)
    tokens, slots, dx, dtw, grad_w1, grad_w2 = _reference_backward(p)
    assert len(tokens) == int((p["ids"] >= 0).sum())
    dense, dense_w1, dense_w2 = _dense_backward(p)
    want_dx = torch.stack([dense[t, k][0] for t, k in zip(tokens.tolist(), slots.tolist())])
    want_dtw = torch.stack([dense[t, k][1] for t, k in zip(tokens.tolist(), slots.tolist())])
    # d(topk weight) reads dA only: fp32 against float64. dX reads the MXFP8 dH, quantized from the
    # oracle's fp32 dH here and from the float64 one there: an element on a rounding boundary may
    # take the neighbouring e4m3 code (one step is 1/8 to 1/16 of it), rarely.
    assert rel(dtw, want_dtw) < 1e-5
    assert rel(dx, want_dx) < 2e-3
    # the wgrads read the unquantized gradients (bf16 on the GPU; fp32 here)
    assert rel(grad_w2, dense_w2) < 1e-5 and rel(grad_w1, dense_w1) < 1e-5
    assert not grad_w1[EMPTY_EXPERT].any() and not grad_w2[EMPTY_EXPERT].any()

    # The check tells the recipe's dgrad weights from the forward's and quantized gradients from
    # unquantized ones: each alternative is at least several times further off.
    for alternative in (dict(dgrad_weights="forward"), dict(quantized_grads=False)):
        other, _, _ = _dense_backward(p, **alternative)
        other_dx = torch.stack([other[t, k][0] for t, k in zip(tokens.tolist(), slots.tolist())])
        other_dtw = torch.stack([other[t, k][1] for t, k in zip(tokens.tolist(), slots.tolist())])
        assert rel(dx, other_dx) > 1e-2 and rel(dtw, other_dtw) > 5e-3, (alternative, rel(dx, other_dx))


def test_mx_dgrad_weights_are_a_quantization_of_their_own():
    """W2^T and W1^T are blocked along H and 2I: quantize_weight of the transposed master, not the
    forward's E2M1 codes transposed (1x32 blocks are not square), and what the oracle reads."""
    p = _problem(9, 3, 96, 64, 2, None, 4)
    weights = transform_weights(p["w1"], p["w2"], p["cfg"])
    for got, got_scales, master in (
        (weights.w1_t, weights.w1_t_scales, p["w1"]),
        (weights.w2_t, weights.w2_t_scales, p["w2"]),
    ):
        data, scales = quantize_weight(master.mT.contiguous(), MX)
        assert torch.equal(got, data) and torch.equal(got_scales, scales)
    forward_values = dequantize_weight(*quantize_weight(p["w2"], MX), MX).mT
    assert not torch.equal(weights.dequantize_w2_t(), forward_values)
    assert torch.equal(weights.dequantize_w2_t(), dequantize_weight(weights.w2_t, weights.w2_t_scales, MX))
