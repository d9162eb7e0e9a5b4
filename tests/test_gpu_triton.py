"""The Triton GPU executor (marked `gpu`, skipped without CUDA): against the dense oracle and
the reference executor on fresh random inputs, with every uninitialized tensor and the pushed
regions poisoned with NaN so rows that were never written fail; bitwise repeatability; bad
input; CUDA-graph capture. With recipes fp8 and mxfp8_mxfp4 all of these run the quantized dgrads
(the dense oracle and the reference quantize dY and dH, and the MX recipe's transposed weights,
the same way); test_fp8_backward_kernels and test_mx_backward_against_reference_executor check the
backward's kernels and executor wiring directly (fp8_backward_checks.py)."""

import contextlib
import os

import pytest
import torch
from dense_moe import dense_moe
from poison import poisoned
from test_mega_moe_dist import make_problem, rel_err, run_against_dense

from megamoe_train import MegaMoEConfig, MegaMoEInputError, get_symm_buffer, mega_moe, raise_pending_verdicts
from megamoe_train.call_state import VERDICT_LAG

pytestmark = pytest.mark.gpu

WORLDS = [w for w in (1, 2, 4, 8) if torch.cuda.is_available() and w <= torch.cuda.device_count()]
TRITON_BASE = dict(
    num_experts=16, hidden=256, intermediate=256, topk=4, num_max_tokens_per_rank=300, block_m=64, dtype=torch.bfloat16
)


def poison_buffer(cfg_kwargs):
    buf = get_symm_buffer(None, MegaMoEConfig(**cfg_kwargs), timeout_s=20)
    regions = buf.regions()
    for region in (regions.partials, regions.topk_weight_grads):
        region.fill_(float("nan"))


def _gpu_tolerance(cfg_kwargs):
    # Pre-activations are kept in bf16 (the reference keeps fp32): with fp8 that moves some e4m3
    # rounding decisions and, with a clamp, some clamp-mask decisions by one step.
    # The MX recipe likewise (its e4m3 activations; the e2m1 weights are the same in both).
    return 4e-2 if cfg_kwargs.get("recipe", "").startswith(("fp8", "mx")) else 1e-2


def triton_against_dense(rank, world, cfg_kwargs, tokens, seed, routing="uniform"):
    poison_buffer(cfg_kwargs)
    return poisoned(
        run_against_dense,
        rank,
        world,
        cfg_kwargs,
        tokens,
        seed,
        routing=routing,
        repeat=True,
        backend="triton",
        tol=_gpu_tolerance(cfg_kwargs),
    )


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("recipe", ["bf16", "fp8", "fp8_e4m3_wgrad", "mxfp8_mxfp4"])
@pytest.mark.parametrize("routing", ["uniform", "masked", "skewed", "one_expert"])
def test_triton_matches_dense(rank_pools, world, recipe, routing):
    cfg = dict(TRITON_BASE, recipe=recipe)
    tokens = [300, 157, 211, 64, 300, 5, 128, 77][:world]  # none a multiple of block_m
    rank_pools(world, "nccl").run(triton_against_dense, cfg, tokens, seed=world * 7 + len(routing), routing=routing)


@contextlib.contextmanager
def mx_gemm_path(name: str):
    """MEGAMOE_MX_GEMM as `name` ("folded" or "expanded") inside this block, in this process (a
    rank pool's processes read the variable once, at import)."""
    from megamoe_train.backends import triton_backend

    previous, triton_backend._MX_GEMM = triton_backend._MX_GEMM, name
    try:
        yield
    finally:
        triton_backend._MX_GEMM = previous


def mx_expanded_against_dense(rank, world, cfg_kwargs, tokens, seed, routing):
    """triton_against_dense with the MX GEMMs on our expert GEMM reading the E2M1 weights as stored
    (MEGAMOE_MX_GEMM=expanded; the default folds them to e4m3 in HBM)."""
    with mx_gemm_path("expanded"):
        return triton_against_dense(rank, world, cfg_kwargs, tokens, seed, routing)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("routing", ["uniform", "one_expert"])
