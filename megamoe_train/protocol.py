"""The MegaMoE protocol, written once; an executor supplies the row movement and expert math
(backends/executor.py: what each step asks of it).

Forward, on every rank r of R (all ranks call together; see docs/protocol.md):
  1. publish: x (stored per recipe), topk ids (out-of-range ids masked to -1) and topk
     weights into r's buffer;
  2. status exchange: r's verdict on its input and the call's name (epoch, layer id, phase)
     into every peer's status word; barrier. A bad input anywhere, or ranks in different calls,
     means no rows move in this call, on every rank;
  3. plan: r reads every source's ids and builds its pool plan (plan.py);
  4. pull: each (source, token) with slots on r's experts is pulled once (with its scales and
     topk weights) and written into the pool row of each of those slots;
  5. expert MLP: L1, clamp + SwiGLU + topk weight, L2 (the executor's);
  6. push: per received (source, token), the outputs of its slots here summed in fp32 in
     ascending slot order and pushed home as one partial row; barrier;
  7. reduce: home sums the partials of the owners in rank order 0..R-1, then its shared
     experts' row, in fp32: bitwise deterministic.
Backward mirrors it with the saved plan: publish dY, status exchange (its own epoch, phase
"backward of forward call n"), barrier, pull dY once per (source, token),
expert backward, push one dX partial per (owner, token) and d(topk weight) per slot straight
into the home's [T, K] region, barrier, reduce.

Verdicts: executors that may read the device on the host (the oracle) raise on every rank
right after the exchange. The fast GPU executor keeps the host free (CUDA-graph capturable): a
bad call n moves no rows, and every rank raises its verdict at the start of call
n + VERDICT_LAG (call_state.py; forward and backward calls both count), a point all ranks share
whenever the status reached each host; or at once with MEGAMOE_SYNC_CHECKS=1. A rank whose own
input the host rejected (`problem`: it has no output to return) raises in call n itself, after
the call's barriers, and at n + VERDICT_LAG with its peers.

Failures: barriers carry the call and step (tag = epoch * 4 + step). A rank that raises anywhere
else than at those agreed points (an unexpected host exception, a peer timeout) marks the buffer
failed: its peers stop at their next barrier (on CPU they raise; on CUDA their device barrier
records the rank and call and traps, and the host raises that record at the next use) and every
later call on the buffer raises. A captured call (CUDA graph) also compares the status words on
the device, since its replays run no host code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .backends.executor import Executor, ExpertState
from .call_state import VERDICT_LAG
from .errors import MegaMoECallMismatchError, MegaMoEInputError
from .faults import STATUS_BAD, STATUS_OK, describe_word
from .plan import Plan
from .symm_buffer import NUM_WAIT_SITES, SymmBuffer, live_symm_buffers
from .weights import ExpertWeights

_WORD_RANGE = 2**31  # status words are int32
BARRIER_EXCHANGED, BARRIER_PUSHED = 1, 2  # the two barrier steps of a call (tag = epoch * 4 + step)
# SymmBuffer.peer_wait_ns_by_site's counters: a barrier waits for peers that are late arriving
# there, i.e. still in the work before it (before the first barrier: the model's work between
# MoE calls and the publish; before the push barrier: the pull, the expert GEMMs and the push).
WAIT_SITES = ("forward exchange", "forward push", "backward exchange", "backward push")
assert len(WAIT_SITES) == NUM_WAIT_SITES, "one SymmBuffer wait counter per site"


def _wait_site(backward: bool, step: int) -> int:
    return 2 * backward + (step == BARRIER_PUSHED)


@dataclass
class SavedForward:
    """What backward needs from forward (nothing that lives in the buffer, which later calls reuse)."""

    num_tokens: int
    call: int  # the forward's epoch: the backward's status word names it
    layer_id: int
    own_mask: torch.Tensor  # bool [T, K]: slots of this rank's tokens that carried rows
    partial_mask: torch.Tensor  # bool [T, R]: owners that pushed a partial row per token
    plan: Plan
    experts: ExpertState  # the executor's saved expert-MLP state (its own type)
    x: torch.Tensor | None  # this rank's input, kept for the shared experts
    shared_pre_act: torch.Tensor | None


# ----------------------------------------------------------------------------- status


def _sync_checks(executor: Executor) -> bool:
    if executor.reads_device_on_host:
        return True
    return os.environ.get("MEGAMOE_SYNC_CHECKS", "0") not in ("", "0")


def _phase(call: int, forward_call: int | None) -> int:
    """Status word 3: 2n for forward call n, 2n + 1 for the backward of forward call n."""
    return 2 * call if forward_call is None else 2 * forward_call + 1


def _describe_word(word) -> str:
    return describe_word(*(int(v) for v in word[1:4]))


def _raise_on_bad_status(status: torch.Tensor, rank: int, call: int, deferred: bool):
    bad = [r for r in range(status.shape[0]) if int(status[r, 0]) != STATUS_OK]
    if bad:
        what = ""
        if rank in bad:
            what = (
                "this rank's input was rejected (an expert id outside [0, num_experts) if nothing else was reported; "
                "use -1 to mask a slot); "
            )
        effect = (
            "that call moved no rows and its output holds only the shared experts"
            if deferred
            else "no rows were exchanged"
        )
        raise MegaMoEInputError(
            f"mega_moe (rank {rank}, call {call}): {what}rank(s) {bad} rejected their input; {effect}"
        )
    _raise_on_mismatch(status, rank, deferred)


def _raise_on_mismatch(status: torch.Tensor, rank: int, deferred: bool):
    names = status[:, 1:4].tolist()
    if any(n != names[rank] for n in names):
        ranks = "; ".join(f"rank {r}: {_describe_word(status[r])}" for r in range(status.shape[0]))
        effect = "that call moved no rows" if deferred else "no rows were exchanged"
        raise MegaMoECallMismatchError(
            f"mega_moe (rank {rank}): the ranks are at different calls of this buffer ({ranks}); {effect}. Every "
            "rank must call the layers sharing a buffer in the same order, forward and backward alike"
        )


def _raise_deferred(buf: SymmBuffer, up_to: int | None = None):
    """At the start of every call, before it takes its epoch c: raise the deferred verdicts of
    calls <= c - VERDICT_LAG (or <= up_to), oldest first, the first bad one only; the rest stay
    pending for the next call (which again starts as c: a call that raises here takes no epoch).
    Every rank runs the same calls, so every rank raises the same verdict at the same point."""
    due = buf.call_state.due(buf.call_state.call_count + 1 - VERDICT_LAG if up_to is None else up_to)
    for i, pending in enumerate(due):
        try:
            _raise_on_bad_status(pending.status, buf.rank, pending.call, deferred=True)
        except BaseException:
            buf.call_state.pending[:0] = due[i + 1 :]  # later verdicts are raised at the next call, not lost
            raise


def raise_pending_verdicts(buffer: SymmBuffer | None = None) -> None:
    """Raise now the deferred verdicts of every call made so far on `buffer` (default: every live
    buffer, in the order they were created), waiting for their status copies: the first bad one
    raises MegaMoEInputError or MegaMoECallMismatchError, and a further call raises the next one.
    Calls raise a verdict VERDICT_LAG calls after its own, so those of a run's last calls would
    otherwise never be raised. Call it on every rank at the same point in the program (e.g. after
    the last training step), as any call of the layer; not while capturing a CUDA graph."""
    for buf in [buffer] if buffer is not None else live_symm_buffers():
        _raise_deferred(buf, up_to=buf.call_state.call_count)


def _publish(executor: Executor, buf: SymmBuffer, x, topk_idx, topk_weights, problem) -> torch.Tensor:
    """Write this rank's inputs into its buffer; returns its verdict (int32 scalar, on the device)."""
    cfg = buf.config
    mine = buf.regions()
    if problem is not None:
        mine.topk_idx.fill_(-1)
        return torch.full((), STATUS_BAD, dtype=torch.int32, device=buf.device)
    n = x.shape[0]
    executor.store_inputs(cfg, x, mine.x[:n], mine.x_scales[:n] if cfg.precision.quantized else None)
    return executor.store_routing(cfg, topk_idx, topk_weights, mine.topk_idx, mine.topk_weights)


