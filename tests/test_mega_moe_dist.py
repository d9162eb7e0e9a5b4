"""mega_moe across real processes (gloo + /dev/shm symmetric buffers) against a dense MoE.

Every rank draws the same global problem from one seed (all ranks' tokens, all experts), runs
mega_moe on its own slice, and compares its output and every gradient with the dense MoE of
dense_moe.py computed on the whole problem.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dense_moe import dense_moe, dense_moe_ranks

from megamoe_train import MegaMoEConfig, MegaMoEInputError, get_symm_buffer, mega_moe, transform_weights
from megamoe_train.call_state import VERDICT_LAG

TIMEOUT_S = 20  # device-side waits (monitored barriers) of the test buffers


def make_problem(cfg: MegaMoEConfig, world: int, tokens: list[int], seed: int, routing: str = "uniform"):
    g = torch.Generator().manual_seed(seed)
    E, H, I, K = cfg.num_experts, cfg.hidden, cfg.intermediate, cfg.topk
    prob = {"x": [], "idx": [], "w": [], "gy": []}
    for T in tokens:
        prob["x"].append(torch.randn(T, H, generator=g).to(cfg.dtype))
        if routing == "one_expert":  # every token's slot 0 on expert E-1, rest masked
            idx = torch.full((T, K), -1, dtype=torch.int64)
            idx[:, 0] = E - 1
        else:
            idx = (
                torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
                if T
                else torch.zeros(0, K, dtype=torch.int64)
            )
            if routing == "masked":
                idx[torch.rand(T, K, generator=g) < 0.3] = -1
            elif routing == "skewed":  # half of all slots go to expert 0's neighbourhood
                hot = torch.rand(T, generator=g) < 0.5
                idx[hot, 0] = torch.where(idx[hot, 1:].eq(0).any(1), idx[hot, 0], 0)
        prob["idx"].append(idx)
        prob["w"].append(torch.rand(T, K, generator=g) + 0.1)
        prob["gy"].append(torch.randn(T, H, generator=g).to(cfg.dtype))
    scale1, scale2 = H**-0.5, I**-0.5
    prob["w1"] = torch.randn(E, 2 * I, H, generator=g) * scale1
    prob["w2"] = torch.randn(E, H, I, generator=g) * scale2
    if cfg.num_shared_experts:
        W = cfg.shared_width
        prob["sw1"] = torch.randn(2 * W, H, generator=g) * scale1
        prob["sw2"] = torch.randn(H, W, generator=g) * scale2
    return prob


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _tolerance(cfg):
    if cfg.precision.quantized:
        return 2e-2  # one e4m3 step flipped by a different fp32 summation order is ~6% of one element
    return 1e-5 if cfg.dtype == torch.float32 else 1e-2  # bf16 rounding of combine rows is ~2e-3


def run_against_dense(
    rank,
    world,
    cfg_kwargs,
    tokens,
    seed,
    routing="uniform",
    repeat=False,
    backend="auto",
    tol=None,
    dgrad_quant=True,
    wgrad_quant=True,
):
    """mega_moe on this rank (on the group's device: CUDA under NCCL) against the dense oracle on CPU
    (dgrad_quant / wgrad_quant=False: against fp32 dgrad inputs / wgrad products even where the
    recipe quantizes them)."""
    cfg = MegaMoEConfig(**cfg_kwargs)
    prob = make_problem(cfg, world, tokens, seed, routing)
    E_l = cfg.num_experts // world
    mine = slice(rank * E_l, (rank + 1) * E_l)
    buf = get_symm_buffer(None, cfg, timeout_s=TIMEOUT_S)
    dev = buf.device
    leaf = lambda t: t.clone().to(dev).requires_grad_()
    x, tw = leaf(prob["x"][rank]), leaf(prob["w"][rank])
    w1, w2 = leaf(prob["w1"][mine]), leaf(prob["w2"][mine])
    shared = {}
    if cfg.num_shared_experts:
        shared = dict(shared_w1=leaf(prob["sw1"]), shared_w2=leaf(prob["sw2"]))
    stats = torch.zeros(E_l, dtype=torch.int64, device=dev)
    idx, gy = prob["idx"][rank].to(dev), prob["gy"][rank].to(dev)

    def run():
        y = mega_moe(x, idx, tw, w1, w2, buf, recv_stats=stats, backend=backend, **shared)
        (y.float() * gy.float()).sum().backward()
        grads = [t.grad.cpu() for t in (x, tw, w1, w2, *shared.values())]
        for t in (x, tw, w1, w2, *shared.values()):
            t.grad = None
        return y.detach().cpu(), grads

    y, grads = run()

    # Dense oracle over the whole problem; gradients for this rank's slice.
    xs = [t.clone().requires_grad_() for t in prob["x"]]
    tws = [t.clone().requires_grad_() for t in prob["w"]]
    W1, W2 = prob["w1"].clone().requires_grad_(), prob["w2"].clone().requires_grad_()
    SW = [prob[k].clone().requires_grad_() for k in ("sw1", "sw2")] if shared else [None, None]
    detached = [t.detach() if t is not None else None for t in SW]
    sws = [SW if r == rank else detached for r in range(world)]  # shared grads are per rank
    y_refs = dense_moe_ranks(xs, prob["idx"], tws, W1, W2, cfg, sws, dgrad_quant=dgrad_quant, wgrad_quant=wgrad_quant)
    loss = sum((y_ref_r.to(cfg.dtype).float() * gy_r.float()).sum() for y_ref_r, gy_r in zip(y_refs, prob["gy"]))
    y_ref = y_refs[rank].detach()
    loss.backward()
    refs = [xs[rank].grad, tws[rank].grad, W1.grad[mine], W2.grad[mine]] + ([SW[0].grad, SW[1].grad] if shared else [])
    names = ["x", "topk_weights", "w1", "w2", "shared_w1", "shared_w2"]

    tol = tol or _tolerance(cfg)
    errors = {}
    if y.numel():
        errors["y"] = rel_err(y, y_ref)
    for name, got, ref in zip(names, grads, refs):
        if ref is None:  # nothing reached it in the dense graph (e.g. a rank with no tokens)
            ref = torch.zeros_like(got)
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        if ref.numel() and ref.norm() > 0:
            errors[name] = rel_err(got, ref)
        else:
            assert got.abs().max() == 0 if got.numel() else True, f"{name}: expected zero gradient"
    bad = {k: v for k, v in errors.items() if not v < tol}
    assert not bad, f"rank {rank}: relative errors above {tol}: {bad} (all: {errors})"

    # Masked slots get exactly zero weight gradient.
    masked = prob["idx"][rank] < 0
    assert (grads[1][masked] == 0).all()

    # recv stats: rows each local expert received from all ranks.
    all_idx = torch.cat(prob["idx"])
    true_counts = torch.stack([(all_idx == e).sum() for e in range(mine.start, mine.stop)])
    assert torch.equal(stats.cpu(), true_counts), (stats, true_counts)

    if repeat:  # same inputs, same bits, forward and backward
        y2, grads2 = run()
        assert torch.equal(y, y2)
        for a, b in zip(grads, grads2):
            assert torch.equal(a, b)
    return errors


F32 = dict(dtype=torch.float32)
BASE = dict(num_experts=8, hidden=64, intermediate=32, topk=2, num_max_tokens_per_rank=40, block_m=16, **F32)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_matches_dense_bf16_recipe_fp32(rank_pools, world):
    tokens = [37, 23, 40, 5][:world]
    rank_pools(world).run(run_against_dense, BASE, tokens, seed=world, repeat=True)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fresh_random_shapes(rank_pools, world):
    g = torch.Generator().manual_seed(100 + world)
    for trial in range(2):
        E = world * int(torch.randint(1, 4, (1,), generator=g))
        K = int(torch.randint(1, E + 1, (1,), generator=g))
        H = 8 * int(torch.randint(2, 9, (1,), generator=g))
        I = 8 * int(torch.randint(1, 6, (1,), generator=g))
        tokens = torch.randint(0, 30, (world,), generator=g).tolist()
        cfg = dict(num_experts=E, hidden=H, intermediate=I, topk=K, num_max_tokens_per_rank=30, block_m=8, **F32)
        rank_pools(world).run(run_against_dense, cfg, tokens, seed=trial)


def test_bf16_dtype(rank_pools):
    cfg = dict(BASE, dtype=torch.bfloat16)
    rank_pools(2).run(run_against_dense, cfg, [40, 31], seed=5)


@pytest.mark.parametrize("recipe", ["fp8", "mxfp8_mxfp4"])
@pytest.mark.parametrize("world", [1, 2])
def test_quantized_recipes(rank_pools, world, recipe):
    cfg = dict(BASE, recipe=recipe, hidden=256, intermediate=128, num_max_tokens_per_rank=24)
    rank_pools(world).run(run_against_dense, cfg, [24, 17][:world], seed=7, repeat=True)


@pytest.mark.parametrize("recipe", ["fp8", "fp8_e4m3_wgrad"])
def test_fp8_gradients_against_fp32_gradients(rank_pools, recipe):
    """The fp8 recipes' dgrad GEMMs read e4m3 gradients (1x128 blocks); fp8_e4m3_wgrad's wgrad GEMMs
    also e4m3 operands (1x128 blocks along the tokens): against the dense model of the same recipe
    the oracle agrees to rounding (run_against_dense's default tolerance); against a dense model
    with all-fp32 gradients (same quantized forward, straight-through) it differs by what e4m3
    rounding of the gradients costs. Measured (H = I = 256, 64 + 51 tokens, EP 2, seeds 17-19,
    fp32 and bf16 compute): dX 3.4-3.6% (two quantized gradients on its path), d(topk weight)
    2.0-3.1%; fp8: dW1 2.5-2.7% (its dH comes from the quantized-dY dgrad), dW2 0 (it reads the
    unquantized dY); fp8_e4m3_wgrad: dW1 3.8-4.0%, dW2 2.8-2.9%; y is untouched. e4m3's 3
    mantissa bits round an element by ~2.5% rms."""
    cfg = dict(BASE, recipe=recipe, hidden=256, intermediate=256, num_max_tokens_per_rank=64)
    errors = rank_pools(2).run(
        run_against_dense, cfg, [64, 51], seed=17, tol=5e-2, dgrad_quant=False, wgrad_quant=False
    )
    for err in errors:
        assert err["x"] > 1e-2 and err["w1"] > 1e-2, err  # the gradients really are quantized
        if recipe == "fp8":
            assert err["w2"] < 1e-5, err
        else:
            assert err["w2"] > 1e-2, err
        assert err["y"] < 1e-5, err


def test_mx_gradients_against_fp32_gradients(rank_pools):
    """mxfp8_mxfp4's dgrad GEMMs read MXFP8 gradients (1x32 blocks) and the E2M1 copies of the
    transposed master weights (1x32 blocks along the dgrad's K, a quantization of their own): against
    the dense model of the recipe the oracle agrees to rounding (test_quantized_recipes); against a
    dense model with all-fp32 gradients on the forward's (E2M1) weights it differs by what both
    cost. Measured (H = I = 256, 64 + 51 tokens, EP 2, seeds 17-19, fp32 and bf16 compute): dX
    8.7-9.0%, d(topk weight) 5.3-7.3%, dW1 6.0-6.5% (its dH comes from the quantized L2 dgrad), dW2
    0 (it reads the unquantized dY); of that the MXFP8 gradients alone (on the forward's weights)
    cost dX 3.7-3.8%, the transposed weights alone (with fp32 gradients) dX 8.0-8.2%; y is
    untouched."""
    cfg = dict(BASE, recipe="mxfp8_mxfp4", hidden=256, intermediate=256, num_max_tokens_per_rank=64)
    errors = rank_pools(2).run(run_against_dense, cfg, [64, 51], seed=17, tol=0.12, dgrad_quant=False)
    for err in errors:
        assert err["x"] > 5e-2 and err["topk_weights"] > 3e-2 and err["w1"] > 3e-2, err  # really quantized
        assert err["w2"] < 1e-5 and err["y"] < 1e-5, err


def test_fp8_wgrad_against_fp32_wgrad(rank_pools):
    """The wgrad quantization alone: against the dense model of the recipe with fp32 wgrad products
    (dgrad inputs still quantized), dX and d(topk weight) agree to fp32 rounding and both weight
    gradients differ by the e4m3 rounding of their two operands. Measured (as above, seeds
    17-19, fp32 and bf16 compute): dW1 2.9-2.95%, dW2 2.8-2.95%."""
    cfg = dict(BASE, recipe="fp8_e4m3_wgrad", hidden=256, intermediate=256, num_max_tokens_per_rank=64)
    errors = rank_pools(2).run(run_against_dense, cfg, [64, 51], seed=18, tol=4e-2, wgrad_quant=False)
    for err in errors:
        assert err["w1"] > 1e-2 and err["w2"] > 1e-2, err  # the wgrad operands really are quantized
        assert err["y"] < 1e-5 and err["x"] < 1e-5 and err["topk_weights"] < 1e-5, err


def test_quantized_recipe_bf16_ep4(rank_pools):
    cfg = dict(BASE, recipe="fp8", hidden=128, intermediate=128, num_max_tokens_per_rank=16, dtype=torch.bfloat16)
    rank_pools(4).run(run_against_dense, cfg, [16, 3, 0, 9], seed=8)


@pytest.mark.parametrize("routing", ["masked", "one_expert", "skewed"])
def test_routing_patterns(rank_pools, routing):
    rank_pools(2).run(run_against_dense, BASE, [40, 33], seed=11, routing=routing)


def test_rank_with_zero_tokens(rank_pools):
    rank_pools(4).run(run_against_dense, BASE, [0, 25, 0, 40], seed=12)


@pytest.mark.parametrize("topk", [1, 8])
def test_topk_extremes(rank_pools, topk):
    rank_pools(2).run(run_against_dense, dict(BASE, topk=topk), [29, 40], seed=13)


def test_shared_experts_and_clamp(rank_pools):
    cfg = dict(BASE, num_shared_experts=2, shared_intermediate=16, activation_clamp=0.5)
    rank_pools(2).run(run_against_dense, cfg, [40, 21], seed=14, repeat=True)
    rank_pools(4).run(
        run_against_dense, dict(cfg, recipe="mxfp8_mxfp4", hidden=64, intermediate=64), [9, 0, 12, 5], seed=15
    )


# ----------------------------------------------------------------------------- bad input


def bad_input_then_good(rank, world, case):
    cfg = MegaMoEConfig(**BASE)
    prob = make_problem(cfg, world, [20] * world, seed=21)
    E_l = cfg.num_experts // world
    w1, w2 = prob["w1"][rank * E_l : (rank + 1) * E_l], prob["w2"][rank * E_l : (rank + 1) * E_l]
    buf = get_symm_buffer(None, cfg, timeout_s=TIMEOUT_S)
    x, idx, tw = prob["x"][rank], prob["idx"][rank], prob["w"][rank]
    bad_rank = world - 1
    args = dict(x=x, idx=idx, tw=tw, w1=w1, w2=w2, prepared=None)
    if rank == bad_rank:
        if case == "id_too_large":
            args["idx"] = idx.clone().index_fill_(0, torch.tensor([3]), cfg.num_experts)
        elif case == "id_negative":
            args["idx"] = idx.clone().index_fill_(0, torch.tensor([0]), -2)
        elif case == "too_many_tokens":
            args["x"] = torch.randn(41, cfg.hidden)
            args["idx"] = torch.zeros(41, cfg.topk, dtype=torch.int64)
            args["tw"] = torch.ones(41, cfg.topk)
        elif case == "wrong_dtype":
            args["x"] = x.to(torch.float64)
        elif case == "wrong_idx_dtype":
            args["idx"] = idx.to(torch.int32)
        elif case == "wrong_shape":
            args["w1"] = w1[:, :, :-1]
        elif case == "wrong_device":
            args["x"] = x.to("meta")
        elif case == "prepared_other_recipe":
            args["prepared"] = dataclasses.replace(transform_weights(w1, w2, cfg), recipe="fp8")
        elif case == "prepared_other_experts":
            args["prepared"] = transform_weights(w1[:-1], w2[:-1], cfg)
    with pytest.raises(MegaMoEInputError) as err:
        mega_moe(args["x"], args["idx"], args["tw"], args["w1"], args["w2"], buf, prepared_weights=args["prepared"])
    message = str(err.value)
    if rank == bad_rank:
        expected = {
            "id_too_large": "topk_idx",
            "id_negative": "topk_idx",
            "too_many_tokens": "num_max_tokens_per_rank",
            "wrong_dtype": "x: expected dtype",
            "wrong_idx_dtype": "topk_idx: expected dtype",
            "wrong_shape": "w1: expected shape",
            "wrong_device": "x: expected device",
            "prepared_other_recipe": "prepared for recipe 'fp8'",
            "prepared_other_experts": f"prepared_weights: {E_l - 1} experts",
        }[case]
        assert expected in message, message
    else:
        assert f"rank(s) [{bad_rank}] rejected" in message, message
    # The buffer is still usable: a good call right after matches the dense MoE.
    y = mega_moe(x, idx, tw, w1, w2, buf)
    y_ref = dense_moe(x, idx, tw, prob["w1"], prob["w2"], cfg)
    assert rel_err(y, y_ref) < 1e-5
    # Weights prepared by the caller: the same call
    assert torch.equal(mega_moe(x, idx, tw, w1, w2, buf, prepared_weights=transform_weights(w1, w2, cfg)), y)


@pytest.mark.parametrize(
    "case",
    [
        "id_too_large",
        "id_negative",
        "too_many_tokens",
        "wrong_dtype",
        "wrong_idx_dtype",
        "wrong_shape",
        "wrong_device",
        "prepared_other_recipe",
        "prepared_other_experts",
    ],
)
def test_bad_input_fails_everywhere_and_buffer_survives(rank_pools, case):
    rank_pools(2).run(bad_input_then_good, case)


def buffer_config_mismatch(rank, world):
    cfg = MegaMoEConfig(**BASE)
    other = MegaMoEConfig(**dict(BASE, hidden=32))
    buf = get_symm_buffer(None, other, timeout_s=TIMEOUT_S)
    prob = make_problem(cfg, world, [8] * world, seed=3)
    E_l = cfg.num_experts // world
    with pytest.raises(MegaMoEInputError, match="x: expected shape"):
        mega_moe(prob["x"][rank], prob["idx"][rank], prob["w"][rank], prob["w1"][:E_l], prob["w2"][:E_l], buf)
    from megamoe_train import MegaMoELayer

    with pytest.raises(ValueError, match="does not match"):
        MegaMoELayer(cfg, buffer=buf)
    assert get_symm_buffer(None, other) is buf  # cached per (group, config)
    buf.destroy()
    with pytest.raises(RuntimeError, match="after destroy"):
        buf.regions()
    assert get_symm_buffer(None, other) is not buf


def test_config_mismatch_and_buffer_cache(rank_pools):
    rank_pools(2).run(buffer_config_mismatch)


# ----------------------------------------------------------------------------- gradient-accumulation fusion


def fused_wgrad_accumulation(rank, world, cfg_kwargs, seed, tol=0.0):
    """fuse_wgrad_accumulation=True adds the expert weight gradients into w.main_grad (random
    start values), flags grad_added_to_main_grad, and leaves every other gradient as an unfused
    call computes it. tol=0: main_grad - start equals the unfused gradient bit for bit (the
    reference executor adds the same fp32 tensor); else within tol (the GPU epilogue adds the
    fp32 product where the unfused path rounds the gradient to the weight's dtype first)."""
    cfg = MegaMoEConfig(**cfg_kwargs)
    prob = make_problem(cfg, world, [37, 21, 40, 8][:world], seed)
    E_l = cfg.num_experts // world
    mine = slice(rank * E_l, (rank + 1) * E_l)
    buf = get_symm_buffer(None, cfg, timeout_s=TIMEOUT_S)
    dev = buf.device
    leaf = lambda t: t.clone().to(dev, cfg.dtype).requires_grad_()
    x, tw = leaf(prob["x"][rank]), prob["w"][rank].clone().to(dev).requires_grad_()
    w1, w2 = leaf(prob["w1"][mine]), leaf(prob["w2"][mine])
    idx, gy = prob["idx"][rank].to(dev), prob["gy"][rank].to(dev)
    g = torch.Generator().manual_seed(seed + 1)
    start = [torch.randn(w.shape, generator=g).to(dev) for w in (w1, w2)]

    def run(fuse):
        y = mega_moe(x, idx, tw, w1, w2, buf, fuse_wgrad_accumulation=fuse)
        (y.float() * gy.float()).sum().backward()
        grads = [t.grad.clone() for t in (x, tw, w1, w2)]
        for t in (x, tw, w1, w2):
            t.grad = None
        return y.detach(), grads

    y_ref, (gx_ref, gtw_ref, gw1_ref, gw2_ref) = run(False)
    w1.main_grad, w2.main_grad = start[0].clone(), start[1].clone()
    y, (gx, gtw, _, _) = run(True)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref) and torch.equal(gtw, gtw_ref)
    for name, w, s, ref in (("w1", w1, start[0], gw1_ref), ("w2", w2, start[1], gw2_ref)):
        assert w.grad_added_to_main_grad is True, name
        added = w.main_grad - s
        if tol == 0.0:
            assert torch.equal(w.main_grad, s + ref.float()), name
        else:
            assert rel_err(added, ref.float()) < tol, (name, rel_err(added, ref.float()))

    # overwrite_main_grad (main_grad.py): the stale main_grad (NaN) is written over, never read, and
    # the request is used up: the next backward adds again.
    for w in (w1, w2):
        w.main_grad.fill_(float("nan"))
        w.overwrite_main_grad = True
    run(True)
    for name, w, ref in (("w1", w1, gw1_ref), ("w2", w2, gw2_ref)):
        assert w.overwrite_main_grad is False, name
        if tol == 0.0:
            assert torch.equal(w.main_grad, ref.float()), name
        else:
            assert rel_err(w.main_grad, ref.float()) < tol, (name, rel_err(w.main_grad, ref.float()))
    written = [w.main_grad.clone() for w in (w1, w2)]
    run(True)
    for name, w, first in (("w1", w1, written[0]), ("w2", w2, written[1])):
        assert torch.equal(w.main_grad, first + first), name  # the same gradient added once more

    # A weight without an accumulator is bad input: every rank raises, nothing is added anywhere.
    # (With the GPU executor only the bad rank raises in that call, every rank VERDICT_LAG calls
    # later: checked with one rank; tests/test_deferred_verdicts.py has the rule with two.)
    if dev.type == "cuda" and world > 1:
        return
    before = w2.main_grad.clone()
    if rank == world - 1:
        del w1.main_grad
    with pytest.raises(MegaMoEInputError) as err:
        mega_moe(x, idx, tw, w1, w2, buf, fuse_wgrad_accumulation=True)
    expected = "needs a main_grad attribute" if rank == world - 1 else "rejected"
    assert expected in str(err.value), str(err.value)
    assert torch.equal(w2.main_grad, before)
    if dev.type == "cuda":  # the GPU executor reports that call n again at call n + VERDICT_LAG
        n = buf.call_state.call_count
        w1.main_grad = start[0].clone()
        for _ in range(VERDICT_LAG - 1):  # the calls between run
            mega_moe(x, idx, tw, w1, w2, buf, fuse_wgrad_accumulation=True)
        with pytest.raises(MegaMoEInputError, match=rf"call {n}\): .*rejected their input"):
            mega_moe(x, idx, tw, w1, w2, buf, fuse_wgrad_accumulation=True)
        mega_moe(x, idx, tw, w1, w2, buf, fuse_wgrad_accumulation=True)  # and the buffer works again


@pytest.mark.parametrize("world", [1, 2])
def test_fused_wgrad_accumulation(rank_pools, world):
    cfg = dict(BASE)
    rank_pools(world).run(fused_wgrad_accumulation, cfg, 31)
    # bf16 weights: the unfused gradient is the fp32 one rounded to bf16
    rank_pools(world).run(
        fused_wgrad_accumulation,
        dict(cfg, recipe="fp8", dtype=torch.bfloat16, hidden=128, intermediate=128, block_m=128),
        32,
        tol=1e-2,
    )