def test_triton_mx_expanded_matches_dense(rank_pools, world, routing):
    cfg = dict(TRITON_BASE, recipe="mxfp8_mxfp4")
    tokens = [300, 157, 211, 64, 300, 5, 128, 77][:world]
    rank_pools(world, "nccl").run(mx_expanded_against_dense, cfg, tokens, world * 5 + len(routing), routing)


@pytest.mark.parametrize("world", WORLDS)
def test_triton_zero_tokens_shared_clamp(rank_pools, world):
    cfg = dict(TRITON_BASE, recipe="fp8", num_shared_experts=1, activation_clamp=6.0)
    tokens = [17] if world == 1 else ([0, 290, 0, 33] * 2)[:world]
    rank_pools(world, "nccl").run(triton_against_dense, cfg, tokens, seed=41)


@pytest.mark.parametrize("world", WORLDS)
def test_triton_block_m_128_bf16_shared(rank_pools, world):
    cfg = dict(TRITON_BASE, recipe="bf16", block_m=128, num_shared_experts=2, activation_clamp=5.0)
    rank_pools(world, "nccl").run(triton_against_dense, cfg, [299, 1, 150, 3, 64, 0, 9, 300][:world], seed=5)


def bad_ids_sync_then_deferred(rank, world):
    cfg_kwargs = dict(TRITON_BASE, recipe="bf16")
    cfg = MegaMoEConfig(**cfg_kwargs)
    prob = make_problem(cfg, world, [50] * world, seed=3)
    E_l = cfg.num_experts // world
    mine = slice(rank * E_l, (rank + 1) * E_l)
    buf = get_symm_buffer(None, cfg, timeout_s=20)
    dev = buf.device
    x, idx, tw = prob["x"][rank].to(dev), prob["idx"][rank].to(dev), prob["w"][rank].to(dev)
    w1, w2 = prob["w1"][mine].to(dev), prob["w2"][mine].to(dev)
    bad_idx = idx.clone()
    if rank == world - 1:
        bad_idx[7, 0] = cfg.num_experts + 3

    def good_call():
        y = mega_moe(x, idx, tw, w1, w2, buf, backend="triton")
        y_ref = dense_moe(x.cpu(), idx.cpu(), tw.cpu(), prob["w1"], prob["w2"], cfg)
        assert rel_err(y.cpu(), y_ref) < 1e-2

    os.environ["MEGAMOE_SYNC_CHECKS"] = "1"
    try:
        with pytest.raises(MegaMoEInputError, match=rf"rank\(s\) \[{world - 1}\] rejected"):
            mega_moe(x, bad_idx, tw, w1, w2, buf, backend="triton")
    finally:
        del os.environ["MEGAMOE_SYNC_CHECKS"]
    good_call()
    # Deferred (default): bad call n routes nothing; every rank raises it at call n + VERDICT_LAG,
    # the calls between running normally.
    n = buf.call_state.call_count + 1
    y = mega_moe(x, bad_idx, tw, w1, w2, buf, backend="triton")
    torch.cuda.synchronize()
    assert not y.float().abs().max() > 0  # no routed rows moved, no shared experts: all zero
    for _ in range(VERDICT_LAG - 1):
        good_call()
    with pytest.raises(MegaMoEInputError, match=rf"call {n}\): .*rank\(s\) \[{world - 1}\] rejected"):
        mega_moe(x, idx, tw, w1, w2, buf, backend="triton")
    good_call()
    # A host-visible problem on one rank: that rank raises in call n, its peers' call n returns;
    # every rank, that one too, raises call n's verdict at call n + VERDICT_LAG.
    n = buf.call_state.call_count + 1
    if rank == world - 1:
        with pytest.raises(MegaMoEInputError, match="num_max_tokens_per_rank"):
            big = cfg.num_max_tokens_per_rank + 1
            mega_moe(
                torch.zeros(big, cfg.hidden, dtype=cfg.dtype, device=dev),
                torch.zeros(big, cfg.topk, dtype=torch.long, device=dev),
                torch.ones(big, cfg.topk, device=dev),
                w1,
                w2,
                buf,
                backend="triton",
            )
    else:
        mega_moe(x, idx, tw, w1, w2, buf, backend="triton")
    torch.cuda.synchronize()
    for _ in range(VERDICT_LAG - 1):
        good_call()
    with pytest.raises(MegaMoEInputError, match=rf"call {n}\): .*rank\(s\) \[{world - 1}\] rejected"):
        mega_moe(x, idx, tw, w1, w2, buf, backend="triton")
    good_call()
    # A run's last call: no later call raises its verdict; raise_pending_verdicts does, once.
    n = buf.call_state.call_count + 1
    mega_moe(x, bad_idx, tw, w1, w2, buf, backend="triton")
    with pytest.raises(MegaMoEInputError, match=rf"call {n}\): .*rank\(s\) \[{world - 1}\] rejected"):
        raise_pending_verdicts(buf)
    raise_pending_verdicts(buf)
    assert buf.call_state.pending == []