def _exchange_status(buf: SymmBuffer, verdict: torch.Tensor, layer_id: int, forward_call: int | None = None):
    """Verdict and the call's name (epoch, layer id, phase) into every peer's status word, in
    the call's first barrier (SymmBuffer.exchange_status). Returns (status [R, 4] of this call,
    the call epoch, whether every rank accepted its input and is in this very call: a bool
    device scalar)."""
    call = buf.call_state.next_call()
    # A captured call compares the words on the device (and traps on a mismatch or a rejected
    # input): its replays run no host code, so no later call could raise what they route.
    captured = buf.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    # The words are int32: epoch and phase wrap (phase 2n passes 2^31 at call 2^30), alike on every rank.
    name = (call % _WORD_RANGE, layer_id, _phase(call, forward_call) % _WORD_RANGE)
    status, all_ok = buf.exchange_status(
        call * 4 + BARRIER_EXCHANGED,
        call % 2,
        verdict,
        name,
        compare_on_device=captured,
        wait_site=_wait_site(forward_call is not None, BARRIER_EXCHANGED),
    )
    return status, call, all_ok


def _guarded(step):
    """Run a protocol step; an exception other than those every rank raises at the same point
    marks the buffer failed, so peers raise at their next barrier instead of pairing it wrongly."""

    def run(executor: Executor, buf: SymmBuffer, *args, **kwargs):
        buf.check_usable()
        if buf.device.type == "cuda":
            buf.call_state.follow_previous_call(torch.cuda.current_stream(buf.device))
        call = buf.call_state.call_count + 1  # the epoch this step takes (next_call), failing before it or after
        try:
            return step(executor, buf, *args, **kwargs)
        except (MegaMoEInputError, MegaMoECallMismatchError):
            raise
        except BaseException as err:
            buf.raise_device_fault(err)  # the CUDA error of a barrier's trap: say which rank and call
            buf.fail(f"rank {buf.rank} failed in call {call} ({step.__name__}): {type(err).__name__}: {err}", call * 4)
            raise

    run.__name__ = step.__name__
    run.__doc__ = step.__doc__
    return run


