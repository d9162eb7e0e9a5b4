"""GraphedMegaMoE (megamoe_train/graphs.py), marked `gpu`: a layer replayed from its captured
forward and backward graphs gives the same bits as eager calls, step after step, while the
inputs, the routing and the weights change between steps (the fp8 weight preparation is its own
graph, replayed once per change of the weights, so a replay must read the updated weights);
gradients accumulate correctly with and without Megatron's main_grad; recv_stats count like eager
calls; calls the graph does not cover (no grad, another shape) run eagerly."""

import pytest
import torch
from test_gpu_triton import TRITON_BASE, WORLDS, mx_gemm_path
from test_mega_moe_dist import make_problem, rel_err

from megamoe_train import MegaMoEConfig, get_symm_buffer, mega_moe
from megamoe_train.graphs import GraphedMegaMoE
from megamoe_train.weights import clear_weight_cache

pytestmark = pytest.mark.gpu


def rank_inputs(problem, rank, dev):
    """x, topk ids, topk weights and dY of this rank, as the layer takes them."""
    x, idx = problem["x"][rank].to(dev, torch.bfloat16), problem["idx"][rank].to(dev)
    return x, idx, problem["w"][rank].to(dev), problem["gy"][rank].to(dev, torch.bfloat16)


def graphed_steps(rank, world, recipe):
    cfg = MegaMoEConfig(**dict(TRITON_BASE, recipe=recipe, num_shared_experts=1))
    E_l = cfg.num_experts // world
    mine = slice(rank * E_l, (rank + 1) * E_l)
    buf = get_symm_buffer(None, cfg, timeout_s=20)
    dev = buf.device
    first = make_problem(cfg, world, [200] * world, seed=3)
    param = lambda t: t.to(dev, torch.bfloat16).requires_grad_()  # bf16 masters, as in training
    w1, w2, sw1, sw2 = param(first["w1"][mine]), param(first["w2"][mine]), param(first["sw1"]), param(first["sw2"])
    params = [w1, w2, sw1, sw2]
    graphed = GraphedMegaMoE(buf, w1, w2, shared_w1=sw1, shared_w2=sw2, backend="triton")
    stats_eager = torch.zeros(E_l, dtype=torch.int64, device=dev)
    stats_graph = torch.zeros(E_l, dtype=torch.int64, device=dev)

    def run(fn, x, idx, tw, gy, stats):
        x, tw = x.clone().requires_grad_(), tw.clone().requires_grad_()
        for p in params:
            p.grad = None
        y = fn(x, idx, tw, stats)
        y.backward(gy)
        torch.cuda.synchronize()
        return [y.detach().clone(), x.grad, tw.grad] + [p.grad.clone() for p in params]

    eager = lambda x, idx, tw, stats: mega_moe(
        x, idx, tw, w1, w2, buf, shared_w1=sw1, shared_w2=sw2, backend="triton", recv_stats=stats
    )
    names = ["y", "x", "topk_weights", "w1", "w2", "shared_w1", "shared_w2"]
    for step in range(4):
        x, idx, tw, gy = rank_inputs(make_problem(cfg, world, [200] * world, seed=20 + step), rank, dev)
        want = run(eager, x, idx, tw, gy, stats_eager)
        got = run(graphed, x, idx, tw, gy, stats_graph)
        for name, a, b in zip(names, got, want):
            assert torch.equal(a, b), (step, name, rel_err(a.float().cpu(), b.float().cpu()))
        assert torch.equal(stats_graph, stats_eager), step
        with torch.no_grad():  # an optimizer step: the next replay must read these weights
            for p in params:
                p.add_(torch.randn_like(p) * 0.05 * p.float().std().to(p.dtype))

    # Gradient accumulation over two replays without zeroing: autograd copies the static grads.
    x, idx, tw, gy = rank_inputs(make_problem(cfg, world, [200] * world, seed=40), rank, dev)
    once = run(graphed, x, idx, tw, gy, None)
    fresh = lambda t: t.clone().requires_grad_()  # the captured signature: inputs that require grad
    for p in params:
        p.grad = None
    for _ in range(2):
        graphed(fresh(x), idx, fresh(tw)).backward(gy)
    for name, p, g in zip(names[3:], params, once[3:]):
        assert torch.equal(p.grad, g + g), name

    # Megatron's contract: with main_grad the grad is handed over and folded in by a hook.
    def fold_into_main_grad(q):
        q.main_grad.add_(q.grad)
        q.grad = None

    for p in params:
        p.grad = None
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=dev)
        p.register_post_accumulate_grad_hook(fold_into_main_grad)
    for _ in range(2):
        graphed(fresh(x), idx, fresh(tw)).backward(gy)
    torch.cuda.synchronize()
    for name, p, g in zip(names[3:], params, once[3:]):
        assert torch.equal(p.main_grad, 2 * g.float()), name

    # Not covered by the graph: no grad, another token count -> eager calls, same answers.
    with torch.no_grad():
        assert torch.equal(graphed(x, idx, tw), eager(x, idx, tw, None))
    short = graphed(x[:150].clone().requires_grad_(), idx[:150], tw[:150].clone().requires_grad_())
    assert torch.equal(short.detach(), eager(x[:150], idx[:150], tw[:150], None).detach())
    assert graphed.replays == 4 + 1 + 2 + 2
    # fp8: prepared at the first replay and after each of the 4 updates, not per replay
    assert graphed.weight_preparations == (5 if cfg.precision.weight_format != "native" else 0)

    # Writes through .data keep the version: clear_weight_cache() reaches the graph's copy too.
    w1.data.mul_(0.5)
    clear_weight_cache()
    xs = [fresh(x), fresh(x)]
    ys = [graphed(xs[0], idx, fresh(tw)), eager(xs[1], idx, fresh(tw), None)]
    assert torch.equal(ys[0].detach(), ys[1].detach())
    for y in ys:
        y.backward(gy)
    assert torch.equal(xs[0].grad, xs[1].grad)
    assert graphed.weight_preparations == (6 if cfg.precision.weight_format != "native" else 0)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_graphed_layer_matches_eager_across_weight_updates(rank_pools, world, recipe):
    rank_pools(world, "nccl").run(graphed_steps, recipe)