@pytest.mark.parametrize("world", WORLDS)
def test_triton_bad_ids(rank_pools, world):
    rank_pools(world, "nccl").run(bad_ids_sync_then_deferred)


def graph_capture(rank, world, recipe):
    cfg = MegaMoEConfig(**dict(TRITON_BASE, recipe=recipe, num_shared_experts=1))
    prob = make_problem(cfg, world, [200] * world, seed=9)
    prob2 = make_problem(cfg, world, [200] * world, seed=10)
    E_l = cfg.num_experts // world
    mine = slice(rank * E_l, (rank + 1) * E_l)
    buf = get_symm_buffer(None, cfg, timeout_s=20)
    dev = buf.device
    leaf = lambda t: t.clone().to(dev).requires_grad_()
    x, tw = leaf(prob["x"][rank]), leaf(prob["w"][rank])
    w1, w2, sw1, sw2 = leaf(prob["w1"][mine]), leaf(prob["w2"][mine]), leaf(prob["sw1"]), leaf(prob["sw2"])
    idx, gy = prob["idx"][rank].to(dev), prob["gy"][rank].to(dev)
    params = (x, tw, w1, w2, sw1, sw2)

    def step():
        y = mega_moe(x, idx, tw, w1, w2, buf, shared_w1=sw1, shared_w2=sw2, backend="triton")
        y.backward(gy)
        return y

    def eager():
        for p in params:
            p.grad = None
        y = step()
        torch.cuda.synchronize()
        return [y.detach().clone()] + [p.grad.clone() for p in params]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for p in params:
                p.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step()
    # New token inputs in place, replay, compare with an eager run on the same inputs.
    with torch.no_grad():
        x.copy_(prob2["x"][rank])
        tw.copy_(prob2["w"][rank])
        idx.copy_(prob2["idx"][rank])
        gy.copy_(prob2["gy"][rank])
    graph.replay()
    torch.cuda.synchronize()
    got = [y_static.detach().clone()] + [p.grad.clone() for p in params]
    graph.replay()  # twice: same bits
    torch.cuda.synchronize()
    assert torch.equal(got[0], y_static)
    want = eager()
    for name, a, b in zip(["y", "x", "topk_weights", "w1", "w2", "shared_w1", "shared_w2"], got, want):
        assert torch.equal(a, b), (name, rel_err(a, b))
    y_dense = dense_moe(
        prob2["x"][rank], prob2["idx"][rank], prob2["w"][rank], prob["w1"], prob["w2"], cfg, prob["sw1"], prob["sw2"]
    )
    assert rel_err(got[0].cpu(), y_dense) < 2e-2


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("recipe", ["bf16", "fp8", "mxfp8_mxfp4"])
def test_triton_forward_backward_in_cuda_graph(rank_pools, world, recipe):
    rank_pools(world, "nccl").run(graph_capture, recipe)


def triton_against_reference(rank, world, recipe, shape=None):
    """Both executors on the same GPU inputs, through the same protocol (poisoned memory)."""
    cfg_kwargs = dict(TRITON_BASE, recipe=recipe, num_shared_experts=1, activation_clamp=6.0, **(shape or {}))
    poison_buffer(cfg_kwargs)
    return poisoned(_triton_against_reference, rank, world, MegaMoEConfig(**cfg_kwargs), recipe)


OUTPUTS = ["y", "x", "topk_weights", "w1", "w2", "shared_w1", "shared_w2"]


def _reference_problem(cfg, world):
    return make_problem(cfg, world, ([190, 0, 77, 300] * 2)[:world], seed=31)