# ----------------------------------------------------------------------------- shared experts


def _run_shared(buf: SymmBuffer, fn, *tensors):
    """fn(*tensors) -> tuple; on CUDA on the buffer's side stream, overlapping the routed path
    until _join_shared (its results are then safe to use and free on the current stream)."""
    if buf.device.type != "cuda":
        return fn(*tensors)
    main, side = torch.cuda.current_stream(), buf.call_state.stream(buf.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = fn(*tensors)
    if not torch.cuda.is_current_stream_capturing():  # a graph's pool is not shared across replays
        for t in tensors:
            t.record_stream(side)
        for t in out:
            if t is not None:
                t.record_stream(main)
    return out


def _join_shared(buf: SymmBuffer):
    if buf.device.type == "cuda" and buf.call_state.side_stream is not None:
        torch.cuda.current_stream().wait_stream(buf.call_state.side_stream)


# ----------------------------------------------------------------------------- forward / backward


@_guarded
def forward(
    executor: Executor,
    buf: SymmBuffer,
    x,
    topk_idx,
    topk_weights,
    weights: ExpertWeights,
    shared,
    recv_stats,
    problem,
    layer_id: int = 0,
):
    """One forward call. Returns (y [T, H] in config.dtype, SavedForward). With `problem` (this
    rank's input is bad, x etc. are None) it takes part in the exchange and raises. layer_id
    names the caller in the status word (layers sharing a buffer must differ). Starts by raising
    the deferred verdicts now due (_raise_deferred)."""
    cfg = buf.config
    R, me, E_l = buf.world_size, buf.rank, buf.num_local_experts
    T = x.shape[0] if problem is None else 0
    sync = _sync_checks(executor)
    _raise_deferred(buf)  # also with sync checks: verdicts deferred before MEGAMOE_SYNC_CHECKS was set

    # 1-2. Publish, exchange verdicts and call names (the first barrier).
    status, call, all_ok = _exchange_status(buf, _publish(executor, buf, x, topk_idx, topk_weights, problem), layer_id)
    if sync:  # every rank reads the verdicts now and raises at the same point
        host_status = status.cpu()
        if problem is not None:
            raise MegaMoEInputError(f"mega_moe (rank {me}): {problem}")
        _raise_on_bad_status(host_status, me, call, deferred=False)
    elif problem is not None:  # peers route nothing this call; finish its barriers, then raise
        buf.barrier(call * 4 + BARRIER_PUSHED, wait_site=_wait_site(False, BARRIER_PUSHED))
        # Peers learn of it only at call + VERDICT_LAG: this rank raises it there too, so that
        # every rank raises at that call (a rank that did not would go on into its barrier alone).
        buf.call_state.defer(status, call)
        raise MegaMoEInputError(f"mega_moe (rank {me}): {problem}")

    # Shared experts fill this rank's own partial row (index R), which no peer writes.
    shared_pre_act = None
    if shared is not None:

        def shared_row(x_, w1_, w2_):
            out, h = executor.shared_forward(x_, w1_, w2_, cfg.activation_clamp)
            buf.regions().partials[R, :T].copy_(out)
            return (h,)

        (shared_pre_act,) = _run_shared(buf, shared_row, x, shared[0], shared[1])

    # 3. Plan from every source's ids (a rejected call routes nothing).
    plan = executor.build_plan(buf, all_ok, executor.row_align(cfg))
    if recv_stats is not None:
        recv_stats += plan.expert_counts.to(recv_stats.device)

    # 4-6. Pull once per (source, token), expert MLP, push one partial per (token, owner).
    pool = executor.pull_inputs(buf, plan)
    out_rows, experts = executor.experts_forward(cfg, weights, plan, pool)
    executor.push_partials(buf, plan, out_rows)

    # 7. Barrier (shared experts joined first), then the fixed-order reduction.
    if shared is not None:
        _join_shared(buf)
    buf.barrier(call * 4 + BARRIER_PUSHED, wait_site=_wait_site(False, BARRIER_PUSHED))
    own_mask, partial_mask = executor.routing_masks(buf.regions().topk_idx[:T], all_ok, R, E_l)
    y = executor.reduce_partials(buf, partial_mask, T, shared is not None)
    if not sync:
        buf.call_state.defer(status, call)

    saved = SavedForward(
        num_tokens=T,
        call=call,
        layer_id=layer_id,
        own_mask=own_mask,
        partial_mask=partial_mask,
        plan=plan,
        experts=experts,
        x=x if shared is not None else None,
        shared_pre_act=shared_pre_act,
    )
    return y, saved


@_guarded
def backward(
    executor: Executor,
    buf: SymmBuffer,
    saved: SavedForward,
    grad_y: torch.Tensor,
    weights: ExpertWeights,
    shared,
    wgrad_targets=None,
):
    """Returns (grad_x, grad_topk_weights, grad_w1, grad_w2, grad_shared_w1, grad_shared_w2);
    expert weight gradients in fp32 or the compute dtype, fc1's in master order [gate; up]. With
    wgrad_targets (w1's, w2's main_grad.WgradTarget: tensors of the weights' shapes) the expert
    weight gradients go into those instead (added, or written over), and grad_w1, grad_w2 are
    None. Like forward, starts by raising the deferred verdicts now due (a backward is a call of
    the epoch count, so the call n + VERDICT_LAG that raises call n's verdict may be one)."""
    cfg = buf.config
    R, T = buf.world_size, saved.num_tokens
    _raise_deferred(buf)  # before the publish: a call that raises here writes nothing

    # 1. Publish dY; the shared experts' backward overlaps and fills this rank's own partial row.
    buf.regions().grad_y[:T].copy_(grad_y)
    grad_shared = (None, None)
    if shared is not None:

        def shared_grads(x_, w1_, w2_, h_, gy_):
            dx, dw1, dw2 = executor.shared_backward(x_, w1_, w2_, h_, cfg.activation_clamp, gy_)
            buf.regions().partials[R, :T].copy_(dx)
            return dw1, dw2

        grad_shared = _run_shared(buf, shared_grads, saved.x, shared[0], shared[1], saved.shared_pre_act, grad_y)
    ok = torch.full((), STATUS_OK, dtype=torch.int32, device=buf.device)
    status, call, all_ok = _exchange_status(buf, ok, saved.layer_id, forward_call=saved.call)
    sync = _sync_checks(executor)
    if sync:  # a rank that skipped this backward, or runs another, raises with its peers
        _raise_on_mismatch(status.cpu(), buf.rank, deferred=False)

    # 2-4. Pull dY once per (source, token); expert backward; push dX partials and d(topk weight).
    pool_grad = executor.pull_grad(buf, saved.plan)
    dx_rows, row_weight_grads, grad_w1, grad_w2 = executor.experts_backward(
        cfg, weights, saved.plan, saved.experts, pool_grad, wgrad_targets
    )
    executor.push_partials(buf, saved.plan, dx_rows, row_weight_grads)
    if shared is not None:
        _join_shared(buf)
    buf.barrier(call * 4 + BARRIER_PUSHED, wait_site=_wait_site(True, BARRIER_PUSHED))

    # 5. Reduce; masked slots get no weight gradient. Without sync checks a mismatched call reads
    # no partials (and is raised at call + VERDICT_LAG); its expert weight gradients are not masked.
    partial_mask, own_mask = saved.partial_mask, saved.own_mask
    if not sync:
        partial_mask, own_mask = partial_mask & all_ok, own_mask & all_ok
        buf.call_state.defer(status, call)
    grad_x = executor.reduce_partials(buf, partial_mask, T, shared is not None)
    grad_tw = torch.where(own_mask, buf.regions().topk_weight_grads[:T], 0.0)
    return grad_x, grad_tw, grad_w1, grad_w2, grad_shared[0], grad_shared[1]
