"""Checks of the triton executor's quantized backward (fp8, and mxfp8_mxfp4's MXFP8 dgrads; small
shapes), on any device Triton runs on:
tests/test_gpu_triton.py calls them on CUDA; `TRITON_INTERPRET=1 python tests/fp8_backward_checks.py`
runs them with Triton's CPU interpreter (test_triton_interpret.py does; the interpreter is chosen
when triton_kernels is imported, so it cannot share a process with CUDA Triton).

Triton's interpreter (3.x) converts fp32 to bf16 by truncation and to e4m3 with ties away
from zero, losing the carry when a value rounds up to a power of two; the GPU rounds to nearest
even. `exact_downcasts()` routes those two conversions through torch's (round to nearest even,
what the GPU does), so results here can be compared bit for bit with quant.py.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import torch
import triton.language as tl

from megamoe_train import MegaMoEConfig
from megamoe_train.backends import triton_kernels as K_
from megamoe_train.backends.reference import ReferenceExecutor, ReferencePoolInputs
from megamoe_train.backends.triton_backend import TritonExecutor, TritonPoolGrad, TritonPoolInputs
from megamoe_train.expert_math import shared_backward, shared_forward, swiglu, swiglu_backward
from megamoe_train.plan import build_plan
from megamoe_train.precision import RECIPES
from megamoe_train.quant import (
    dequantize_act,
    dequantize_grad,
    fold_mx_act,
    quantize_act,
    quantize_grad,
    quantize_tokens_t,
)
from megamoe_train.weights import deinterleave_gate_up, transform_weights

FP8, MX = RECIPES["fp8"], RECIPES["mxfp8_mxfp4"]
POISON_E4M3 = 0x7F  # an e4m3 NaN


def spread_randn(rows, cols, seed):
    """Random rows whose 128-column blocks get very different magnitudes; one all-zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x = x * torch.exp2(torch.randint(-10, 10, (rows, cols // 128), generator=g).float()).repeat_interleave(128, 1)
    x[min(3, rows - 1)] = 0
    return x


def exact_downcasts():
    """fp32 -> bf16 / e4m3 in the interpreter with torch's round-to-nearest-even (see above)."""
    from triton.runtime import interpreter

    convert = interpreter._convert_float  # fails loudly if the interpreter changes
    targets = {
        tl.bfloat16: (torch.bfloat16, torch.int16, np.uint16),
        tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8, np.uint8),
    }

    def exact(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype in targets:
            dtype, bits, np_bits = targets[output_dtype]
            values = torch.from_numpy(np.ascontiguousarray(input).view(np.float32).copy())
            return values.to(dtype).view(bits).numpy().view(np_bits).reshape(input.shape)
        return convert(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = exact


def assert_same_bits(got, want, what):
    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), f"{what}: bits differ"


def poisoned_e4m3(*shape, device):
    return torch.full(shape, POISON_E4M3, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)


def nans(*shape, device, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def live_rows(n, device):
    return torch.tensor([n], dtype=torch.int32, device=device)


def check_quantize_rows(device):
    """The pulled dY rows' quantization: bit for bit quant.quantize_grad; rows past num_rows untouched."""
    P, W, live = 96, 384, 70
    data = spread_randn(P, W, seed=1).to(torch.bfloat16)
    out, scales = poisoned_e4m3(P, W, device=device), nans(P, W // 128, device=device)
    K_.quantize_rows(data.to(device), out, scales, live_rows(live, device))
    out, scales = out.cpu(), scales.cpu()
    ref_q, ref_s = quantize_grad(data[:live], FP8)
    assert_same_bits(out[:live], ref_q, "quantize_rows data")
    assert torch.equal(scales[:live], ref_s), "quantize_rows scales"
    assert (out[live:].view(torch.uint8) == POISON_E4M3).all() and scales[live:].isnan().all(), (
        "rows past num_rows written"
    )


def same_values(got, want, what):
    """Equal as values, NaN where the other is NaN (a NaN's sign and payload may differ by device)."""
    got, want = got.float(), want.float()
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN positions differ"
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)), f"{what}: values differ"


def check_quantizers_keep_nan(device):
    """A NaN or inf in a block makes the block what quant.py makes it (NaN scale, NaN or zero
    codes), in the row quantizer (stored x, the dgrad's dY), the wgrad operands' and SwiGLU's
    requantization: the shared rounding helper must not clamp a NaN to -448 and take the other
    elements' amax (a NaN input would come out finite, and a NaN-poisoned row read by mistake
    would pass unseen)."""
    P, W = 8, 384
    data = spread_randn(P, W, seed=12)
    data[1, 5] = float("nan")
    data[2, 130] = float("inf")
    data[4, 300] = -float("inf")
    data[5, 7], data[5, 200] = float("nan"), float("inf")
    data = data.to(torch.bfloat16)
    out, scales = poisoned_e4m3(P, W, device=device), nans(P, W // 128, device=device)
    K_.quantize_rows(data.to(device), out, scales, live_rows(P, device))
    ref_q, ref_s = quantize_grad(data, FP8)
    same_values(scales.cpu(), ref_s, "quantize_rows scales (NaN / inf rows)")
    same_values(out.cpu(), ref_q, "quantize_rows data (NaN / inf rows)")

    # the wgrad operands: blocks of 128 rows per column
    src = spread_randn(256, 256, seed=13)
    src[3, 10] = float("nan")
    src[140, 20] = float("inf")
    src = src.to(torch.bfloat16)
    row_slot = torch.zeros(256, dtype=torch.int32)
    out_t, out_ts = poisoned_e4m3(256, 256, device=device), nans(256, 2, device=device)
    K_.quantize_tokens_t(src.to(device), None, row_slot.to(device), live_rows(256, device), out_t, out_ts)
    want_t, want_ts = quantize_tokens_t(src.float(), RECIPES["fp8_e4m3_wgrad"])
    same_values(out_ts.cpu(), want_ts, "quantize_tokens_t scales (NaN / inf)")
    same_values(out_t.cpu(), want_t, "quantize_tokens_t data (NaN / inf)")

    # SwiGLU's requantization of a = silu(g) * u * w: a NaN pre-activation gives a NaN block
    h = torch.randn(4, 512, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    h[2, 3] = float("nan")
    row_w = torch.ones(4)
    act, act_s = poisoned_e4m3(4, 256, device=device), nans(4, 2, device=device)
    K_.swiglu_forward(h.to(device), row_w.to(device), act, act_s, live_rows(4, device), 128, None)
    assert act_s.cpu()[2, 0].isnan() and not act_s.cpu()[[0, 1, 3]].isnan().any(), "swiglu_forward scale of a NaN block"
    assert act.cpu()[2, :128].float().isnan().all(), "swiglu_forward: a NaN block's codes"


def _wgrad_pool(seed):
    """row_slot of a 128-aligned pool: experts of 130, 0, 200 and 50 rows (ends 256, 256, 512, 640),
    one more 128-row block past num_rows = 640 (P = 768)."""
    P, live = 768, 640
    g = torch.Generator().manual_seed(seed)
    row_slot = torch.full((P,), -1, dtype=torch.int32)
    for start, count in ((0, 130), (256, 200), (512, 50)):
        row_slot[start : start + count] = torch.randint(0, 4, (count,), generator=g, dtype=torch.int32)
    return row_slot, live


def check_quantize_tokens_t(device):
    """The wgrad operands' quantization (triton_kernels.quantize_tokens_t): bit for bit
    quant.quantize_tokens_t of the pool with its padding rows zeroed, from a bf16 source (dY, dH)
    and from an e4m3 source with 1x128 scales along C (x, a); padding rows hold NaN (they must
    read as zero); the output is poisoned and the block past num_rows must stay so; every column
    tile size."""
    row_slot, live = _wgrad_pool(seed=6)
    P = row_slot.shape[0]
    pad = row_slot < 0
    for C, source in ((384, "bf16"), (256, "e4m3")):
        values = spread_randn(C, P, seed=7).t().contiguous()  # magnitudes spread over (column, row block)
        if source == "bf16":
            src, src_scales = values.to(torch.bfloat16), None
            want_values = src.float()
            src = src.masked_fill(pad[:, None], float("nan"))
        else:
            src, src_scales = quantize_act(values, FP8)
            want_values = dequantize_act(src, src_scales, FP8)
            src = src.view(torch.uint8).masked_fill(pad[:, None], POISON_E4M3).view(torch.float8_e4m3fn)
            src_scales = src_scales.masked_fill(pad[:, None], float("nan"))
        want_q, want_s = quantize_tokens_t(want_values.masked_fill(pad[:, None], 0.0), RECIPES["fp8_e4m3_wgrad"])
        for block_c in (32, 64, 128):
            out, out_s = poisoned_e4m3(C, P, device=device), nans(C, P // 128, device=device)
            K_.quantize_tokens_t(
                src.to(device),
                None if src_scales is None else src_scales.to(device),
                row_slot.to(device),
                live_rows(live, device),
                out,
                out_s,
                block_c=block_c,
            )
            out, out_s = out.cpu(), out_s.cpu()
            what = f"quantize_tokens_t ({source} source, block_c {block_c})"
            assert_same_bits(out[:, :live], want_q[:, :live], f"{what} data")
            assert torch.equal(out_s[:, : live // 128], want_s[:, : live // 128]), f"{what} scales"
            assert (out[:, live:].view(torch.uint8) == POISON_E4M3).all(), f"{what}: a block past num_rows was written"
            assert out_s[:, live // 128 :].isnan().all(), f"{what}: a scale past num_rows was written"


def _as_dgrad_reads(values, mx: bool):
    """quant.py's dgrad operand of fp32 rows: fp8's e4m3 + 1x128 scales, or mxfp8_mxfp4's MXFP8
    folded to 1x128 power-of-two scales (what the GPU's fp8 MMA reads)."""
    return fold_mx_act(*quantize_grad(values, MX)) if mx else quantize_grad(values, FP8)


def check_swiglu_backward_quantized(device, clamp, mx=False):
    """dH in master order, in bf16 and as e4m3 + 1x128 scales (what the fp8 L1 dgrad reads; mx:
    MXFP8 folded, what the MX L1 dgrad reads)."""
    P, inter, chunk, live = 48, 256, 128, 40
    g = torch.Generator().manual_seed(2)
    h = (torch.randn(P, 2 * inter, generator=g) * 2).to(torch.bfloat16)  # interleaved, forward's layout
    row_w = torch.rand(P, generator=g) + 0.1
    grad_act = spread_randn(P, inter, seed=3).to(torch.bfloat16)
    grad_h, grad_w = nans(P, 2 * inter, device=device, dtype=torch.bfloat16), nans(P, device=device)
    grad_h_q, grad_h_s = poisoned_e4m3(P, 2 * inter, device=device), nans(P, 2 * inter // 128, device=device)
    K_.swiglu_backward(
        h.to(device),
        row_w.to(device),
        grad_act.to(device),
        grad_h,
        grad_w,
        live_rows(live, device),
        chunk,
        clamp,
        grad_h_q,
        grad_h_s,
        mx=mx,
    )
    grad_h, grad_h_q, grad_h_s = grad_h.cpu(), grad_h_q.cpu(), grad_h_s.cpu()
    ref = swiglu_backward(h[:live], chunk, clamp, grad_act[:live].float() * row_w[:live, None])
    ref = deinterleave_gate_up(ref, chunk, dim=1)  # master order [gate | up]
    assert torch.allclose(grad_h[:live].float(), ref, rtol=2e-2, atol=1e-30), "grad_h (bf16, master order)"
    # The e4m3 dH is the kernel's fp32 dH quantized in master-order 1x128 blocks (mx: 1x32, then
    # folded): the same codes and scales as quantizing the torch fp32 dH, but for the few elements
    # where the kernel's exp differs from torch's sigmoid in the last bit and a value sits on a
    # rounding boundary (mx: or a 1x32 block's largest on a power of two).
    ref_q, ref_s = _as_dgrad_reads(ref, mx)
    if mx:
        assert (grad_h_s[:live] == ref_s).float().mean() > 0.99, "grad_h scales (mx)"
    else:
        assert torch.allclose(grad_h_s[:live], ref_s, rtol=4e-6, atol=0), "grad_h scales"
    same = grad_h_q[:live].float() == ref_q.float()  # as values: a masked (clamped) zero's sign may differ
    assert same.float().mean() > 0.99, f"grad_h e4m3: {1 - same.float().mean():.2%} of codes differ"
    deq, want = dequantize_grad(grad_h_q[:live], grad_h_s[:live], FP8), dequantize_grad(ref_q, ref_s, FP8)
    scale = torch.maximum(ref_s, grad_h_s[:live]).repeat_interleave(128, 1)
    assert ((deq - want).abs() <= want.abs() * 2**-3 + scale * 2**-9).all(), "grad_h e4m3 values"
    assert (grad_h_q[live:].view(torch.uint8) == POISON_E4M3).all() and grad_h_s[live:].isnan().all()


def check_swiglu_forward_quantized(device):
    """The forward's requantization shares the rounding helper: quant.py's codes and scales (up to
    the kernel's exp against torch's sigmoid)."""
    P, inter, chunk, live = 32, 256, 128, 29
    g = torch.Generator().manual_seed(4)
    h = (torch.randn(P, 2 * inter, generator=g) * 2).to(torch.bfloat16)
    row_w = torch.rand(P, generator=g) + 0.1
    act, act_s = poisoned_e4m3(P, inter, device=device), nans(P, inter // 128, device=device)
    K_.swiglu_forward(h.to(device), row_w.to(device), act, act_s, live_rows(live, device), chunk, None)
    act, act_s = act.cpu(), act_s.cpu()
    ref_q, ref_s = quantize_act(swiglu(h[:live], chunk, None) * row_w[:live, None], FP8)
    assert torch.allclose(act_s[:live], ref_s, rtol=4e-6, atol=0), "forward act scales"
    same = act[:live].float() == ref_q.float()
    assert same.float().mean() > 0.99, f"forward act e4m3: {1 - same.float().mean():.2%} of codes differ"


def check_shared_experts(device):
    """The GPU executor's shared experts (the routed SwiGLU kernels with one chunk of the whole
    width and row weight 1) against expert_math's torch path in the same compute dtype, with and
    without the clamp; no tokens falls back to the torch path."""
    T, H, width = 40, 128, 256
    g = torch.Generator().manual_seed(6)
    bf = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)
    x, w1, w2, gy = bf(T, H), bf(2 * width, H, scale=H**-0.5), bf(H, width, scale=width**-0.5), bf(T, H)
    on = lambda *ts: [t.to(device) for t in ts]
    rel = lambda a, b: ((a.cpu().float() - b.float()).norm() / b.float().norm()).item()
    ex = TritonExecutor()
    for clamp in (None, 0.75):
        out, h = ex.shared_forward(*on(x, w1, w2), clamp)
        ref_out, ref_h = shared_forward(x, w1, w2, clamp, torch.bfloat16)
        # the GEMMs' bits differ by device (accumulation order): the SwiGLU is what is checked
        assert rel(h, ref_h) < 1e-2, ("shared pre-activation", rel(h, ref_h))
        assert rel(out, ref_out) < 1e-2, ("shared out", clamp, rel(out, ref_out))
        got = ex.shared_backward(*on(x, w1, w2), h, clamp, gy.to(device))
        want = shared_backward(x, w1, w2, h.cpu(), clamp, gy, torch.bfloat16)
        for name, a, b in zip(("dx", "dw1", "dw2"), got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert rel(a, b) < 1e-2, ("shared", name, clamp, rel(a, b))
    empty = ex.shared_forward(*on(x[:0], w1, w2), None)
    assert empty[0].shape == (0, H) and empty[1].shape == (0, 2 * width)


def check_executor_backward_against_reference(
    device, recipe: str = "fp8", mx_gemm: str = "folded", seed: int = 5, hidden: int = 384, tokens: int = 37
):
    """TritonExecutor.experts_backward (fp8 dgrads through grouped_gemm, fp8 wgrads through the
    CUTLASS K-grouped GEMM, or off CUDA through torch._grouped_mm on the same quantized operands)
    against the reference executor on the same padded plan and inputs (the recipe: fp8, or
    fp8_e4m3_wgrad with the fp8 wgrads, whose pool pads experts to 128 rows, or mxfp8_mxfp4 with its
    MXFP8 dgrads against the transposed E2M1 weights: on CUDA through the CUTLASS fp8 GEMM on them
    folded, or with mx_gemm "expanded" the expert GEMM that reads them as stored; elsewhere the
    Triton fp8 GEMM on them folded), and against the oracle with unquantized gradients and (the
    recipe's dgrads reading W2^T, W1^T) the forward's weights, to show the check can tell them
    apart. tokens rows of hidden columns (intermediate 256) and one masked slot, from seed."""
    cfg = MegaMoEConfig(
        num_experts=4,
        hidden=hidden,
        intermediate=256,
        topk=2,
        num_max_tokens_per_rank=max(tokens, 40),
        recipe=recipe,
        block_m=64,
        dtype=torch.bfloat16,
        activation_clamp=6.0,
    )
    g = torch.Generator().manual_seed(seed)
    T, E, H, I, K = tokens, cfg.num_experts, cfg.hidden, cfg.intermediate, cfg.topk
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[5, 1] = -1
    ids_full = torch.full((1, cfg.num_max_tokens_per_rank, K), -1, dtype=torch.int64)
    ids_full[0, :T] = ids
    plan = build_plan(ids_full, 0, E, TritonExecutor().row_align(cfg))
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    topk_w = torch.rand(T, K, generator=g) + 0.1
    gy = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w1 = torch.randn(E, 2 * I, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, I, generator=g) * I**-0.5
    weights = transform_weights(w1.to(device), w2.to(device), cfg)

    # Pool rows as the pull writes them: each slot's token row, padding rows zero.
    P = plan.pool_rows
    live = int(plan.num_rows)
    token = torch.full((P,), -1, dtype=torch.long)
    real = plan.row_recv[:live] >= 0
    token[:live][real] = plan.recv_token.long()[plan.row_recv[:live][real].long()]
    present = token >= 0
    mx = cfg.precision.mx
    x_q, x_s = quantize_act(x, cfg.precision)  # as stored: MXFP8 for mx (the reference's pool)
    pool_x, pool_s = torch.zeros(P, H, dtype=torch.uint8), torch.zeros(P, x_s.shape[1], dtype=x_s.dtype)
    pool_x[present], pool_s[present] = x_q.view(torch.uint8)[token[present]], x_s[token[present]]
    pool_x = pool_x.view(torch.float8_e4m3fn)
    tri_x, tri_s = fold_mx_act(pool_x, pool_s) if mx else (pool_x, pool_s)  # the triton pool: folded
    row_w = torch.zeros(P)
    row_w[present] = topk_w[token[present], plan.row_slot.long()[present]]
    pool_grad = torch.zeros(P, H, dtype=torch.bfloat16)
    pool_grad[present] = gy[token[present]]
    plan = dataclasses.replace(plan, **{f.name: getattr(plan, f.name).to(device) for f in dataclasses.fields(plan)})
    pool_x, pool_s, tri_x, tri_s, row_w, pool_grad = (
        t.to(device) for t in (pool_x, pool_s, tri_x, tri_s, row_w, pool_grad)
    )

    tri, ref = TritonExecutor(), ReferenceExecutor()
    from megamoe_train.backends import triton_backend

    saved_mx_gemm, triton_backend._MX_GEMM = triton_backend._MX_GEMM, mx_gemm
    try:
        _, tri_state = tri.experts_forward(cfg, weights, plan, TritonPoolInputs(tri_x, tri_s, row_w))

        def no_compute_copies(dtype):
            raise AssertionError("the quantized backward read the bf16 compute copies")

        weights.compute_copies = no_compute_copies  # this object only (instance attribute)
        got = [t.cpu() for t in tri.experts_backward(cfg, weights, plan, tri_state, TritonPoolGrad(pool_grad))]
    finally:
        triton_backend._MX_GEMM = saved_mx_gemm
    _, ref_state = ref.experts_forward(cfg, weights, plan, ReferencePoolInputs(pool_x, pool_s, row_w))

    def oracle(**formats):
        """The reference backward under the fp8 recipe with these gradient formats (registered for this call only)."""
        RECIPES["fp8_check"] = dataclasses.replace(RECIPES[recipe], name="fp8_check", **formats)
        try:
            return [
                t.cpu()
                for t in ref.experts_backward(
                    dataclasses.replace(cfg, recipe="fp8_check"), weights, plan, ref_state, pool_grad
                )
            ]
        finally:
            del RECIPES["fp8_check"]

    want = oracle()
    unquantized = oracle(grad_format="native", wgrad_format="native")

    def rel(a, b, rows):
        a, b = (a[present], b[present]) if rows else (a, b)
        return float((a.double() - b.double()).norm() / b.double().norm())

    names = ("dx rows", "d(topk weight) rows", "grad_w1", "grad_w2")
    errors = {}
    for name, a, b, c in zip(names, got, want, unquantized):
        assert not a[present if "rows" in name else ...].float().isnan().any(), f"{name}: unwritten (NaN) values"
        err, err_unquantized = rel(a, b, "rows" in name), rel(a, c, "rows" in name)
        errors[name] = (err, err_unquantized)
        # 4e-2: pre-activations kept in bf16 move some e4m3 roundings by one step (test_gpu_triton.py)
        assert err < 4e-2, f"{name}: relative error {err:.4f} against the reference executor"
        if name != "grad_w2":  # everything downstream of a dgrad input
            assert err < 0.6 * err_unquantized, f"{name}: not closer to the fp8 oracle than to unquantized gradients"
    return errors


def check_pull_inputs(device, recipe: str):
    """TritonExecutor's one-pass pull (x, its scales, each pool row's topk weight) from two source
    ranks' buffers against the rows built here from the plan; outputs poisoned first, padding rows
    must come back zero. With a quantized dgrad, dY's pull with its quantization (mxfp8_mxfp4: MXFP8
    folded, on rows with an inf, a NaN and a block of bf16 subnormals too)."""
    from megamoe_train.layout import buffer_layout

    cfg = MegaMoEConfig(
        num_experts=4,
        hidden=384,
        intermediate=256,
        topk=3,
        num_max_tokens_per_rank=24,
        recipe=recipe,
        block_m=16,
        dtype=torch.bfloat16,
    )
    R, T, K, H = 2, cfg.num_max_tokens_per_rank, cfg.topk, cfg.hidden
    layout = buffer_layout(cfg, R)
    regions = layout.regions
    g = torch.Generator().manual_seed(11)
    buffers = [torch.zeros(layout.nbytes, dtype=torch.uint8, device=device) for _ in range(R)]

    def view(r, name):
        reg = regions[name]
        return buffers[r][reg.offset : reg.offset + reg.nbytes].view(reg.dtype).view(reg.shape)

    ids = torch.stack(
        [torch.stack([torch.randperm(cfg.num_experts, generator=g)[:K] for _ in range(T)]) for _ in range(R)]
    )
    ids[0, 3] = -1  # a token with no slot anywhere
    ids[1, 7, 1] = -1
    xs, scales, tws = [], [], []
    for r in range(R):
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        if cfg.precision.quantized:
            q, s_ = quantize_act(x, cfg.precision)
            view(r, "x").view(torch.uint8).copy_(q.view(torch.uint8))
            view(r, "x_scales").copy_(s_)
            xs.append(q.view(torch.uint8)), scales.append(s_)
        else:
            view(r, "x").copy_(x)
            xs.append(x)
        tw = torch.rand(T, K, generator=g) + 0.1
        view(r, "topk_weights").copy_(tw)
        tws.append(tw)
    plan = build_plan(ids, 1, 2, TritonExecutor().row_align(cfg))  # rank 1's experts: 2, 3
    P, live = plan.pool_rows, int(plan.num_rows)
    u = plan.row_recv.long()
    src, tok = plan.recv_src.long(), plan.recv_token.long()
    n_scales = scales[0].shape[1] if scales else 0
    want_x = torch.zeros(P, H, dtype=xs[0].dtype)
    want_s = torch.zeros(P, n_scales, dtype=cfg.precision.scale_storage_dtype)
    want_w = torch.zeros(P)
    for p in range(live):
        if u[p] >= 0:
            s_, t_ = int(src[u[p]]), int(tok[u[p]])
            want_x[p] = xs[s_][t_]
            if scales:
                want_s[p] = scales[s_][t_]
            want_w[p] = tws[s_][t_, int(plan.row_slot[p])]
    plan = dataclasses.replace(plan, **{f.name: getattr(plan, f.name).to(device) for f in dataclasses.fields(plan)})
    bases = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=device)
    x_pool = torch.full((P, H), 0x7F if scales else float("nan"), dtype=want_x.dtype, device=device)
    s_pool = None
    if scales:  # poisoned: NaN (fp32 scales) or 255 (ue8m0's NaN code)
        s_pool = torch.full((P, n_scales), 255, dtype=torch.uint8, device=device)
        s_pool = s_pool if cfg.precision.mx else nans(P, n_scales, device=device)
    w_pool = nans(P, device=device)
    K_.pull_expand(
        bases,
        regions["x"],
        x_pool.view(torch.float8_e4m3fn) if scales else x_pool,
        plan,
        scales_region=regions["x_scales"] if scales else None,
        scales_pool=s_pool,
        weights_region=regions["topk_weights"],
        row_weights=w_pool,
    )
    assert torch.equal(x_pool[:live].cpu(), want_x[:live]), "pulled rows"
    if scales:
        assert torch.equal(s_pool[:live].cpu(), want_s[:live]), "pulled scales"
    assert torch.equal(w_pool[:live].cpu(), want_w[:live]), "row weights"
    if not cfg.precision.quantized_dgrad:
        return
    # dY's pull with the dgrad's quantization in the same pass: rows bit for bit, and the e4m3 rows
    # and scales of quant.quantize_grad (quantize_rows' bits; mx: folded) of the rows, padding included
    mx = cfg.precision.mx
    grads = [torch.randn(T, H, generator=g).to(torch.bfloat16) * (r + 1) for r in range(R)]
    if mx:  # specials (a NaN or inf makes its fold block NaN; bf16 subnormals widen exactly)
        grads[0][2, 5] = float("inf")
        grads[1][4, 200] = float("nan")
        grads[0][6, 128:256] = (torch.randn(128, generator=g) * 2.0**-130).to(torch.bfloat16)
        assert grads[0][6, 128:256].float().abs().max() < 2.0**-126
    for r in range(R):
        view(r, "grad_y").copy_(grads[r])
    want_g = torch.zeros(P, H, dtype=torch.bfloat16)
    for p in range(live):
        if u[p] >= 0:
            want_g[p] = grads[int(src[u[p]])][int(tok[u[p]])]
    want_q, want_qs = _as_dgrad_reads(want_g[:live], mx)
    g_pool = nans(P, H, device=device).to(torch.bfloat16)
    q_pool = torch.full((P, H), 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    qs_pool = nans(P, H // 128, device=device)
    K_.pull_expand(bases, regions["grad_y"], g_pool, plan, quant_pool=q_pool, quant_scales=qs_pool, quant_mx=mx)
    assert torch.equal(g_pool[:live].cpu().view(torch.int16), want_g[:live].view(torch.int16)), "pulled dY rows"
    assert_same_bits(q_pool[:live].cpu(), want_q, "dY e4m3 rows")
    assert_same_bits(qs_pool[:live].cpu(), want_qs, "dY scales")
    if mx:  # the specials reached this pool: NaN blocks, and the subnormal block's codes kept
        rows = [p for p in range(live) if u[p] >= 0 and (int(src[u[p]]), int(tok[u[p]])) == (0, 6)]
        assert rows and qs_pool[:live].isnan().sum() >= 2
        assert q_pool.cpu()[rows, 128:256].view(torch.uint8).any(), "a subnormal block quantized to zeros"


def run_all(device) -> dict:
    for recipe in ("bf16", "fp8", "mxfp8_mxfp4"):
        check_pull_inputs(device, recipe)
    check_quantize_rows(device)
    check_quantizers_keep_nan(device)
    for clamp in (None, 0.75):
        for mx in (False, True):
            check_swiglu_backward_quantized(device, clamp, mx)
    check_swiglu_forward_quantized(device)
    check_shared_experts(device)
    runs = {recipe: (recipe, "folded") for recipe in ("fp8", "fp8_e4m3_wgrad", "mxfp8_mxfp4")}
    if device != "cpu":  # the MX recipe's two GEMM paths (off CUDA both are the Triton fp8 GEMM's)
        runs["mxfp8_mxfp4 (expanded)"] = ("mxfp8_mxfp4", "expanded")
    return {name: check_executor_backward_against_reference(device, *run) for name, run in runs.items()}


def main(argv):
    """No argument: run_all; `wgrad_quant`: check_quantize_tokens_t only; `nan`: check_quantizers_keep_nan only."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    exact_downcasts()
    if argv[1:] == ["wgrad_quant"]:
        check_quantize_tokens_t("cpu")
    elif argv[1:] == ["nan"]:
        check_quantizers_keep_nan("cpu")
    else:
        for recipe, errors in run_all("cpu").items():
            for name, (err, err_unquantized) in errors.items():
                print(
                    f"{recipe} {name}: {err:.2e} against the oracle, "
                    f"{err_unquantized:.2e} against unquantized gradients"
                )
    print("all interpreter checks passed")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
