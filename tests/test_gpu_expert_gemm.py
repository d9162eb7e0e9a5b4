"""Our fused fp8 expert GEMMs (csrc/cuda/expert_gemm.h, marked `gpu`): the plain one against the
dequantized float product and the CUTLASS grouped GEMM; the L1 one with SwiGLU against the same
product followed by the oracle's SwiGLU and quantization. Fresh random operands, group sizes no
tile divides (empty groups, one-row groups, a group holding nearly every row), NaN-poisoned
outputs (every row of every group written, nothing else), bitwise repeat, CUDA-graph replay
following new group sizes. Skipped without an sm_90 GPU or without the built extension."""

import pytest
import torch

from megamoe_train import expert_math
from megamoe_train.backends import cutlass_gemm
from megamoe_train.precision import get_recipe
from megamoe_train.quant import (
    dequantize_act,
    dequantize_weight,
    fold_mx_weight,
    mx_weight_shifts,
    quantize_act,
    quantize_weight,
)
from megamoe_train.weights import interleave_gate_up

pytestmark = pytest.mark.gpu

needs_kernel = pytest.mark.skipif(
    not torch.cuda.is_available() or not cutlass_gemm.has_expert_gemm(torch.device("cuda", 0)),
    reason="needs an sm_90 GPU and megamoe_train._cuda with the expert GEMMs",
)
FP8 = get_recipe("fp8")
SIZES = [
    [128, 0, 256, 128, 0, 384, 128, 128],  # whole tiles and empty groups
    [1, 37, 0, 200, 16, 255, 3],  # no tile divides them
    [700, 5, 0, 0, 1],  # one group holds nearly every row
    [0, 0, 0],  # nothing to do
]


