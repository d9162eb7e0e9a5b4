"""Deferred verdicts (executors that keep the host free, as the GPU executor does), on real CPU
processes: call n's bad input is raised at the start of call n + VERDICT_LAG on every rank, at the
same call whenever each rank's status copy reached its host; callers that catch it go on without
a barrier timeout; no verdict is lost. A reference executor that defers its verdicts stands in for
the GPU executor (tests/test_gpu_triton.py, test_triton_bad_ids, runs the CUDA-event path)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from dense_moe import dense_moe
from test_mega_moe_dist import BASE, make_problem, rel_err

from megamoe_train import (
    MegaMoEConfig,
    MegaMoEInputError,
    get_symm_buffer,
    mega_moe,
    protocol,
    raise_pending_verdicts,
)
from megamoe_train.backends.reference import ReferenceExecutor
from megamoe_train.call_state import VERDICT_LAG, BufferCallState, PendingVerdict
from megamoe_train.faults import STATUS_BAD, STATUS_OK

# Short: a rank left waiting in a barrier fails the test (MegaMoEPeerError) instead of hanging it.
TIMEOUT_S = 5
# Not BASE: a buffer of its own (destroyed at the end), not one cached by other tests' ranks.
CONFIG = dict(BASE, num_max_tokens_per_rank=24)


class DeferringReferenceExecutor(ReferenceExecutor):
    """The reference executor with the GPU executor's verdicts: expert ids range-checked only by
    store_routing (no host check before), and verdicts not read on the host in the call."""

    reads_device_on_host = False
    checks_ids_on_device = True


class LateCopy:
    """A status copy that has landed only once waited for (a device far behind its host), as a
    CUDA event reports it."""

    def __init__(self):
        self.landed = False

    def query(self) -> bool:
        return self.landed

    def synchronize(self):
        self.landed = True


@contextlib.contextmanager
def deferring(buf, late_copies: bool = False):
    """mega_moe runs DeferringReferenceExecutor in this rank process; with late_copies each of
    buf's deferred status copies lands only when waited for."""
    from megamoe_train import autograd

    executor = DeferringReferenceExecutor()
    resolve, capturing = autograd.resolve_backend, torch.cuda.is_current_stream_capturing
    autograd.resolve_backend = lambda name, buffer: executor
    if late_copies:
        torch.cuda.is_current_stream_capturing = lambda: False  # due() asks it for event copies; no CUDA here
        pending = buf.call_state.pending
        buf.call_state.defer = lambda status, call: pending.append(PendingVerdict(LateCopy(), status, call))
    try:
        yield
    finally:
        autograd.resolve_backend, torch.cuda.is_current_stream_capturing = resolve, capturing
        buf.call_state.__dict__.pop("defer", None)


def _inputs(rank, world, seed=7):
    cfg = MegaMoEConfig(**CONFIG)
    prob = make_problem(cfg, world, [19] * world, seed=seed)
    E_l = cfg.num_experts // world
    mine = slice(rank * E_l, (rank + 1) * E_l)
    return cfg, prob, prob["w1"][mine], prob["w2"][mine]


def _rank_case(rank, world, seed):
    """This rank's share of a fresh problem: (cfg, w1, w2, buffer, x, idx, tw, the dense output)."""
    cfg, prob, w1, w2 = _inputs(rank, world, seed)
    buf = get_symm_buffer(None, cfg, timeout_s=TIMEOUT_S)
    x, idx, tw = prob["x"][rank], prob["idx"][rank], prob["w"][rank]
    return cfg, w1, w2, buf, x, idx, tw, dense_moe(x, idx, tw, prob["w1"], prob["w2"], cfg)


def _bad_ids(idx, cfg, seed):
    """idx with one slot, at a random place, holding an expert id past the last."""
    g = torch.Generator().manual_seed(seed)
    bad = idx.clone()
    bad[torch.randint(idx.shape[0], (), generator=g), torch.randint(idx.shape[1], (), generator=g)] = cfg.num_experts
    return bad