def _forward_backward(rank, world, cfg, prob, backend):
    """One mega_moe forward + backward of this rank's part of prob: [y, then the gradients of
    OUTPUTS[1:]]."""
    E_l = cfg.num_experts // world
    mine = slice(rank * E_l, (rank + 1) * E_l)
    buf = get_symm_buffer(None, cfg, timeout_s=20)
    leaf = lambda t: t.clone().to(buf.device).requires_grad_()
    params = [
        leaf(prob["x"][rank]),
        leaf(prob["w"][rank]),
        leaf(prob["w1"][mine]),
        leaf(prob["w2"][mine]),
        leaf(prob["sw1"]),
        leaf(prob["sw2"]),
    ]
    x, tw, w1, w2, sw1, sw2 = params
    y = mega_moe(x, prob["idx"][rank].to(buf.device), tw, w1, w2, buf, shared_w1=sw1, shared_w2=sw2, backend=backend)
    y.backward(prob["gy"][rank].to(buf.device))
    return [y.detach()] + [p.grad for p in params]


def _triton_against_reference(rank, world, cfg, recipe):
    prob = _reference_problem(cfg, world)
    out = {}
    for backend in ("reference", "triton"):
        out[backend] = [t.float().cpu() for t in _forward_backward(rank, world, cfg, prob, backend)]
    tol = _gpu_tolerance(dict(recipe=recipe))
    for name, a, b in zip(OUTPUTS, out["triton"], out["reference"]):
        assert not torch.isnan(b).any(), f"{name}: the reference's output has NaN (an unwritten element)"
        if b.numel() and b.norm() > 0:
            assert rel_err(a, b) < tol, (name, rel_err(a, b))
        else:
            assert a.abs().max() == 0 if a.numel() else True, name


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("recipe", ["bf16", "fp8", "mxfp8_mxfp4"])
def test_triton_matches_reference_executor(rank_pools, world, recipe):
    rank_pools(world, "nccl").run(triton_against_reference, recipe)


def repeat_bitwise(rank, world, backend, recipe, iters):
    """backend's forward + backward `iters` times on the same inputs, the pushed regions poisoned
    with NaN before each call: every output must equal the first call's, bit for bit. Catches
    writes that are lost between ranks: the reference once wrote d(topk weight) through a column
    view, whose index_put under deterministic algorithms is a read-modify-write of the whole
    column, racing with the other owner's writes (failed ~1 call in 10)."""
    cfg_kwargs = dict(TRITON_BASE, recipe=recipe, num_shared_experts=1, activation_clamp=6.0)
    cfg = MegaMoEConfig(**cfg_kwargs)
    prob = _reference_problem(cfg, world)
    first = None
    for it in range(iters):
        poison_buffer(cfg_kwargs)
        out = poisoned(_forward_backward, rank, world, cfg, prob, backend)
        if first is None:
            first = out
        for name, a, b in zip(OUTPUTS, out, first):
            assert not torch.isnan(a).any(), (it, name)
            assert torch.equal(a, b), (it, name)


@pytest.mark.parametrize("world", [w for w in WORLDS if w > 1])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_repeated_calls_bitwise_under_poison(rank_pools, world, backend):
    rank_pools(world, "nccl").run(repeat_bitwise, backend, "bf16", 40)


# H != I, so a dgrad operand read untransposed cannot pass by shape (TRITON_BASE has H == I).
WIDE_FP8 = dict(hidden=384, intermediate=256)


@pytest.mark.parametrize("world", WORLDS)
def test_triton_fp8_gradients_hidden_ne_intermediate(rank_pools, world):
    """fp8 dgrads end to end: against the dense model of the recipe (which quantizes dY and dH the
    same way), bitwise repeat, poisoned memory; and against the reference executor."""
    cfg = dict(TRITON_BASE, recipe="fp8", **WIDE_FP8)
    rank_pools(world, "nccl").run(triton_against_dense, cfg, [300, 157, 211, 64, 300, 5, 128, 77][:world], seed=77)
    rank_pools(world, "nccl").run(triton_against_reference, "fp8", WIDE_FP8)


