"""GraphedMegaMoE's bookkeeping on CPU, CUDA graphs faked (capture runs the code once, replay
does nothing): a first capture whose warm-up call raises (e.g. MegaMoEInputError: too many
tokens, which eager calls recover from) must leave no half-made static inputs behind, since it
made them before its warm-up calls and recorded the signature (and the prep graph) only at the end:
every later call then took the second pair's path (a RuntimeError copying into statics of the
failed call's shape, or no prep graph and no signature check). And `serves`: whether a graphed
call still stands for the layer's arguments (same buffer, fusion, weights and their storage).
And where the operands derived from the quantized weights (the MX recipe's folded copies) are
made: in the weight-preparation graph, never inside a captured forward or backward."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from megamoe_train import graphs
from megamoe_train.backends import triton_backend
from megamoe_train.config import MegaMoEConfig
from megamoe_train.weights import ExpertWeights, clear_weight_cache, transform_weights

H, K, MAX_TOKENS = 8, 2, 8


def fake_mega_moe(
    x,
    topk_idx,
    topk_weights,
    w1,
    w2,
    buffer,
    *,
    shared_w1=None,
    shared_w2=None,
    recv_stats=None,
    backend="auto",
    layer_id=0,
    fuse_wgrad_accumulation=False,
    prepared_weights=None,
):
    if x.shape[0] > MAX_TOKENS:  # as check_inputs: the call raises (on every rank)
        raise ValueError(f"x: {x.shape[0]} tokens exceed num_max_tokens_per_rank={MAX_TOKENS}")
    return x * topk_weights.sum(1, keepdim=True) * w1.sum() + w2.sum()


@pytest.fixture
def fake_cuda(monkeypatch):
    stream = SimpleNamespace(wait_stream=lambda other: None)

    @contextlib.contextmanager
    def graph(g, pool=None):
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: SimpleNamespace(replay=lambda: None))
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(graphs, "executor_choice", lambda backend, config, device: ("triton", None))
    monkeypatch.setattr(graphs, "mega_moe", fake_mega_moe)


def make_graphed():
    buffer = SimpleNamespace(
        device=torch.device("cuda"),
        num_local_experts=2,
        config=SimpleNamespace(dtype=torch.float32, precision=SimpleNamespace(weight_format="native")),
    )
    w1 = torch.randn(2, 4, H, requires_grad=True)
    w2 = torch.randn(2, H, 2, requires_grad=True)
    return graphs.GraphedMegaMoE(buffer, w1, w2, backend="triton"), w1, w2


def inputs(T, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, requires_grad=True)
    return x, torch.zeros(T, K, dtype=torch.int64), torch.rand(T, K, generator=g).requires_grad_()


def test_call_after_a_failed_first_capture_other_shape(fake_cuda):
    graphed, w1, w2 = make_graphed()
    with pytest.raises(ValueError, match="tokens exceed"):
        graphed(*inputs(MAX_TOKENS + 1, 0))
    x, idx, tw = inputs(4, 1)
    y = graphed(x, idx, tw)  # a valid call: captured now (was: RuntimeError, static x had 9 rows)
    torch.testing.assert_close(y, fake_mega_moe(x, idx, tw, w1, w2, None))


def test_call_after_a_failed_first_capture_same_shape(fake_cuda, monkeypatch):
    graphed, w1, w2 = make_graphed()
    fails = iter([True])

    def once(*args, **kwargs):  # the first warm-up call raises, every later call runs
        if next(fails, False):
            raise ValueError("topk_idx: expert id 99 is outside [0, 4)")
        return fake_mega_moe(*args, **kwargs)

    monkeypatch.setattr(graphs, "mega_moe", once)
    with pytest.raises(ValueError, match="outside"):
        graphed(*inputs(4, 0))
    x, idx, tw = inputs(4, 1)
    y = graphed(x, idx, tw)  # (was: AttributeError, no prep_graph)
    torch.testing.assert_close(y, fake_mega_moe(x, idx, tw, w1, w2, None))
    assert graphed._captured_signature is not None  # later calls of another shape run eagerly


def test_serves_only_the_weights_and_storage_it_captured(fake_cuda):
    """A graphed call stands for mega_moe over the buffer, weights and fusion it was built with;
    weights moved to other storage (DDP's wrap puts parameters into its buffer) or another fusion
    setting need a new one (megatron_patch.moe_layer rebuilds it), or its leaves would alias the
    old storage."""
    graphed, w1, w2 = make_graphed()
    buffer = graphed.buffer
    assert graphed.serves(buffer, w1, w2)
    assert not graphed.serves(buffer, w1, w2, fuse_wgrad_accumulation=True)
    assert not graphed.serves(SimpleNamespace(**vars(buffer)), w1, w2)
    assert not graphed.serves(buffer, w1.detach().clone().requires_grad_(), w2)
    w1.data = w1.data.clone()  # what DDP's wrap does to a parameter
    assert not graphed.serves(buffer, w1, w2)


def test_recv_stats_checked_on_replay(fake_cuda):
    """A replay adds its rows per expert into recv_stats as an eager call does, and refuses one of
    another dtype or shape, as an eager call's input check would (after the replay: the peers are
    in the same collective call)."""
    graphed, w1, w2 = make_graphed()
    stats = torch.zeros(2, dtype=torch.int64)
    graphed(*inputs(4, 0), recv_stats=stats)  # captured
    graphed(*inputs(4, 1), recv_stats=stats)  # replayed
    for bad in (torch.zeros(2), torch.zeros(3, dtype=torch.int64)):
        with pytest.raises(ValueError, match="recv_stats"):
            graphed(*inputs(4, 2), recv_stats=bad)


# ----------------------------------------------------------------------------- derived operands

DERIVED = ("_mma_operands", "_mma_dgrad_operands", "_mx_gemm_operands", "_mx_dgrad_gemm_operands", "_compute_copies")
MX_E, MX_H, MX_I = 2, 128, 128  # the smallest sizes the MX operands take (multiples of 128)


def mx_config(recipe="mxfp8_mxfp4"):
    return MegaMoEConfig(
        num_experts=MX_E, hidden=MX_H, intermediate=MX_I, topk=K, num_max_tokens_per_rank=MAX_TOKENS, recipe=recipe
    )


def derived(weights: ExpertWeights) -> dict:
    return {k: weights.__dict__[k] for k in DERIVED if k in weights.__dict__}


@pytest.mark.parametrize(
    "recipe, expanded, made",
    [
        ("mxfp8_mxfp4", False, {"_mma_operands", "_mma_dgrad_operands"}),  # the folded e4m3 copies
        ("mxfp8_mxfp4", True, {"_mx_gemm_operands", "_mx_dgrad_gemm_operands"}),  # shifts and scales only
        ("fp8", False, set()),  # its GEMMs read what it stores
        ("fp8_e4m3_wgrad", False, set()),
        ("bf16", False, set()),  # compute_copies: the stored tensors themselves
    ],
)
def test_prepare_weights_makes_what_the_gpu_paths_read(monkeypatch, recipe, expanded, made):
    """The GPU executor's prepare_weights makes exactly the derived operands its forward and
    backward read on this path (MEGAMOE_MX_GEMM folded or expanded), nothing more (the folded
    copies are a byte a weight), and a second call reuses them."""
    monkeypatch.setattr(triton_backend, "_mx_expanded", lambda cfg, device: expanded and cfg.precision.mx)
    cfg = mx_config(recipe)
    g = torch.Generator().manual_seed(7)
    w1 = torch.randn(MX_E, 2 * MX_I, MX_H, generator=g, dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(MX_E, MX_H, MX_I, generator=g, dtype=torch.bfloat16) * 0.05
    executor = triton_backend.TritonExecutor()
    weights = transform_weights(w1, w2, cfg)
    try:
        executor.prepare_weights(cfg, weights)
        first = derived(weights)
        assert set(first) == made
        weights.freeze_operands()  # a remake now raises
        executor.prepare_weights(cfg, weights)
        assert derived(weights).keys() == first.keys()
        assert all(derived(weights)[k] is v for k, v in first.items())
        if made:  # the forward and the backward read those very operands
            reads = (triton_backend._forward_weight_operands, triton_backend._backward_weight_operands)
            assert {id(read(cfg, weights, w1.device)) for read in reads} == {id(v) for v in first.values()}
    finally:
        clear_weight_cache()


def reading_mega_moe(x, topk_idx, topk_weights, w1, w2, buffer, *, prepared_weights=None, **kwargs):
    """fake_mega_moe that reads the prepared weights' operands as the GPU executor's forward and
    backward do."""
    if prepared_weights is not None:
        triton_backend._forward_weight_operands(buffer.config, prepared_weights, x.device)
        triton_backend._backward_weight_operands(buffer.config, prepared_weights, x.device)
    return x * topk_weights.sum(1, keepdim=True) * w1.sum() + w2.sum()


def test_derived_operands_made_by_the_prep_graph_only(fake_cuda, monkeypatch):
    """An MX layer with fused wgrad accumulation: its pairs (overwrite=False captured first, then,
    after a weight update, overwrite=True) read the folded weights that the weight-preparation
    graph makes. Made by their first reader instead, they were made inside the first pair's
    forward capture: replays of the prep graph did not remake them, so after a weight update the
    overwrite=True pair (a step's first micro-batch) read the last step's."""
    capturing = []  # the graph being captured, innermost last

    @contextlib.contextmanager
    def graph(g, pool=None):
        capturing.append(g)
        try:
            yield
        finally:
            capturing.pop()

    made_in = []  # (weights, graph being captured) per fold of the MX weights
    fold = ExpertWeights._folded

    def recording_fold(self, *args, **kwargs):
        made_in.append((self, capturing[-1] if capturing else None))
        return fold(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: SimpleNamespace(replay=lambda: None))
    monkeypatch.setattr(graphs, "mega_moe", reading_mega_moe)
    monkeypatch.setattr(ExpertWeights, "_folded", recording_fold)
    monkeypatch.setattr(triton_backend, "_mx_expanded", lambda cfg, device: False)  # the folded default

    cfg = mx_config()
    buffer = SimpleNamespace(device=torch.device("cuda"), num_local_experts=MX_E, config=cfg)
    g = torch.Generator().manual_seed(8)
    w1 = (torch.randn(MX_E, 2 * MX_I, MX_H, generator=g) * 0.05).requires_grad_()
    w2 = (torch.randn(MX_E, MX_H, MX_I, generator=g) * 0.05).requires_grad_()
    for w in (w1, w2):
        w.main_grad = torch.zeros(w.shape)
    graphed = graphs.GraphedMegaMoE(buffer, w1, w2, backend="triton", fuse_wgrad_accumulation=True)

    def call(overwrite, seed):
        w1.overwrite_main_grad = w2.overwrite_main_grad = overwrite
        x = torch.randn(4, MX_H, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        tw = torch.rand(4, K, generator=torch.Generator().manual_seed(seed)).requires_grad_()
        graphed(x, torch.zeros(4, K, dtype=torch.int64), tw).backward(torch.ones(4, MX_H))

    call(False, 0)  # captures the overwrite=False pair and the prep graph
    with torch.no_grad():  # an optimizer step
        w1.add_(0.01)
        w2.add_(0.01)
    call(True, 1)  # captures the overwrite=True pair
    call(False, 2)
    assert sorted(graphed.pairs) == [False, True] and graphed.weight_preparations == 2
    prepared = [graph for weights, graph in made_in if weights is graphed._prepared]
    assert prepared == [graphed.prep_graph, graphed.prep_graph]  # w1 and w2, then w1_t and w2_t
    assert set(derived(graphed._prepared)) == {"_mma_operands", "_mma_dgrad_operands"}