def _caught(buf, calls):
    """calls() (one or more protocol calls) as a caller that catches bad input and goes on: None,
    or (the index of the call that raised, the message). A deferred verdict is raised at the
    start of a call, which then takes no epoch: the next call has that index."""
    try:
        calls()
    except MegaMoEInputError as err:
        return buf.call_state.call_count + 1, str(err)
    return None


def _forward_calls(buf, count, x, idx, tw, w1, w2, y_ref):
    """`count` good forward calls, each caught; the raises (call, message), outputs checked."""
    raised = []

    def good():
        assert rel_err(mega_moe(x, idx, tw, w1, w2, buf), y_ref) < 1e-5

    for _ in range(count):
        if (r := _caught(buf, good)) is not None:
            raised.append(r)
    return raised


# ----------------------------------------------------------------------------- one bad call


def bad_ids_on_rank_1(rank, world, late_rank):
    cfg, w1, w2, buf, x, idx, tw, y_ref = _rank_case(rank, world, seed=7)
    with deferring(buf, late_copies=rank == late_rank):
        assert not _forward_calls(buf, 1, x, idx, tw, w1, w2, y_ref)
        n = buf.call_state.call_count + 1
        y = mega_moe(x, _bad_ids(idx, cfg, seed=n) if rank == 1 else idx, tw, w1, w2, buf)  # call n: no raise
        assert not y.abs().max() > 0, "a rejected call moves no rows (and there are no shared experts)"
        raised = _forward_calls(buf, VERDICT_LAG + 2, x, idx, tw, w1, w2, y_ref)
    buf.destroy()
    assert [at for at, _ in raised] == [n + VERDICT_LAG], raised
    text = raised[0][1]
    assert f"call {n})" in text and "rank(s) [1] rejected their input" in text, text
    assert ("this rank's input was rejected" in text) == (rank == 1), text
    return raised


@pytest.mark.parametrize("late_rank", [None, 0, 1], ids=["copies_at_once", "rank_0_late", "rank_1_late"])
def test_bad_ids_raise_at_the_same_later_call_on_every_rank(rank_pools, late_rank):
    """Whichever rank's status copy lands late, both raise at call n + VERDICT_LAG (raising once
    the copy had landed, the ranks would raise at different calls), and go on with good calls."""
    raised = rank_pools(2).run(bad_ids_on_rank_1, late_rank)
    assert raised[0][0][0] == raised[1][0][0]


# ----------------------------------------------------------------------------- two bad calls


def two_bad_calls(rank, world):
    """Rank 1's ids bad at call n, rank 0's at n + 1: each verdict raised at its own call."""
    cfg, w1, w2, buf, x, idx, tw, y_ref = _rank_case(rank, world, seed=8)
    with deferring(buf):
        n = buf.call_state.call_count + 1
        for bad_rank in (1, 0):  # calls n, n + 1
            mega_moe(x, _bad_ids(idx, cfg, seed=bad_rank) if rank == bad_rank else idx, tw, w1, w2, buf)
        raised = _forward_calls(buf, VERDICT_LAG + 4, x, idx, tw, w1, w2, y_ref)
        assert not [v for v in buf.call_state.pending if (v.status[:, 0] != STATUS_OK).any()]
    buf.destroy()
    assert [at for at, _ in raised] == [n + VERDICT_LAG, n + 1 + VERDICT_LAG], raised
    for (_, text), call, bad_rank in zip(raised, (n, n + 1), (1, 0)):
        assert f"call {call})" in text and f"rank(s) [{bad_rank}] rejected" in text, text
    return raised


def test_two_bad_calls_are_each_raised_none_lost(rank_pools):
    raised = rank_pools(2).run(two_bad_calls)
    assert [at for at, _ in raised[0]] == [at for at, _ in raised[1]]


# ----------------------------------------------------------------------------- a problem the host sees