# the MX recipe's dgrads against the transposed E2M1 weights: N = I, K = H (L2) and N = H, K = 2I
# (L1) with H != I, an odd number of 128-column blocks (H = 384: no CTA pairs on the L1 dgrad)
WIDE_MX = dict(hidden=384, intermediate=256)


@pytest.mark.parametrize("world", WORLDS)
def test_triton_mx_gradients_hidden_ne_intermediate(rank_pools, world):
    """mxfp8_mxfp4's MXFP8 dgrads on the transposed E2M1 weights end to end: against the dense
    model of the recipe, bitwise repeat, poisoned memory; and against the reference executor."""
    cfg = dict(TRITON_BASE, recipe="mxfp8_mxfp4", **WIDE_MX)
    rank_pools(world, "nccl").run(triton_against_dense, cfg, [300, 157, 211, 64, 300, 5, 128, 77][:world], seed=78)
    rank_pools(world, "nccl").run(triton_against_reference, "mxfp8_mxfp4", WIDE_MX)


@pytest.mark.parametrize("mx_gemm", ["expanded", "folded"])
@pytest.mark.parametrize("seed, hidden, tokens", [(21, 384, 37), (22, 256, 131), (23, 640, 250)])
def test_mx_backward_against_reference_executor(mx_gemm, seed, hidden, tokens):
    """The executor's mxfp8_mxfp4 backward on one GPU, fresh random inputs, every uninitialized
    tensor NaN-poisoned: dY quantized to MXFP8 and folded (here by quantize_rows_mx + fold_mx_rows,
    the pull's path is checked in test_fp8_backward_kernels), dH by the SwiGLU backward, the dgrads
    on the transposed E2M1 weights through our expert GEMM (MEGAMOE_MX_GEMM=expanded) or CUTLASS
    fp8 on them folded (the default), against the reference executor; closer to it than to unquantized
    gradients on the forward's weights; no bf16 compute copies read."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from fp8_backward_checks import check_executor_backward_against_reference

    errors = poisoned(check_executor_backward_against_reference, "cuda", "mxfp8_mxfp4", mx_gemm, seed, hidden, tokens)
    print({name: f"{err:.2e} (unquantized: {other:.2e})" for name, (err, other) in errors.items()})


def test_fp8_backward_kernels():
    """dY quantization bit for bit quant.quantize_grad (and the pull's, fp8 and MXFP8 folded); SwiGLU
    backward's e4m3 dH (and MXFP8 folded); the executor's fp8 and mxfp8_mxfp4 backward against the
    reference executor on one GPU (closer to it than to unquantized dgrads), without the bf16
    compute copies; NaN-poisoned outputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from fp8_backward_checks import run_all

    for recipe, errors in poisoned(run_all, "cuda").items():
        print(recipe, {name: f"{err:.2e} (unquantized: {other:.2e})" for name, (err, other) in errors.items()})


def test_wgrad_quantize_tokens_t_kernel():
    """The fp8 wgrad's operand quantization (triton_kernels.quantize_tokens_t) on CUDA: bit for bit
    quant.quantize_tokens_t from bf16 and e4m3 sources, NaN padding rows read as zero, NaN-poisoned
    output written for every 128-row block below num_rows and for none past it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from fp8_backward_checks import check_quantize_tokens_t

    poisoned(check_quantize_tokens_t, "cuda")


def test_device_plan_tables():
    """The device plan (backends/triton_plan.py) equals plan.build_plan table by table on CUDA:
    random, skewed, one-expert and empty routings; aligns 1-128; K not a power of two; ids read
    from separate buffers with the call's ok flag; the routing's publication (store_routing) and the
    owner masks (routing_masks)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from plan_kernel_checks import check_plan_from_buffers, check_plan_tables, check_routing_masks, check_store_routing

    check_plan_tables("cuda")
    check_plan_from_buffers("cuda")
    check_store_routing("cuda")
    check_routing_masks("cuda")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("recipe", ["bf16", "fp8", "fp8_e4m3_wgrad"])
def test_triton_fused_wgrad_accumulation(rank_pools, world, recipe):
    """fuse_wgrad_accumulation on the GPU executor: expert wgrads added into fp32 main_grad by
    the CUTLASS epilogue (fp8_e4m3_wgrad: its fp8 GEMM, then an add); every other output and
    gradient bitwise as unfused; a missing accumulator rejected on every rank."""
    from test_mega_moe_dist import fused_wgrad_accumulation

    cfg = dict(TRITON_BASE, recipe=recipe)
    rank_pools(world, "nccl").run(fused_wgrad_accumulation, cfg, 51, tol=1e-2)


# ----------------------------------------------------------------------------- the quantizers' division


def _divide_rn_kernel():
    import triton
    import triton.language as tl

    from megamoe_train.backends.triton_kernels import divide_rn

    @triton.jit
    def kernel(x_ptr, scale_ptr, out_ptr, n_x, BLOCK: tl.constexpr):
        s = tl.load(scale_ptr + tl.program_id(1))
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n_x)
        q = divide_rn(x, s, tl.math.div_rn(1.0, s))
        tl.store(out_ptr + tl.program_id(1).to(tl.int64) * n_x + offs, q, mask=offs < n_x)

    return kernel