def fused_layer(rank, world, recipe, seed):
    """This rank's buffer, make_problem(seed)'s problem and the rank's experts as bf16 leaves (w1,
    w2) for the gradient-accumulation fusion cases (their main_grad is the caller's)."""
    cfg = MegaMoEConfig(**dict(TRITON_BASE, recipe=recipe))
    E_l = cfg.num_experts // world
    mine = slice(rank * E_l, (rank + 1) * E_l)
    buf = get_symm_buffer(None, cfg, timeout_s=20)
    problem = make_problem(cfg, world, [200] * world, seed=seed)
    w1 = problem["w1"][mine].to(buf.device, torch.bfloat16).requires_grad_()
    w2 = problem["w2"][mine].to(buf.device, torch.bfloat16).requires_grad_()
    return cfg, buf, problem, w1, w2


def eager_fused_call(buf, w1, w2, acc, x, idx, tw, gy, overwrite=False):
    """The eager fused call on w1's and w2's values with `acc` as their main_grads: its output."""
    a1, a2 = w1.detach().requires_grad_(), w2.detach().requires_grad_()
    a1.main_grad, a2.main_grad = acc
    a1.overwrite_main_grad = a2.overwrite_main_grad = overwrite
    y = mega_moe(x, idx, tw, a1, a2, buf, backend="triton", fuse_wgrad_accumulation=True)
    y.backward(gy)
    return y.detach()