def too_many_tokens_on_rank_1(rank, world):
    """A problem this rank's host sees (too many tokens) is raised by that rank in its call n (it
    has no output to return); its peers learn of it from the status words, and every rank, the
    bad one included, raises call n's verdict at n + VERDICT_LAG."""
    cfg, w1, w2, buf, x, idx, tw, y_ref = _rank_case(rank, world, seed=9)
    with deferring(buf):
        n = buf.call_state.call_count + 1
        if rank == 1:
            big = _inputs(rank, world, seed=10)[1]  # fresh inputs, with more rows than the buffer holds
            args = (torch.cat([big["x"][0], x]), torch.cat([big["idx"][0], idx]), torch.cat([big["w"][0], tw]))
            assert args[0].shape[0] > cfg.num_max_tokens_per_rank
            with pytest.raises(MegaMoEInputError, match="num_max_tokens_per_rank"):
                mega_moe(*args, w1, w2, buf)
        else:
            assert not mega_moe(x, idx, tw, w1, w2, buf).abs().max() > 0  # rows moved nowhere
        assert buf.call_state.call_count == n  # both ranks finished call n
        raised = _forward_calls(buf, VERDICT_LAG + 2, x, idx, tw, w1, w2, y_ref)
    buf.destroy()
    assert [at for at, _ in raised] == [n + VERDICT_LAG], raised
    assert f"call {n})" in raised[0][1] and "rank(s) [1] rejected" in raised[0][1], raised
    return raised[0][0]


def test_host_seen_problem_raised_at_once_by_its_rank_and_later_by_every_rank(rank_pools):
    assert len(set(rank_pools(2).run(too_many_tokens_on_rank_1))) == 1


# ----------------------------------------------------------------------------- raised in a backward


