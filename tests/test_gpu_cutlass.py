"""The CUTLASS FP8 grouped GEMM (megamoe_train._cuda, marked `gpu`): against the dequantized
float product on fresh random operands with empty and uneven expert groups, rows past the last
group left untouched (poisoned with NaN), bitwise repeat, CUDA-graph capture, and its input checks.
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
def test_matches_dequantized_product(sizes, n, k):
    aq, a_s, bq, b_s, ends = make_case(sizes, n, k)
    out = torch.full((aq.shape[0], n), float("nan"), dtype=torch.bfloat16, device=aq.device)
    cutlass_gemm.fp8_grouped_gemm(aq, a_s, bq, b_s, ends, out)
    ref = reference(aq, a_s, bq, b_s, ends)
    live = int(ends[-1])
    assert torch.isnan(out[live:]).all(), "rows past the last group were written"
    assert not torch.isnan(out[:live]).any(), "rows of a group were left unwritten"
    # bf16 output rounding (2^-9 relative) dominates; accumulation order differs from torch's
    assert rel_err(out[:live], ref[:live]) < 4e-3
    again = torch.full_like(out, float("nan"))
    cutlass_gemm.fp8_grouped_gemm(aq, a_s, bq, b_s, ends, again)
    assert torch.equal(out[:live], again[:live]), "not bitwise repeatable"


@needs_cutlass
def test_agrees_with_triton_kernel():
    sizes = [128, 256, 0, 128]
    aq, a_s, bq, b_s, ends = make_case(sizes, 256, 512, tail_rows=0, seed=3)
    ours = torch.empty(aq.shape[0], 256, dtype=torch.bfloat16, device=aq.device)
    cutlass_gemm.fp8_grouped_gemm(aq, a_s, bq, b_s, ends, ours)
    block_expert = torch.repeat_interleave(torch.arange(len(sizes), device=aq.device), torch.tensor(sizes, device=aq.device) // 128).to(torch.int32)
    tri = torch.empty_like(ours)
    K_.grouped_gemm(aq, bq, block_expert, tri, a_s, b_s, block_m=128)
    assert rel_err(ours, tri.float()) < 4e-3


@needs_cutlass
def test_cuda_graph_replay_reads_group_sizes_on_device():
    aq, a_s, bq, b_s, ends = make_case([128, 128, 128, 128], 256, 256, seed=5)
    out = torch.zeros(aq.shape[0], 256, dtype=torch.bfloat16, device=aq.device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cutlass_gemm.fp8_grouped_gemm(aq, a_s, bq, b_s, ends, out)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cutlass_gemm.fp8_grouped_gemm(aq, a_s, bq, b_s, ends, out)
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
@pytest.mark.parametrize("variant", [0, 1])
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