def graphed_fused_accumulation(rank, world, recipe):
    """Gradient-accumulation fusion through the graphs: the replayed backward adds w1's and w2's
    wgrads into main_grad (the eager fused call's bits, micro-batch after micro-batch), the warm-up
    and capture leave main_grad untouched, and the flag tells the hook to skip its own add."""
    cfg, buf, first, w1, w2 = fused_layer(rank, world, recipe, seed=5)
    dev = buf.device
    for p in (w1, w2):
        p.main_grad = torch.randn(p.shape, dtype=torch.float32, device=dev)  # what earlier micro-batches left
    start = [p.main_grad.clone() for p in (w1, w2)]
    eager_acc = [m.clone() for m in start]
    graphed = GraphedMegaMoE(buf, w1, w2, backend="triton", fuse_wgrad_accumulation=True)
    for step in range(3):  # micro-batches: both accumulate into their main_grad
        x, idx, tw, gy = rank_inputs(make_problem(cfg, world, [200] * world, seed=50 + step), rank, dev)
        want = eager_fused_call(
            buf, w1, w2, eager_acc, x.clone().requires_grad_(), idx, tw.clone().requires_grad_(), gy
        )
        for p in (w1, w2):
            p.grad, p.grad_added_to_main_grad = None, False
        got = graphed(x.clone().requires_grad_(), idx, tw.clone().requires_grad_())
        if step == 0:  # warm-up and capture ran; nothing of theirs is in main_grad
            for p, m in zip((w1, w2), start):
                assert torch.equal(p.main_grad, m)
        got.backward(gy)
        torch.cuda.synchronize()
        assert torch.equal(got.detach(), want), step
        for name, p, m in zip(("w1", "w2"), (w1, w2), eager_acc):
            assert p.grad_added_to_main_grad, (step, name)
            assert torch.equal(p.main_grad, m), (step, name, rel_err(p.main_grad.cpu(), m.cpu()))
    assert graphed.replays == 3 and list(graphed.pairs) == [False]

    # A step's first micro-batch into a grad buffer that was not zeroed (overwrite_main_grad,
    # main_grad.py): a second captured pair writes over main_grad (NaN: never read), then the
    # next micro-batch's replay of the first pair adds again.
    for step in range(2):
        overwrite = step == 0
        if overwrite:
            for p, m in zip((w1, w2), eager_acc):
                p.main_grad.fill_(float("nan"))
                m.fill_(float("nan"))
                p.overwrite_main_grad = True
        x, idx, tw, gy = rank_inputs(make_problem(cfg, world, [200] * world, seed=60 + step), rank, dev)
        want = eager_fused_call(
            buf, w1, w2, eager_acc, x.clone().requires_grad_(), idx, tw.clone().requires_grad_(), gy, overwrite
        )
        for p in (w1, w2):
            p.grad, p.grad_added_to_main_grad = None, False
        got = graphed(x.clone().requires_grad_(), idx, tw.clone().requires_grad_())
        got.backward(gy)
        torch.cuda.synchronize()
        assert torch.equal(got.detach(), want), step
        for name, p, m in zip(("w1", "w2"), (w1, w2), eager_acc):
            assert p.grad_added_to_main_grad and not p.overwrite_main_grad, (step, name)
            assert not torch.isnan(p.main_grad).any(), (step, name)
            assert torch.equal(p.main_grad, m), (step, name, rel_err(p.main_grad.cpu(), m.cpu()))
    assert graphed.replays == 5 and sorted(graphed.pairs) == [False, True]
    for leaf in graphed.leaves[:2]:  # one placeholder gradient per weight, shared by both pairs
        for pair in graphed.pairs.values():
            assert leaf.placeholder.data_ptr() in {g.data_ptr() for g in pair.grads if g is not None}

    # A main_grad with new storage is not where the graph adds: that call runs eagerly, correctly.
    for p in (w1, w2):
        p.main_grad = p.main_grad.clone()
    x, idx, tw, gy = rank_inputs(first, rank, dev)
    want = eager_fused_call(buf, w1, w2, eager_acc, x.clone().requires_grad_(), idx, tw.clone().requires_grad_(), gy)
    graphed(x.clone().requires_grad_(), idx, tw.clone().requires_grad_()).backward(gy)
    torch.cuda.synchronize()
    assert graphed.replays == 5
    for p, m in zip((w1, w2), eager_acc):
        assert torch.equal(p.main_grad, m)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_graphed_fused_wgrad_accumulation_matches_eager(rank_pools, world, recipe):
    rank_pools(world, "nccl").run(graphed_fused_accumulation, recipe)


