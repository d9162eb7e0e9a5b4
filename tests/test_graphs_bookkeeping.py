"""GraphedMegaMoE's bookkeeping on CPU, CUDA graphs faked (capture runs the code once, replay
does nothing): a first capture whose warm-up call raises (e.g. MegaMoEInputError: too many
tokens, which eager calls recover from) must leave no half-made static inputs behind, since it
made them before its warm-up calls and recorded the signature (and the prep graph) only at the end:
every later call then took the second pair's path (a RuntimeError copying into statics of the
failed call's shape, or no prep graph and no signature check). And `serves`: whether a graphed
call still stands for the layer's arguments (same buffer, fusion, weights and their storage)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from megamoe_train import graphs

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