def make_case(sizes, n, k, tail_rows=100, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda", 0)
    ends = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    m = int(sum(sizes)) + tail_rows
    a = torch.randn(m, k, device=dev, generator=gen) * torch.logspace(-2, 2, m, device=dev)[:, None]
    b = torch.randn(len(sizes), n, k, device=dev, generator=gen) * k**-0.5
    b[:, : n // 2] *= 30.0
    aq, a_s = quantize_act(a.to(torch.bfloat16), FP8)
    bq, b_s = quantize_weight(b, FP8)
    return aq, a_s, bq, b_s, ends


def product(aq, a_s, bq, b_s, ends):
    a, b = dequantize_act(aq, a_s, FP8), dequantize_weight(bq, b_s, FP8)
    out = torch.full((aq.shape[0], bq.shape[1]), float("nan"), device=aq.device)
    start = 0
    for g, end in enumerate(ends.tolist()):
        out[start:end] = a[start:end] @ b[g].t()
        start = end
    return out


def rel_err(x, ref):
    return float((x.float() - ref).norm() / ref.norm().clamp_min(1e-30))


@needs_kernel
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("n,k", [(256, 512), (384, 128), (128, 1152), (512, 384)])
@pytest.mark.parametrize("variant", [0, 1, 2, 3, 4, 5, 16, 17, 18, 20])
def test_plain_matches_dequantized_product(sizes, n, k, variant):
    aq, a_s, bq, b_s, ends = make_case(sizes, n, k)
    out = torch.full((aq.shape[0], n), float("nan"), dtype=torch.bfloat16, device=aq.device)
    cutlass_gemm.fp8_expert_gemm(aq, a_s, bq, b_s, ends, out, variant)
    live = int(ends[-1])
    assert torch.isnan(out[live:]).all(), "rows past the last group were written"
    assert not torch.isnan(out[:live]).any(), "rows of a group were left unwritten"
    if live:
        ref = product(aq, a_s, bq, b_s, ends)
        assert rel_err(out[:live], ref[:live]) < 4e-3
        cut = torch.full_like(out, float("nan"))
        cutlass_gemm.fp8_grouped_gemm(aq, a_s, bq, b_s, ends, cut)
        assert rel_err(out[:live], cut[:live].float()) < 4e-3
    again = torch.full_like(out, float("nan"))
    # another variant: the next one, or with dead halves skipped the same one without
    cutlass_gemm.fp8_expert_gemm(aq, a_s, bq, b_s, ends, again, (variant + 1) % 6 if variant < 16 else variant - 16)
    assert torch.equal(out[:live], again[:live]), "not bitwise repeatable (or the variants differ)"


def swiglu_case(sizes, inter, k, chunk, seed):
    aq, a_s, _, _, ends = make_case(sizes, 2 * inter, k, seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    w1 = torch.randn(len(sizes), 2 * inter, k, device=aq.device, generator=gen) * k**-0.5 * 4
    bq, b_s = quantize_weight(interleave_gate_up(w1, chunk), FP8)
    row_w = torch.rand(aq.shape[0], device=aq.device, generator=gen)
    return aq, a_s, bq, b_s, ends, row_w


def run_swiglu(aq, a_s, bq, b_s, ends, row_w, chunk, clamp, variant=0):
    P, inter = aq.shape[0], bq.shape[1] // 2
    h = torch.full((P, 2 * inter), float("nan"), dtype=torch.bfloat16, device=aq.device)
    act = torch.full((P, inter), float("nan"), dtype=torch.float8_e4m3fn, device=aq.device)
    scales = torch.full((P, inter // 128), float("nan"), device=aq.device)
    cutlass_gemm.fp8_expert_gemm_swiglu(aq, a_s, bq, b_s, ends, row_w, chunk, clamp, h, act, scales, variant)
    return h, act, scales


@needs_kernel
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("inter,k,chunk,clamp", [(256, 512, 128, None), (384, 256, 384, 0.75), (640, 128, 128, 7.0)])
def test_swiglu_matches_oracle(sizes, inter, k, chunk, clamp):
    check_swiglu(sizes, inter, k, chunk, clamp)


@needs_kernel
@pytest.mark.parametrize("clamp", [None, 1.5])
def test_swiglu_several_units_per_cta(clamp):
    """More units than CTAs, so each math warpgroup runs a unit's deferred SwiGLU passes under the
    next unit's wgmmas, with K deep enough (16 blocks) that they run one step in two."""
    check_swiglu([1000, 3, 2500, 77, 0, 1500, 1], 1024, 2048, 256, clamp)


def check_swiglu(sizes, inter, k, chunk, clamp):
    aq, a_s, bq, b_s, ends, row_w = swiglu_case(sizes, inter, k, chunk, seed=inter + k)
    h, act, scales = run_swiglu(aq, a_s, bq, b_s, ends, row_w, chunk, clamp)
    live = int(ends[-1])
    for name, t in (("pre-activations", h), ("act", act.float()), ("act scales", scales)):
        assert torch.isnan(t[live:]).all(), f"{name}: rows past the last group were written"
        assert not torch.isnan(t[:live]).any(), f"{name}: rows of a group were left unwritten"
    if live:
        ref_h = product(aq, a_s, bq, b_s, ends)[:live]
        assert rel_err(h[:live], ref_h) < 4e-3
        # the oracle's SwiGLU on our bf16 pre-activations, then its quantization: the epilogue
        # computes from the same rounded values, so only exp/division rounding may differ
        ref_act = expert_math.swiglu(h[:live], chunk, clamp) * row_w[:live, None]
        got = dequantize_act(act[:live], scales[:live], FP8)
        assert rel_err(got, ref_act) < 3e-2  # e4m3 rounding (2^-4 relative per element)
        ref_q, ref_s = quantize_act(ref_act, FP8)
        assert rel_err(scales[:live], ref_s) < 1e-5
        close = (act[:live].float() == ref_q.float()).float().mean()
        assert close > 0.99, f"only {close:.4f} of the e4m3 codes match the oracle's quantization"
    # the same bits without pairs, unstaggered, on the first schedule, with the in-place epilogue,
    # with a tile's dead halves skipped
    for variant in (1, 2, 3, 4, 5, 8, 9, 12, 13, 16, 17, 18, 20, 24):
        again = run_swiglu(aq, a_s, bq, b_s, ends, row_w, chunk, clamp, variant=variant)
        assert torch.equal(h[:live], again[0][:live]), f"variant {variant}: other pre-activations"
        assert torch.equal(act[:live].view(torch.uint8), again[1][:live].view(torch.uint8)), f"variant {variant}"
        assert torch.equal(scales[:live], again[2][:live]), f"variant {variant}: other scales"


@needs_kernel
def test_misaligned_output_is_refused():
    aq, a_s, bq, b_s, ends = make_case([64, 64], 256, 256)
    flat = torch.empty(aq.shape[0] * 256 + 1, dtype=torch.bfloat16, device=aq.device)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        cutlass_gemm.fp8_expert_gemm(aq, a_s, bq, b_s, ends, flat[1:].view(aq.shape[0], 256))


@needs_kernel
def test_swiglu_nan_input_gives_nan_block():
    aq, a_s, bq, b_s, ends, row_w = swiglu_case([64, 64], 256, 256, 128, seed=7)
    a_s[5, 0] = float("nan")
    _, act, scales = run_swiglu(aq, a_s, bq, b_s, ends, row_w, 128, None)
    assert torch.isnan(scales[5]).all(), "a NaN row must give NaN scales, not a finite block"
    assert not torch.isnan(scales[6]).any()


@needs_kernel
def test_graph_replay_follows_new_group_sizes():
    aq, a_s, bq, b_s, ends, row_w = swiglu_case([128, 128, 128, 128], 256, 256, 128, seed=9)
    P = aq.shape[0]
    h = torch.empty(P, 512, dtype=torch.bfloat16, device=aq.device)
    act = torch.empty(P, 256, dtype=torch.float8_e4m3fn, device=aq.device)
    scales = torch.empty(P, 2, device=aq.device)
    out = torch.empty(P, 512, dtype=torch.bfloat16, device=aq.device)

    def call():
        cutlass_gemm.fp8_expert_gemm_swiglu(aq, a_s, bq, b_s, ends, row_w, 128, None, h, act, scales)
        cutlass_gemm.fp8_expert_gemm(aq, a_s, bq, b_s, ends, out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    ends.copy_(torch.tensor([200, 200, 333, 500], device=aq.device, dtype=torch.int32))
    for t in (h, out, scales):
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = product(aq, a_s, bq, b_s, ends)
    assert torch.isnan(out[500:]).all() and torch.isnan(h[500:]).all()
    assert rel_err(out[:500], ref[:500]) < 4e-3 and rel_err(h[:500], ref[:500]) < 4e-3
    assert not torch.isnan(scales[:500]).any()


@needs_kernel
def test_rejects_bad_operands():
    aq, a_s, bq, b_s, ends, row_w = swiglu_case([128, 128], 256, 256, 128, seed=11)
    P = aq.shape[0]
    h = torch.empty(P, 512, dtype=torch.bfloat16, device=aq.device)
    act = torch.empty(P, 256, dtype=torch.float8_e4m3fn, device=aq.device)
    scales = torch.empty(P, 2, device=aq.device)
    with pytest.raises(ValueError, match="chunk"):
        cutlass_gemm.fp8_expert_gemm_swiglu(aq, a_s, bq, b_s, ends, row_w, 64, None, h, act, scales)
    with pytest.raises(ValueError, match="act_scales"):
        cutlass_gemm.fp8_expert_gemm_swiglu(aq, a_s, bq, b_s, ends, row_w, 128, None, h, act, scales[:, :1])
    with pytest.raises(ValueError, match="group_ends"):
        cutlass_gemm.fp8_expert_gemm(aq, a_s, bq, b_s, ends.long(), h)
    for variant in (6, 8, 24, 32, -1):  # the in-place SwiGLU epilogue (8) has no plain counterpart
        with pytest.raises(RuntimeError, match="variant"):
            cutlass_gemm.fp8_expert_gemm(aq, a_s, bq, b_s, ends, h, variant)
    for variant in (10, 14, 26, 32):
        with pytest.raises(RuntimeError, match="variant"):
            cutlass_gemm.fp8_expert_gemm_swiglu(aq, a_s, bq, b_s, ends, row_w, 128, None, h, act, scales, variant)


# ----------------------------------------------------------------------------- E2M1 weights

needs_mx_kernel = pytest.mark.skipif(
    not torch.cuda.is_available() or not cutlass_gemm.has_expert_gemm_mx(torch.device("cuda", 0)),
    reason="needs an sm_90 GPU and megamoe_train._cuda with the E2M1 expert GEMM",
)
MX = get_recipe("mxfp8_mxfp4")


def mx_weights(groups, n, k, seed):
    """MX-quantized weights whose 1x32 scales spread over ~12 binades per 128x128 block (rows and
    32-blocks scaled apart), so the expansion's shifts run from 0 past the clamp."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(groups, n, k, device="cuda", generator=gen) * k**-0.5
    w *= torch.exp2(torch.randint(-6, 3, (groups, n, 1), device="cuda", generator=gen).float())
    w *= torch.exp2(torch.randint(-3, 3, (groups, 1, k // 32), device="cuda", generator=gen).float()).repeat_interleave(
        32, -1
    )
    return quantize_weight(w, MX)


@needs_mx_kernel
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("n,k", [(256, 512), (384, 128), (128, 1152)])
@pytest.mark.parametrize("variant", [0, 1, 4, 5, 16, 32, 33, 36, 48])
def test_mx_expands_to_the_folded_weights_bit_for_bit(sizes, n, k, variant):
    """fp8_expert_gemm_mx (E2M1 expanded in shared memory) == fp8_expert_gemm on
    quant.fold_mx_weight's e4m3 weights: the same products in the same order, so the same bits;
    rows past the groups stay poisoned."""
    aq, a_s, _, _, ends = make_case(sizes, n, k, seed=n + k)
    packed, scales = mx_weights(len(sizes), n, k, seed=n * k)
    folded, folded_scales = fold_mx_weight(packed, scales)
    shifts, block_scales = mx_weight_shifts(scales)
    assert torch.equal(block_scales, folded_scales)
    out = torch.full((aq.shape[0], n), float("nan"), dtype=torch.bfloat16, device=aq.device)
    cutlass_gemm.fp8_expert_gemm_mx(aq, a_s, packed, shifts, block_scales, ends, out, variant)
    ref = torch.full_like(out, float("nan"))
    # bit 5 (the shared expansion) exists only on the E2M1 kernel: the same schedule without it
    cutlass_gemm.fp8_expert_gemm(aq, a_s, folded, folded_scales, ends, ref, variant & ~32)
    live = int(ends[-1])
    assert torch.isnan(out[live:]).all(), "rows past the last group were written"
    assert not torch.isnan(out[:live]).any(), "rows of a group were left unwritten"
    assert torch.equal(out[:live], ref[:live]), "not the folded weights' product"
    if live:
        want = product(aq, a_s, folded, folded_scales, ends)[:live]
        assert rel_err(out[:live], want) < 4e-3


@needs_mx_kernel
def test_mx_refuses_the_first_schedule_and_bad_operands():
    aq, a_s, _, _, ends = make_case([100, 60], 256, 256)
    packed, scales = mx_weights(2, 256, 256, seed=3)
    shifts, block_scales = mx_weight_shifts(scales)
    out = torch.empty(aq.shape[0], 256, dtype=torch.bfloat16, device=aq.device)
    with pytest.raises(RuntimeError, match="staged schedule"):
        cutlass_gemm.fp8_expert_gemm_mx(aq, a_s, packed, shifts, block_scales, ends, out, 2)
    with pytest.raises(ValueError, match="b_shifts"):
        cutlass_gemm.fp8_expert_gemm_mx(aq, a_s, packed, shifts[:, :, :, :64], block_scales, ends, out)
    with pytest.raises(ValueError, match="b must be"):
        cutlass_gemm.fp8_expert_gemm_mx(aq, a_s, packed.view(torch.int8), shifts, block_scales, ends, out)