def _check_division(kernel, x, scales, chunk=1024):
    """divide_rn(x, scale) against torch's x / scale (correctly rounded), every pair whose quotient
    is in the quantizers' domain (|x| <= amax, so |x / scale| <= 448; checked up to 2^12, past
    which the FMA corrections may overflow): the fp32 bits, and where torch's quotient is below
    2^-20 (subnormal territory, far under e4m3's smallest step 2^-9, where a flushed or
    once-rounded operand may differ in fp32) the e4m3 bits the quantizers keep of it."""
    for i in range(0, scales.numel(), chunk):
        s = scales[i : i + chunk].contiguous()
        out = torch.empty(s.numel(), x.numel(), device=x.device)
        kernel[(triton_cdiv(x.numel(), 1024), s.numel())](x, s, out, x.numel(), BLOCK=1024)
        want = x[None, :] / s[:, None]
        same = (out.view(torch.int32) == want.view(torch.int32)) | (out.isnan() & want.isnan())
        tiny = want.abs() < 2.0**-20
        e4m3 = lambda t: t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)  # noqa: E731
        same |= tiny & (e4m3(out) == e4m3(want))
        same |= want.abs() > 2.0**12  # outside the domain (infinite scales give 0 or NaN: inside)
        if not bool(same.all()):
            bad = (~same).nonzero()[0].tolist()
            raise AssertionError(
                f"x={x[bad[1]].item()!r} / scale={s[bad[0]].item()!r}: {out[tuple(bad)].item()!r}, "
                f"torch {want[tuple(bad)].item()!r} ({int((~same).sum())} pairs differ)"
            )


def triton_cdiv(a, b):
    return -(-a // b)


def test_quantizer_division_is_torchs_bit_for_bit():
    """triton_kernels.divide_rn (the quantizers' x / scale without div_rn's per-element check):
    every bf16 value (all 65536 bit patterns, subnormals, zeros of both signs, infinities, NaN)
    over every scale a bf16 weight block can have (max(amax, 1e-4) / 448 for every finite
    positive bf16 amax, and an infinite one), then 2^26 random fp32 values (wide exponents,
    the activations' case) over random scales: torch's bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda")
    kernel = _divide_rn_kernel()
    bits = torch.arange(-32768, 32768, dtype=torch.int32, device=dev).to(torch.int16)
    x = bits.view(torch.bfloat16).float()
    amax = x[(x > 0) & x.isfinite()]
    scales = torch.unique(torch.clamp(amax, min=1e-4) / 448.0)
    scales = torch.cat([scales, torch.tensor([float("inf")], device=dev)])
    _check_division(kernel, x, scales)
    g = torch.Generator(device=dev).manual_seed(0)
    for _ in range(4):
        xr = torch.randn(1 << 24, device=dev, generator=g) * torch.exp2(
            torch.randint(-60, 60, (1 << 24,), device=dev, generator=g).float()
        )
        sr = (
            torch.clamp(
                torch.rand(64, device=dev, generator=g)
                * torch.exp2(torch.randint(-30, 30, (64,), device=dev, generator=g).float()),
                min=1e-4,
            )
            / 448.0
        )
        _check_division(kernel, xr, sr, chunk=4)