def training_steps(rank, world, late_rank):
    """Steps of two layers sharing the buffer (forward A, forward B, backward B, backward A: four
    calls); rank 1's ids for A are bad in step 1. The verdict is raised at the same call on both
    ranks (with VERDICT_LAG 4, step 2's forward A); the caller drops that step and goes on."""
    cfg, prob, w1, w2 = _inputs(rank, world, seed=11)
    idx_b, tw_b = (make_problem(cfg, world, [19] * world, seed=12)[k][rank] for k in ("idx", "w"))
    buf = get_symm_buffer(None, cfg, timeout_s=TIMEOUT_S)
    x, idx, tw, gy = prob["x"][rank], prob["idx"][rank], prob["w"][rank], prob["gy"][rank]
    x_ref = x.clone().requires_grad_()
    w1_all, w2_all = prob["w1"], prob["w2"]
    dense_b = dense_moe(dense_moe(x_ref, idx, tw, w1_all, w2_all, cfg), idx_b, tw_b, w1_all, w2_all, cfg)
    dense_b.backward(gy)
    raised, n = [], None
    with deferring(buf, late_copies=rank == late_rank):
        for step in range(4):
            x_leaf = x.clone().requires_grad_()
            ids = idx
            if step == 1:
                n = buf.call_state.call_count + 1
                ids = _bad_ids(idx, cfg, seed=n) if rank == 1 else idx

            def one_step():
                h = mega_moe(x_leaf, ids, tw, w1, w2, buf, layer_id=1)
                y = mega_moe(h, idx_b, tw_b, w1, w2, buf, layer_id=2)
                y.backward(gy)
                if step != 1:
                    assert rel_err(y.detach(), dense_b.detach()) < 1e-5
                    assert rel_err(x_leaf.grad, x_ref.grad) < 1e-5

            if (r := _caught(buf, one_step)) is not None:
                raised.append((step, *r))
    buf.destroy()
    assert [(step, at) for step, at, _ in raised] == [(1 + VERDICT_LAG // 4, n + VERDICT_LAG)], raised
    assert f"call {n})" in raised[0][2] and "rank(s) [1] rejected" in raised[0][2], raised
    return raised[0][1]


@pytest.mark.parametrize("late_rank", [None, 1], ids=["copies_at_once", "rank_1_late"])
def test_verdict_raised_in_a_backward_and_training_goes_on(rank_pools, late_rank):
    assert len(set(rank_pools(2).run(training_steps, late_rank))) == 1


# ----------------------------------------------------------------------------- the end of a run


def bad_ids_in_the_last_call(rank, world, late_rank):
    """Rank 1's ids bad in the run's last call: no later call raises it; raise_pending_verdicts
    does, on both ranks, once, whether or not the copies have landed."""
    cfg, w1, w2, buf, x, idx, tw, y_ref = _rank_case(rank, world, seed=13)
    with deferring(buf, late_copies=rank == late_rank):
        assert not _forward_calls(buf, 2, x, idx, tw, w1, w2, y_ref)
        n = buf.call_state.call_count + 1
        mega_moe(x, _bad_ids(idx, cfg, seed=n) if rank == 1 else idx, tw, w1, w2, buf)  # call n: the last
        with pytest.raises(MegaMoEInputError, match=rf"call {n}\).*rank\(s\) \[1\] rejected"):
            raise_pending_verdicts()  # every live buffer
        raise_pending_verdicts(buf)  # raised once: nothing left
        assert buf.call_state.pending == [] and buf.call_state.call_count == n
    buf.destroy()
    return n


@pytest.mark.parametrize("late_rank", [None, 1], ids=["copies_at_once", "rank_1_late"])
def test_raise_pending_verdicts_at_the_end_of_a_run(rank_pools, late_rank):
    assert len(set(rank_pools(2).run(bad_ids_in_the_last_call, late_rank))) == 1


# ----------------------------------------------------------------------------- the bookkeeping alone


def _words(call, bad_rank=None):
    status = torch.tensor([[STATUS_OK, call, 1, 2 * call]] * 2, dtype=torch.int32)
    if bad_rank is not None:
        status[bad_rank, 0] = STATUS_BAD
    return status


def test_due_waits_for_late_copies_and_keeps_newer_ones(monkeypatch):
    """At call c: the verdicts of calls <= c - VERDICT_LAG, each waited for; newer ones stay
    pending though their copy has landed."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    state = BufferCallState(call_count=10)
    copies = {call: LateCopy() for call in range(11 - VERDICT_LAG, 11)}
    for call, copy in copies.items():
        copy.landed = call != 11 - VERDICT_LAG  # the oldest one has not landed yet
        state.pending.append(PendingVerdict(copy, _words(call), call))
    due = state.due(11 - VERDICT_LAG)  # at the start of call 11
    assert [v.call for v in due] == [11 - VERDICT_LAG] and copies[11 - VERDICT_LAG].landed
    assert [v.call for v in state.pending] == list(range(12 - VERDICT_LAG, 11))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert state.due(20 - VERDICT_LAG) == [] and len(state.pending) == VERDICT_LAG - 1  # no host wait inside a capture


def test_due_verdicts_after_the_first_bad_one_are_not_lost():
    """Two bad verdicts due at once (e.g. after a capture): the first raises; the second stays
    pending and is raised by the next call, each once. CPU verdicts (done None) need no CUDA."""
    from types import SimpleNamespace

    state = BufferCallState(call_count=4 + VERDICT_LAG)
    state.defer(_words(3, bad_rank=1), 3)
    state.defer(_words(4, bad_rank=0), 4)
    assert [v.done for v in state.pending] == [None, None]
    buf = SimpleNamespace(call_state=state, rank=0)
    with pytest.raises(MegaMoEInputError, match=r"call 3\).*rank\(s\) \[1\]"):
        protocol._raise_deferred(buf)
    with pytest.raises(MegaMoEInputError, match=r"call 4\).*rank\(s\) \[0\]"):
        protocol._raise_deferred(buf)
    protocol._raise_deferred(buf)
    assert state.pending == []