def graphed_mx_pair_captured_second(rank, world, mx_gemm):
    """The MX recipe's weights as its GEMMs read them (folded to e4m3 by default, or the expanded
    GEMM's shifts and scales) are derived from the prepared weights: the weight-preparation graph
    makes them, so both main_grad pairs read the current ones. The overwrite=False pair captured
    first, a weight update, then the overwrite=True pair (a step's first micro-batch): its output
    and main_grad are the eager call's on the new weights, bit for bit, replay after replay (when
    the first pair's forward derived them, the second pair read the last step's weights)."""
    with mx_gemm_path(mx_gemm):
        cfg, buf, _, w1, w2 = fused_layer(rank, world, "mxfp8_mxfp4", seed=7)
        dev = buf.device
        for p in (w1, w2):
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=dev)
        eager_acc = [torch.zeros(p.shape, dtype=torch.float32, device=dev) for p in (w1, w2)]
        graphed = GraphedMegaMoE(buf, w1, w2, backend="triton", fuse_wgrad_accumulation=True)
        # (overwrite, update the weights first): the False pair captured first; the True pair
        # captured after an update, then replayed after another, then the False pair again
        for step, (overwrite, update) in enumerate([(False, False), (True, True), (True, True), (False, True)]):
            if update:  # an optimizer step: a new weight version for the next replay
                with torch.no_grad():
                    for p in (w1, w2):
                        p.add_(torch.randn_like(p) * 0.05 * p.float().std().to(p.dtype))
            x, idx, tw, gy = rank_inputs(make_problem(cfg, world, [200] * world, seed=70 + step), rank, dev)
            want = eager_fused_call(
                buf, w1, w2, eager_acc, x.clone().requires_grad_(), idx, tw.clone().requires_grad_(), gy, overwrite
            )
            for p in (w1, w2):
                p.grad, p.grad_added_to_main_grad, p.overwrite_main_grad = None, False, overwrite
            got = graphed(x.clone().requires_grad_(), idx, tw.clone().requires_grad_())
            got.backward(gy)
            torch.cuda.synchronize()
            assert torch.equal(got.detach(), want), (step, rel_err(got.detach().float().cpu(), want.float().cpu()))
            for name, p, m in zip(("w1", "w2"), (w1, w2), eager_acc):
                assert torch.equal(p.main_grad, m), (step, name, rel_err(p.main_grad.cpu(), m.cpu()))
        assert sorted(graphed.pairs) == [False, True] and graphed.replays == 4 and graphed.weight_preparations == 4


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mx_gemm", ["folded", "expanded"])
def test_graphed_mx_pair_captured_second_reads_updated_weights(rank_pools, world, mx_gemm):
    rank_pools(world, "nccl").run(graphed_mx_pair_captured_second, mx_gemm)


def graphs_refuse_the_reference(rank, world):
    """A call that resolves to the reference executor cannot be captured: GraphedMegaMoE says so
    when built (naming the executor), before any call."""
    cfg = MegaMoEConfig(**dict(TRITON_BASE, recipe="bf16"))
    buf = get_symm_buffer(None, cfg, timeout_s=20)
    w1 = torch.randn(
        cfg.num_experts // world, 2 * cfg.intermediate, cfg.hidden, device=buf.device, dtype=torch.bfloat16
    )
    w2 = torch.randn(cfg.num_experts // world, cfg.hidden, cfg.intermediate, device=buf.device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="need the GPU executor; backend 'reference' runs 'reference'"):
        GraphedMegaMoE(buf, w1, w2, backend="reference")
    GraphedMegaMoE(buf, w1, w2, backend="auto")  # the GPU executor: accepted


def test_graphs_refuse_the_reference_executor(rank_pools):
    rank_pools(1, "nccl").run(graphs_refuse_the_reference)
