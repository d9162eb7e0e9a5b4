"""The CUTLASS grouped GEMMs (megamoe_train._cuda, marked `gpu`): the FP8 forward/dgrad GEMM and
the FP8 K-grouped wgrad GEMM against the dequantized float product on fresh random operands with
empty and uneven expert groups, memory outside the output untouched (poisoned with NaN), bitwise
repeat, CUDA-graph capture, and their input checks; the bf16 GEMM against the float product.
Skipped without an sm_90 GPU or without the built extension."""

import pytest
import torch

from megamoe_train.backends import cutlass_gemm
from megamoe_train.backends import triton_kernels as K_
from megamoe_train.precision import get_recipe
from megamoe_train.quant import dequantize_act, dequantize_weight, quantize_act, quantize_weight

pytestmark = pytest.mark.gpu

needs_cutlass = pytest.mark.skipif(
    not torch.cuda.is_available() or not cutlass_gemm.available(torch.device("cuda", 0)),
    reason="needs an sm_90 GPU and megamoe_train._cuda",
)
FP8 = get_recipe("fp8")


def make_case(sizes, n, k, tail_rows=128, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda", 0)
    ends = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    m = int(sum(sizes)) + tail_rows
    # rows of very different magnitude, so per-row and per-block scales matter
    a = torch.randn(m, k, device=dev, generator=gen) * torch.logspace(-2, 2, m, device=dev)[:, None]
    b = torch.randn(len(sizes), n, k, device=dev, generator=gen) * k**-0.5
    b[:, : n // 2] *= 30.0
    aq, a_s = quantize_act(a.to(torch.bfloat16), FP8)
    bq, b_s = quantize_weight(b, FP8)
    return aq, a_s, bq, b_s, ends


def reference(aq, a_s, bq, b_s, ends):
    a = dequantize_act(aq, a_s, FP8)
    b = dequantize_weight(bq, b_s, FP8)
    out = torch.full((aq.shape[0], bq.shape[1]), float("nan"), device=aq.device)
    start = 0
    for g, end in enumerate(ends.tolist()):
        out[start:end] = a[start:end] @ b[g].t()
        start = end
    return out


def rel_err(x, ref):
    return float((x.float() - ref).norm() / ref.norm())


@needs_cutlass
@pytest.mark.parametrize(
    "sizes,n,k",
    [
        ([128, 0, 256, 128, 0, 384, 128, 128], 256, 512),  # empty groups, the pool's 128-row blocks
        ([64, 192, 64, 0, 320], 384, 256),  # 64-row blocks (block_m=64)
        ([16, 48, 0, 112], 128, 128),  # groups smaller than a tile
        ([1024, 512], 4096, 2048),  # a layer's L2 width
    ],
)
@pytest.mark.parametrize("variant", range(getattr(cutlass_gemm._cuda, "FP8_VARIANTS", 1)))
def test_matches_dequantized_product(sizes, n, k, variant):
    aq, a_s, bq, b_s, ends = make_case(sizes, n, k)
    out = torch.full((aq.shape[0], n), float("nan"), dtype=torch.bfloat16, device=aq.device)
    cutlass_gemm.fp8_grouped_gemm(aq, a_s, bq, b_s, ends, out, variant=variant)
    ref = reference(aq, a_s, bq, b_s, ends)
    live = int(ends[-1])
    assert torch.isnan(out[live:]).all(), "rows past the last group were written"
    assert not torch.isnan(out[:live]).any(), "rows of a group were left unwritten"
    # bf16 output rounding (2^-9 relative) dominates; accumulation order differs from torch's
    assert rel_err(out[:live], ref[:live]) < 4e-3
    again = torch.full_like(out, float("nan"))
    cutlass_gemm.fp8_grouped_gemm(aq, a_s, bq, b_s, ends, again, variant=variant)
    assert torch.equal(out[:live], again[:live]), "not bitwise repeatable"


@needs_cutlass
def test_agrees_with_triton_kernel():
    sizes = [128, 256, 0, 128]
    aq, a_s, bq, b_s, ends = make_case(sizes, 256, 512, tail_rows=0, seed=3)
    ours = torch.empty(aq.shape[0], 256, dtype=torch.bfloat16, device=aq.device)
    cutlass_gemm.fp8_grouped_gemm(aq, a_s, bq, b_s, ends, ours)
    block_expert = torch.repeat_interleave(
        torch.arange(len(sizes), device=aq.device), torch.tensor(sizes, device=aq.device) // 128
    ).to(torch.int32)
    tri = torch.empty_like(ours)
    K_.grouped_gemm(aq, bq, block_expert, tri, a_s, b_s, block_m=128)
    assert rel_err(ours, tri.float()) < 4e-3


def captured(call):
    """call() once on a side stream (warm-up outside the capture), then captured into a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


@needs_cutlass
def test_cuda_graph_replay_reads_group_sizes_on_device():
    aq, a_s, bq, b_s, ends = make_case([128, 128, 128, 128], 256, 256, seed=5)
    out = torch.zeros(aq.shape[0], 256, dtype=torch.bfloat16, device=aq.device)
    graph = captured(lambda: cutlass_gemm.fp8_grouped_gemm(aq, a_s, bq, b_s, ends, out))
    # new group sizes, same tensors: the replay must follow them (no sizes baked in on the host)
    ends.copy_(torch.tensor([256, 256, 384, 512], device=aq.device, dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference(aq, a_s, bq, b_s, ends)
    assert torch.isnan(out[512:]).all()
    assert rel_err(out[:512], ref[:512]) < 4e-3


@needs_cutlass
def test_rejects_bad_operands():
    aq, a_s, bq, b_s, ends = make_case([128, 128], 256, 256)
    out = torch.empty(aq.shape[0], 256, dtype=torch.bfloat16, device=aq.device)
    with pytest.raises(ValueError, match="a_scales"):
        cutlass_gemm.fp8_grouped_gemm(aq, a_s.t().contiguous().t(), bq, b_s, ends, out)
    with pytest.raises(ValueError, match="out"):
        cutlass_gemm.fp8_grouped_gemm(aq, a_s, bq, b_s, ends, out.float())
    with pytest.raises(ValueError, match="group_ends"):
        cutlass_gemm.fp8_grouped_gemm(aq, a_s, bq, b_s, ends.long(), out)


@needs_cutlass
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
@pytest.mark.parametrize("variant", range(getattr(cutlass_gemm._cuda, "BF16_VARIANTS", 1)))
def test_bf16_matches_float_product(b_layout, variant):
    sizes, n, k = [128, 0, 48, 256, 16, 0, 200], 384, 256  # any group sizes, empty groups
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device="cuda").manual_seed(11)
    ends = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    m = int(sum(sizes)) + 64
    a = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
    w = (torch.randn(len(sizes), n, k, device=dev, generator=gen) * k**-0.5).to(torch.bfloat16)  # [G, N, K]
    b = w if b_layout == "nk" else w.transpose(1, 2).contiguous()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
    cutlass_gemm.bf16_grouped_gemm(a, b, ends, out, b_layout, variant=variant)
    ref = torch.full((m, n), float("nan"), device=dev)
    start = 0
    for g, end in enumerate(ends.tolist()):
        ref[start:end] = a[start:end].float() @ w[g].float().t()
        start = end
    live = int(ends[-1])
    assert torch.isnan(out[live:]).all()
    assert not torch.isnan(out[:live]).any()
    assert rel_err(out[:live], ref[:live]) < 4e-3
    again = torch.full_like(out, float("nan"))
    cutlass_gemm.bf16_grouped_gemm(a, b, ends, again, b_layout, variant=variant)
    assert torch.equal(out[:live], again[:live])


# ---- the K-grouped fp8 wgrad GEMM (cutlass_gemm.fp8_wgrad_grouped_gemm) ----

WGRAD_VARIANTS = range(getattr(cutlass_gemm._cuda, "FP8_WGRAD_VARIANTS", 1))
E4M3_NAN = 0x7F


def make_wgrad_case(sizes, m, n, tail=256, seed=0):
    """Pool-transposed operands a_t [m, P] and b_t [n, P] over expert groups of `sizes` pool rows,
    with P `tail` rows past the last end; the tail holds e4m3 NaN and NaN scales, so reading it
    would show. Rows and pool rows of very different magnitude: both operands' per-row 1x128
    scales matter."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda", 0)
    ends = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    live = int(sum(sizes))
    p = live + tail
    a = (
        torch.randn(m, p, device=dev, generator=gen)
        * torch.logspace(-2, 2, p, device=dev)
        * torch.logspace(1, -1, m, device=dev)[:, None]
    )
    b = torch.randn(n, p, device=dev, generator=gen) * torch.logspace(1, -2, p, device=dev)
    b[: n // 3] *= 30.0
    aq, a_s = quantize_act(a.to(torch.bfloat16), FP8)
    bq, b_s = quantize_act(b.to(torch.bfloat16), FP8)
    for data, scales in ((aq, a_s), (bq, b_s)):
        data.view(torch.uint8)[:, live:] = E4M3_NAN
        scales[:, live // 128 :] = float("nan")
    return aq, a_s, bq, b_s, ends


def wgrad_reference(aq, a_s, bq, b_s, ends):
    a = dequantize_act(aq, a_s, FP8).double()
    b = dequantize_act(bq, b_s, FP8).double()
    out, start = [], 0
    for end in ends.tolist():
        out.append(a[:, start:end] @ b[:, start:end].t())
        start = end
    return torch.stack(out)


def guarded_out(groups, m, n, dev):
    """out [groups, m, n] poisoned with NaN, inside a buffer whose first and last slabs hold 7.0."""
    full = torch.full((groups + 2, m, n), float("nan"), dtype=torch.bfloat16, device=dev)
    full[0] = 7.0
    full[-1] = 7.0
    return full, full[1:-1]


def assert_expert_close(got, ref, g):
    """One expert's [M, N] gradient: overall, and every row and column on its own (rows and
    columns differ in magnitude by 100x and more, so a wrong per-row A scale or per-column B scale
    could hide in the overall norm). bf16 output rounding (2^-9 relative) dominates the error."""
    assert not torch.isnan(got).any(), f"expert {g} left unwritten or read the NaN tail"
    diff = got.double() - ref
    assert float(diff.norm() / ref.norm()) < 4e-3, f"expert {g}"
    assert float((diff.norm(dim=1) / ref.norm(dim=1)).max()) < 1e-2, f"expert {g}: a row is off"
    assert float((diff.norm(dim=0) / ref.norm(dim=0)).max()) < 1e-2, f"expert {g}: a column is off"


def check_wgrad(out, full, ref, ends):
    sizes = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    assert (full[0] == 7.0).all() and (full[-1] == 7.0).all(), "wrote outside out"
    for g, size in enumerate(sizes):
        if size == 0:
            assert (out[g] == 0).all(), f"empty expert {g} must get exact zeros"
        else:
            assert_expert_close(out[g], ref[g], g)


@needs_cutlass
@pytest.mark.parametrize("variant", WGRAD_VARIANTS)
@pytest.mark.parametrize(
    "sizes,m,n",
    [
        (
            [384, 0, 128, 512, 256, 0, 1024, 128],
            256,
            384,
        ),  # skewed, empty, exactly 128 rows; 3 N tiles (odd, 1x2 cluster)
        ([0, 256, 128, 0, 640, 384, 128, 256, 0, 512, 128, 256], 512, 256),  # W1-like (M = 2I > N), first expert empty
        ([4096, 2048], 512, 1024),  # S3-like depth: 32 and 16 K steps
        ([(g % 3) * 128 for g in range(130)], 128, 128),  # more experts than one fill block's threads
    ],
)
def test_wgrad_matches_dequantized_product(sizes, m, n, variant):
    aq, a_s, bq, b_s, ends = make_wgrad_case(sizes, m, n, seed=len(sizes) + variant)
    full, out = guarded_out(len(sizes), m, n, aq.device)
    cutlass_gemm.fp8_wgrad_grouped_gemm(aq, a_s, bq, b_s, ends, out, variant=variant)
    torch.cuda.synchronize()
    check_wgrad(out, full, wgrad_reference(aq, a_s, bq, b_s, ends), ends)
    again = torch.full_like(out, float("nan"))
    cutlass_gemm.fp8_wgrad_grouped_gemm(aq, a_s, bq, b_s, ends, again, variant=variant)
    assert torch.equal(out, again), "not bitwise repeatable"


@needs_cutlass
@pytest.mark.parametrize("variant", WGRAD_VARIANTS)
def test_wgrad_all_experts_empty_gives_zeros(variant):
    aq, a_s, bq, b_s, ends = make_wgrad_case([0, 0, 0], 256, 256, tail=384)
    full, out = guarded_out(3, 256, 256, aq.device)
    cutlass_gemm.fp8_wgrad_grouped_gemm(aq, a_s, bq, b_s, ends, out, variant=variant)
    torch.cuda.synchronize()
    assert (out == 0).all()
    assert (full[0] == 7.0).all() and (full[-1] == 7.0).all()


@needs_cutlass
def test_wgrad_bad_group_ends_are_not_computed():
    # ends the plan never makes (not 128-aligned, past P): those experts come back NaN, the
    # others right, nothing outside out written, no fault
    aq, a_s, bq, b_s, ends = make_wgrad_case([256, 128, 128, 256], 256, 256, tail=128)
    p = aq.shape[1]
    bad = torch.tensor([256, 300, 384, p + 128], dtype=torch.int32, device=aq.device)
    full, out = guarded_out(4, 256, 256, aq.device)
    cutlass_gemm.fp8_wgrad_grouped_gemm(aq, a_s, bq, b_s, bad, out)
    torch.cuda.synchronize()
    assert_expert_close(out[0], wgrad_reference(aq, a_s, bq, b_s, bad[:1])[0], 0)
    assert torch.isnan(out[1:]).all()
    assert (full[0] == 7.0).all() and (full[-1] == 7.0).all()


@needs_cutlass
def test_wgrad_cuda_graph_replay_follows_new_group_ends():
    m, n = 256, 256
    aq, a_s, bq, b_s, ends = make_wgrad_case([256, 0, 256, 256], m, n, seed=5)
    full, out = guarded_out(4, m, n, aq.device)
    graph = captured(lambda: cutlass_gemm.fp8_wgrad_grouped_gemm(aq, a_s, bq, b_s, ends, out))
    # new sizes, same tensors: expert 1 now has rows, expert 2 none, expert 3 more
    ends.copy_(torch.tensor([128, 384, 384, 768], device=aq.device, dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_wgrad(out, full, wgrad_reference(aq, a_s, bq, b_s, ends), ends)


@needs_cutlass
def test_wgrad_rejects_bad_operands():
    aq, a_s, bq, b_s, ends = make_wgrad_case([128, 256], 256, 256)
    out = torch.empty(2, 256, 256, dtype=torch.bfloat16, device=aq.device)
    with pytest.raises(ValueError, match="a_t_scales"):
        cutlass_gemm.fp8_wgrad_grouped_gemm(aq, a_s.t().contiguous().t(), bq, b_s, ends, out)
    with pytest.raises(ValueError, match="b_t must"):
        cutlass_gemm.fp8_wgrad_grouped_gemm(aq, a_s, bq.to(torch.bfloat16), b_s, ends, out)
    with pytest.raises(ValueError, match="out"):
        cutlass_gemm.fp8_wgrad_grouped_gemm(aq, a_s, bq, b_s, ends, out.float())
    with pytest.raises(ValueError, match="group_ends"):
        cutlass_gemm.fp8_wgrad_grouped_gemm(aq, a_s, bq, b_s, ends.long(), out)
    with pytest.raises(ValueError, match="16-byte aligned"):
        shifted = torch.empty(out.numel() + 1, dtype=torch.bfloat16, device=aq.device)[1:].view_as(out)
        cutlass_gemm.fp8_wgrad_grouped_gemm(aq, a_s, bq, b_s, ends, shifted)
    with pytest.raises(ValueError, match="variant"):
        cutlass_gemm.fp8_wgrad_grouped_gemm(aq, a_s, bq, b_s, ends, out, variant=99)


# ----------------------------------------------------------------------------- bf16 wgrad into fp32

ACC_VARIANTS = range(getattr(cutlass_gemm._cuda, "BF16_WGRAD_VARIANTS", 1))
# (pool rows per expert, M, N) of the bf16 wgrad tests, accumulating and storing alike
BF16_WGRAD_CASES = [
    ([48, 0, 16, 512, 256, 0, 1040, 128], 256, 384),  # skewed, empty, 16-row groups, ragged last K tile
    ([0, 256, 112, 0, 640, 384, 128, 256, 0, 512], 1024, 512),  # W1-like (M = 2I), first expert empty
    ([4096, 2048], 512, 2048),  # deep groups (64 and 32 K steps)
    ([(g % 3) * 16 for g in range(130)], 128, 128),  # many small experts
]


def make_acc_case(sizes, m, n, tail=48, seed=0):
    """Pool operands a [P, m], b [P, n] (bf16, as stored) over expert groups of `sizes` rows (any
    multiple of 16: the bf16 pool's alignment) with `tail` NaN rows past the last end (reading
    them would show), columns of very different magnitude, and a random fp32 accumulator
    [G, m, n] inside a buffer whose first and last slabs hold 7.0."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda", 0)
    ends = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    live = int(sum(sizes))
    a = (torch.randn(live + tail, m, device=dev, generator=gen) * torch.logspace(-1, 1, m, device=dev)).to(
        torch.bfloat16
    )
    b = (torch.randn(live + tail, n, device=dev, generator=gen) * torch.logspace(1, -1, n, device=dev)).to(
        torch.bfloat16
    )
    a[live:] = float("nan")
    b[live:] = float("nan")
    full = torch.full((len(sizes) + 2, m, n), 7.0, device=dev)
    full[1:-1] = torch.randn(len(sizes), m, n, device=dev, generator=gen)
    return a, b, ends, full, full[1:-1]


def acc_reference(start, a, b, ends):
    """start[g] + a[rows]^T b[rows] in float64."""
    out, s = start.double().clone(), 0
    for g, e in enumerate(ends.tolist()):
        out[g] += a[s:e].double().t() @ b[s:e].double()
        s = e
    return out


def check_acc(out, full, start, ref, ends):
    sizes = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    assert (full[0] == 7.0).all() and (full[-1] == 7.0).all(), "wrote outside out"
    for g, size in enumerate(sizes):
        if size == 0:
            assert torch.equal(out[g], start[g]), f"empty expert {g} must be left as it was"
            continue
        assert not torch.isnan(out[g]).any(), f"expert {g} read the NaN tail"
        added, want = out[g].double() - start[g].double(), ref[g] - start[g].double()
        diff = added - want  # fp32 accumulation of bf16 products: ~1e-6 relative
        assert float(diff.norm() / want.norm()) < 1e-5, f"expert {g}"
        assert float((diff.norm(dim=1) / want.norm(dim=1)).max()) < 1e-4, f"expert {g}: a row is off"


@needs_cutlass
@pytest.mark.parametrize("variant", ACC_VARIANTS)
@pytest.mark.parametrize("sizes,m,n", BF16_WGRAD_CASES)
def test_bf16_wgrad_accumulates_into_fp32(sizes, m, n, variant):
    a, b, ends, full, out = make_acc_case(sizes, m, n, seed=len(sizes) + variant)
    start = out.clone()
    cutlass_gemm.bf16_wgrad_grouped_gemm_accumulate(a, b, ends, out, variant=variant)
    torch.cuda.synchronize()
    ref = acc_reference(start, a, b, ends)
    check_acc(out, full, start, ref, ends)
    # bitwise repeatable: the same start, the same result
    again = start.clone()
    cutlass_gemm.bf16_wgrad_grouped_gemm_accumulate(a, b, ends, again, variant=variant)
    assert torch.equal(out, again), "not bitwise repeatable"


@needs_cutlass
def test_bf16_wgrad_accumulate_graph_replay_and_bad_ends():
    m, n = 256, 256
    a, b, ends, full, out = make_acc_case([256, 0, 256, 256], m, n, seed=9)
    start = out.clone()
    graph = captured(lambda: cutlass_gemm.bf16_wgrad_grouped_gemm_accumulate(a, b, ends, out))
    # new sizes, same tensors: the replay follows them
    ends.copy_(torch.tensor([128, 384, 384, 768], device=a.device, dtype=torch.int32))
    out.copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    check_acc(out, full, start, acc_reference(start, a, b, ends), ends)
    # a range past the pool is skipped (left as it was), the others right, no fault
    p = a.shape[0]
    bad = torch.tensor([256, 256, p + 16, p + 32], dtype=torch.int32, device=a.device)
    out.copy_(start)
    cutlass_gemm.bf16_wgrad_grouped_gemm_accumulate(a, b, bad, out)
    torch.cuda.synchronize()
    check_acc(out[:2], full, start[:2], acc_reference(start[:2], a, b, bad[:2]), bad[:2])
    assert torch.equal(out[2:], start[2:])


@needs_cutlass
def test_bf16_wgrad_accumulate_rejects_bad_operands():
    a, b, ends, full, out = make_acc_case([128, 256], 256, 256)
    with pytest.raises(ValueError, match="out must"):
        cutlass_gemm.bf16_wgrad_grouped_gemm_accumulate(a, b, ends, out.to(torch.bfloat16))
    with pytest.raises(ValueError, match="b must"):
        cutlass_gemm.bf16_wgrad_grouped_gemm_accumulate(a, b.float(), ends, out)
    with pytest.raises(ValueError, match="group_ends"):
        cutlass_gemm.bf16_wgrad_grouped_gemm_accumulate(a, b, ends.long(), out)
    with pytest.raises(ValueError, match="a must"):
        cutlass_gemm.bf16_wgrad_grouped_gemm_accumulate(a.t(), b, ends, out)


# ----------------------------------------------------------------------------- bf16 wgrad stored (bf16, fp32)

# relative error of the stored product against float64: one bf16 rounding of an fp32 sum
# (~2^-9), or the fp32 sum itself (~1e-6); per matrix and per row
STORE_TOL = {torch.bfloat16: (4e-3, 8e-3), torch.float32: (1e-5, 1e-4)}


@needs_cutlass
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("variant", ACC_VARIANTS)
@pytest.mark.parametrize("sizes,m,n", BF16_WGRAD_CASES)
def test_bf16_wgrad_stores(sizes, m, n, variant, dtype):
    a, b, ends, _, _ = make_acc_case(sizes, m, n, seed=len(sizes) + variant)
    G = len(sizes)
    full = torch.full((G + 2, m, n), 7.0, dtype=dtype, device=a.device)
    out = full[1:-1]
    out.fill_(float("nan"))  # poisoned: every expert's gradient must be written, empty ones as zeros
    cutlass_gemm.bf16_wgrad_grouped_gemm(a, b, ends, out, variant=variant)
    torch.cuda.synchronize()
    assert (full[0] == 7.0).all() and (full[-1] == 7.0).all(), "wrote outside out"
    ref = acc_reference(torch.zeros(G, m, n, device=a.device), a, b, ends)
    tol, row_tol = STORE_TOL[dtype]
    sizes_now = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    for g, size in enumerate(sizes_now):
        if size == 0:
            assert (out[g] == 0).all(), f"empty expert {g} must get zeros"
            continue
        assert not torch.isnan(out[g]).any(), f"expert {g} unwritten or read the NaN tail"
        diff = out[g].double() - ref[g]
        assert float(diff.norm() / ref[g].norm()) < tol, f"expert {g}"
        assert float((diff.norm(dim=1) / ref[g].norm(dim=1)).max()) < row_tol, f"expert {g}: a row is off"
    again = torch.full_like(out, float("nan"))
    cutlass_gemm.bf16_wgrad_grouped_gemm(a, b, ends, again, variant=variant)
    assert torch.equal(out, again), "not bitwise repeatable"
    if dtype == torch.float32:  # written over = added into zeros, bit for bit (a step's first micro-batch)
        zeros = torch.zeros_like(out)
        cutlass_gemm.bf16_wgrad_grouped_gemm_accumulate(a, b, ends, zeros, variant=variant)
        assert torch.equal(out, zeros), "fp32 store differs from accumulating into zeros"


@needs_cutlass
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_bf16_wgrad_store_graph_replay_and_bad_ends(dtype):
    m, n = 256, 256
    a, b, ends, _, _ = make_acc_case([256, 0, 256, 256], m, n, seed=11)
    out = torch.full((4, m, n), float("nan"), dtype=dtype, device=a.device)
    graph = captured(lambda: cutlass_gemm.bf16_wgrad_grouped_gemm(a, b, ends, out))
    ends.copy_(torch.tensor([128, 384, 384, 768], device=a.device, dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = acc_reference(torch.zeros(4, m, n, device=a.device), a, b, ends)
    assert (out[2] == 0).all()
    for g in (0, 1, 3):
        assert float((out[g].double() - ref[g]).norm() / ref[g].norm()) < STORE_TOL[dtype][0]
    # a range past the pool is not computed and reads as NaN; the others are right, no fault
    p = a.shape[0]
    bad = torch.tensor([256, 256, p + 16, p + 32], dtype=torch.int32, device=a.device)
    out.zero_()
    cutlass_gemm.bf16_wgrad_grouped_gemm(a, b, bad, out)
    torch.cuda.synchronize()
    ref = acc_reference(torch.zeros(2, m, n, device=a.device), a, b, bad[:2])
    assert float((out[0].double() - ref[0]).norm() / ref[0].norm()) < STORE_TOL[dtype][0]
    assert (out[1] == 0).all()
    assert torch.isnan(out[2:]).all()
