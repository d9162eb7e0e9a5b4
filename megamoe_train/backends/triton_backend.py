"""The GPU backend: the reference protocol with device-side plans and Triton row movement.

Forward, per rank (R ranks, all on one NVLink node, torch symmetric memory):
  1. publish x (quantized for fp8), topk ids and weights in this rank's buffer; write this
     rank's verdict on its inputs into every peer's status; device barrier;
  2. every owner reads all sources' topk ids (R*T*K ints over NVLink) and builds its pool plan
     on the device (device_plan.py): no name lists and no count exchange are needed;
  3. pull: each pool row is copied from its source rank's x straight into the pool (Triton);
  4. L1 grouped GEMM -> fused clamp/SwiGLU/topk weight (/e4m3 requantization) -> L2 grouped
     GEMM; bf16 GEMMs are torch._grouped_mm, fp8 GEMMs our block-scaled Triton kernel;
  5. push each output row to [k slot, token] of the home rank's combine buffer; barrier;
     sum the slots in fixed order.
Backward pulls dY by the saved plan and mirrors it; dX rows and d(topk weight) are pushed home.

Nothing in forward or backward reads the device from the host, so the layer is capturable in
a CUDA graph. Bad topk ids are found on the device: every rank masks all routing of that call
(no row moves, nothing is corrupted) and the error is raised on the host at the next call on
the buffer whose flags have arrived (or at once with MEGAMOE_SYNC_CHECKS=1, which syncs).
Input problems the host can see (shapes, dtypes, too many tokens) raise on that rank after it
has taken part in the call's barriers, so peers never hang.

Shared experts run on a side stream under the routed path (forward and backward) and fill this
rank's extra combine slot before the second barrier.

Numerics match the reference up to rounding: pre-activations are kept in bf16 instead of fp32,
backward GEMMs run in bf16 on the dequantized forward operands with fp32 accumulation, and the
shared experts use bf16 GEMMs (fp32 accumulation, SwiGLU in fp32) where the reference uses fp32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..quant import quantize_act
from ..symm_buffer import SymmBuffer
from ..validation import MegaMoEInputError
from ..weights import ExpertWeights
from . import triton_kernels as K_
from .device_plan import DevicePlan, build_device_plan
from .reference import swiglu, swiglu_backward

STATUS_OK, STATUS_BAD = 1, 2
BF16_GROUP_ALIGN = 16
SUPPORTED_RECIPES = ("bf16", "fp8")


def supports(buf: SymmBuffer) -> bool:
    cfg = buf.config
    if buf.device.type != "cuda" or cfg.recipe not in SUPPORTED_RECIPES or cfg.dtype != torch.bfloat16:
        return False
    if cfg.intermediate % 128 or cfg.hidden % 128 or cfg.block_m not in (64, 128):
        return False
    return torch.cuda.get_device_capability(buf.device) >= (9, 0)


class _CallChecks:
    """Device-side input verdicts of earlier calls, read back without stalling the host."""

    def __init__(self):
        self.pending: list[tuple[torch.cuda.Event, torch.Tensor, int]] = []

    def push(self, status: torch.Tensor, call: int):
        if torch.cuda.is_current_stream_capturing():
            return
        host = torch.empty(status.shape, dtype=status.dtype, pin_memory=True)
        host.copy_(status, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.pending.append((ev, host, call))

    def raise_ready(self, rank: int):
        if torch.cuda.is_current_stream_capturing():
            return
        while self.pending and self.pending[0][0].query():
            _, host, call = self.pending.pop(0)  # popped first: each verdict raises once
            _raise_on_bad_status(host, rank, call)


def _raise_on_bad_status(status: torch.Tensor, rank: int, call: int):
    bad = [r for r in range(status.shape[0]) if int(status[r, 0]) != STATUS_OK]
    if bad:
        what = "this rank's topk_idx has an expert id outside [0, num_experts) (use -1 to mask a slot); " if rank in bad else ""
        raise MegaMoEInputError(
            f"mega_moe (rank {rank}, call {call}): {what}rank(s) {bad} rejected their input; that call moved "
            "no rows and its output holds only the shared experts"
        )
    seqs = status[:, 1].tolist()
    if len(set(seqs)) != 1:
        raise RuntimeError(f"mega_moe: ranks are at different calls of this buffer {seqs}; every rank must call each layer")


def _checks(buf: SymmBuffer) -> _CallChecks:
    checks = buf.__dict__.get("_device_checks")
    if checks is None:
        checks = buf.__dict__["_device_checks"] = _CallChecks()
    return checks


def _sync_checks() -> bool:
    return os.environ.get("MEGAMOE_SYNC_CHECKS", "0") not in ("", "0")


@dataclass
class SavedForward:
    num_tokens: int
    own_mask: torch.Tensor  # bool [T, K]: slots of this rank's tokens that carried rows
    plan: DevicePlan
    pool_x: torch.Tensor
    pool_x_scales: torch.Tensor | None
    pre_act: torch.Tensor  # bf16 [P, 2I] interleaved
    row_weights: torch.Tensor  # fp32 [P]
    act: torch.Tensor  # L2 input as stored
    act_scales: torch.Tensor | None
    x: torch.Tensor | None
    shared_pre_act: torch.Tensor | None


def _shared_forward(x, w1, w2, clamp, dtype):
    """Shared experts as the routed ones run: `dtype` GEMMs with fp32 accumulation, SwiGLU in
    fp32 (the reference computes them all in fp32, ~10x slower on the GPU). Returns (out, h)."""
    h = x @ w1.to(dtype).t()
    s = swiglu(h, w2.shape[1], clamp)  # [gate; up] is the interleave with one chunk of width W
    return s.to(dtype) @ w2.to(dtype).t(), h


def _shared_backward(x, w1, w2, h, clamp, grad_out, dtype):
    """(dx, dw1, dw2) of _shared_forward."""
    width = w2.shape[1]
    s = swiglu(h, width, clamp).to(dtype)
    grad_w2 = grad_out.t() @ s
    grad_h = swiglu_backward(h, width, clamp, (grad_out @ w2.to(dtype)).float()).to(dtype)
    return grad_h @ w1.to(dtype), grad_h.t() @ x, grad_w2


def _side_stream(buf: SymmBuffer) -> torch.cuda.Stream:
    """Stream on which the shared experts overlap the routed path (one per buffer)."""
    stream = buf.__dict__.get("_side_stream")
    if stream is None:
        stream = buf.__dict__["_side_stream"] = torch.cuda.Stream(device=buf.device)
    return stream


def _on_side_stream(buf: SymmBuffer, fn, *tensors):
    """Start fn(*tensors) on the buffer's side stream after all work queued so far; returns its
    results, made safe to use (and free) on the current stream once _join_side_stream ran."""
    main, side = torch.cuda.current_stream(), _side_stream(buf)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = fn(*tensors)
    if not torch.cuda.is_current_stream_capturing():  # a graph's pool is not shared across replays
        for t in tensors:
            t.record_stream(side)
        for t in out:
            t.record_stream(main)
    return out


def _join_side_stream(buf: SymmBuffer):
    torch.cuda.current_stream().wait_stream(_side_stream(buf))


def _grouped_mm(a, b, offs):
    """torch's grouped GEMM over expert row groups (a [P, K] x b [E, K, N], or K-grouped
    a [M, P] x b [P, N] -> [E, M, N] when both are 2-D); the output has the inputs' dtype."""
    return torch._grouped_mm(a, b, offs=offs)


def _publish(buf: SymmBuffer, x, topk_idx, topk_weights, problem) -> torch.Tensor:
    """Write this rank's inputs into its buffer; returns its verdict as a device int32 scalar."""
    cfg = buf.config
    E = cfg.num_experts
    ids_region = buf.region("topk_idx")
    if problem is not None:
        ids_region.fill_(-1)
        return torch.full((), STATUS_BAD, dtype=torch.int32, device=buf.device)
    n = x.shape[0]
    out_of_range = (topk_idx < -1) | (topk_idx >= E)
    bad = out_of_range.any()
    if cfg.precision.quantized:
        data, scales = quantize_act(x, cfg.precision)
        buf.region("x")[:n].copy_(data)
        buf.region("x_scales")[:n].copy_(scales)
    else:
        buf.region("x")[:n].copy_(x)
    ids_region[:n].copy_(torch.where(out_of_range, -1, topk_idx))
    ids_region[n:].fill_(-1)
    buf.region("topk_weights")[:n].copy_(topk_weights)
    return torch.where(bad, STATUS_BAD, STATUS_OK).to(torch.int32)


def _exchange_status(buf: SymmBuffer, verdict: torch.Tensor) -> torch.Tensor:
    """Verdict into every peer's status slot, then the call's first barrier. Returns status [R, 4]."""
    buf.call_count += 1
    parity = buf.call_count % 2
    word = torch.zeros(4, dtype=torch.int32, device=buf.device)
    word[0] = verdict
    word[1].fill_(buf.call_count)  # a fill, not a host-to-device copy: capturable
    for peer in range(buf.world_size):
        buf.region("status", peer)[parity, buf.rank].copy_(word)
    buf.barrier()
    return buf.region("status")[parity].clone()


def _reduce_slots(buf: SymmBuffer, mask: torch.Tensor, T: int) -> torch.Tensor:
    cfg = buf.config
    return K_.reduce_slots(buf.region("combine"), mask, T, bool(cfg.num_shared_experts), cfg.dtype)


def triton_forward(buf: SymmBuffer, x, topk_idx, topk_weights, weights: ExpertWeights, shared, recv_stats, problem):
    cfg, recipe = buf.config, buf.config.precision
    checks = _checks(buf)
    checks.raise_ready(buf.rank)
    R, me, K, E_l = buf.world_size, buf.rank, cfg.topk, buf.num_local_experts
    T = x.shape[0] if problem is None else 0
    H, I, bm = cfg.hidden, cfg.intermediate, cfg.block_m
    dev = buf.device
    regions = buf.layout.regions
    peers = buf.peer_base_ptrs

    # 1. Publish and exchange verdicts (the first barrier).
    status = _exchange_status(buf, _publish(buf, x, topk_idx, topk_weights, problem))
    if _sync_checks():  # every rank reads the verdicts now and raises at the same point
        host_status = status.cpu()
        if problem is not None:
            raise MegaMoEInputError(f"mega_moe (rank {me}): {problem}")
        _raise_on_bad_status(host_status, me, buf.call_count)
    if problem is not None:  # peers route nothing this call; finish its barriers, then raise
        buf.barrier()
        checks.push(status, buf.call_count)  # like its peers, this rank raises again at the next call
        raise MegaMoEInputError(f"mega_moe (rank {me}): {problem}")
    all_ok = (status[:, 0] == STATUS_OK).all() & (status[:, 1] == buf.call_count).all()

    # Shared experts run on a side stream, under the plan, the pull and the expert GEMMs; they
    # fill this rank's extra combine slot, which no peer writes.
    shared_pre_act = None
    if shared is not None:
        def shared_slot(x_, w1_, w2_):
            out_, h_ = _shared_forward(x_, w1_, w2_, cfg.activation_clamp, cfg.dtype)
            buf.region("combine")[K, :T].copy_(out_)
            return (h_,)

        (shared_pre_act,) = _on_side_stream(buf, shared_slot, x, shared[0], shared[1])

    # 2. Plan from every source's ids (a bad call routes nothing).
    ids = torch.stack([buf.region("topk_idx", s) for s in range(R)])
    ids = torch.where(all_ok, ids, -1)
    pool_rows = buf.layout.pool_rows
    # fp8 GEMM tiles are block_m rows of one expert; torch's bf16 grouped GEMM takes any group
    # ends, so bf16 pads experts only to 16 rows (aligned offsets, ~no wasted rows).
    plan = build_device_plan(ids, me, E_l, bm if recipe.quantized else BF16_GROUP_ALIGN, pool_rows)
    if recv_stats is not None:
        recv_stats += plan.expert_counts

    # 3. Pull rows, their scales and topk weights.
    act_dtype = recipe.act_storage_dtype(cfg.dtype)
    pool_x = torch.empty(pool_rows, H, dtype=act_dtype, device=dev)
    K_.pull_rows(peers, regions["x"], pool_x, plan.row_src, plan.row_token, plan.num_rows)
    pool_xs = None
    if recipe.quantized:
        pool_xs = torch.empty(pool_rows, H // recipe.act_block, dtype=torch.float32, device=dev)
        K_.pull_rows(peers, regions["x_scales"], pool_xs, plan.row_src, plan.row_token, plan.num_rows)
    pool_tw = torch.empty(pool_rows, K, dtype=torch.float32, device=dev)
    K_.pull_rows(peers, regions["topk_weights"], pool_tw, plan.row_src, plan.row_token, plan.num_rows)
    row_w = pool_tw.gather(1, plan.row_slot.clamp(min=0).long()[:, None]).squeeze(1)

    # 4. L1 -> SwiGLU epilogue -> L2.
    h = torch.empty(pool_rows, 2 * I, dtype=cfg.dtype, device=dev)
    act = torch.empty(pool_rows, I, dtype=act_dtype, device=dev)
    act_scales = torch.empty(pool_rows, I // recipe.act_block, dtype=torch.float32, device=dev) if recipe.quantized else None
    if recipe.quantized:
        K_.grouped_gemm(pool_x, weights.w1, plan.block_expert, h, pool_xs, weights.w1_scales, block_m=bm)
    else:
        h = _grouped_mm(pool_x, weights.w1.transpose(1, 2), plan.expert_ends)
    K_.swiglu_forward(h, row_w, act, act_scales, plan.num_rows, weights.chunk, cfg.activation_clamp)

    # 5. L2; its rows go home to [k slot, token] of the combine buffer: pushed from the fp8
    # GEMM's epilogue, or by a separate pass after torch's bf16 GEMM.
    if recipe.quantized:
        push = (buf, "combine", plan.row_src, plan.row_token, plan.row_slot)
        K_.grouped_gemm(act, weights.w2, plan.block_expert, None, act_scales, weights.w2_scales, block_m=bm, push=push)
    else:
        out = _grouped_mm(act, weights.w2.transpose(1, 2), plan.expert_ends)
        K_.push_rows(peers, regions["combine"], out, plan.row_src, plan.row_token, plan.row_slot, plan.num_rows)

    # 6. Barrier (shared experts joined first); fixed-order reduction.
    if shared is not None:
        _join_side_stream(buf)
    buf.barrier()
    own_mask = (buf.region("topk_idx")[:T] >= 0) & all_ok
    y = _reduce_slots(buf, own_mask, T)
    checks.push(status, buf.call_count)

    saved = SavedForward(
        num_tokens=T, own_mask=own_mask, plan=plan, pool_x=pool_x, pool_x_scales=pool_xs, pre_act=h,
        row_weights=row_w, act=act, act_scales=act_scales,
        x=x if shared is not None else None, shared_pre_act=shared_pre_act,
    )
    return y, saved


def _backward_weights(weights: ExpertWeights, master, dtype):
    """fc1/fc2 in master order as the backward GEMMs read them: the parameters themselves when
    the recipe stores them unquantized in `dtype`, else the dequantized forward weights."""
    w1, w2 = master
    if not weights.quantized and w1.dtype == dtype and w2.dtype == dtype:
        return w1.detach(), w2.detach()
    return weights.compute_copies(dtype)


def _as_compute(data, scales, num_rows, dtype):
    """Stored activations as `dtype` values for the backward GEMMs (fp8: dequantized)."""
    if scales is None:
        return data
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    K_.dequantize_rows(data, scales, out, num_rows)
    return out


def triton_backward(buf: SymmBuffer, saved: SavedForward, grad_y: torch.Tensor, weights: ExpertWeights, shared, master):
    cfg, recipe = buf.config, buf.config.precision
    K, T, H, I = cfg.topk, saved.num_tokens, cfg.hidden, cfg.intermediate
    dev, regions, peers, plan = buf.device, buf.layout.regions, buf.peer_base_ptrs, saved.plan
    pool_rows = plan.row_src.shape[0]

    # 1. Publish dY; owners pull it by the saved plan. Shared experts' backward overlaps on the
    # side stream and fills this rank's extra combine slot with their dX.
    buf.region("grad_y")[:T].copy_(grad_y)
    grad_shared = (None, None)
    if shared is not None:
        def shared_grads(x_, w1_, w2_, h_, gy_):
            dx_, dw1_, dw2_ = _shared_backward(x_, w1_, w2_, h_, cfg.activation_clamp, gy_, cfg.dtype)
            buf.region("combine")[K, :T].copy_(dx_)
            return dw1_, dw2_

        grad_shared = _on_side_stream(buf, shared_grads, saved.x, shared[0], shared[1], saved.shared_pre_act, grad_y)
    buf.barrier()
    pool_grad = torch.empty(pool_rows, H, dtype=cfg.dtype, device=dev)
    K_.pull_rows(peers, regions["grad_y"], pool_grad, plan.row_src, plan.row_token, plan.num_rows)

    # 2. L2 dgrad, SwiGLU backward (+ d topk weight per row), wgrads, L1 dgrad.
    w1, w2 = _backward_weights(weights, master, cfg.dtype)
    grad_act = _grouped_mm(pool_grad, w2, plan.expert_ends)
    grad_h = torch.empty(pool_rows, 2 * I, dtype=cfg.dtype, device=dev)
    grad_row_w = torch.empty(pool_rows, dtype=torch.float32, device=dev)
    K_.swiglu_backward(saved.pre_act, saved.row_weights, grad_act, grad_h, grad_row_w, plan.num_rows, weights.chunk, cfg.activation_clamp)
    act = _as_compute(saved.act, saved.act_scales, plan.num_rows, cfg.dtype)
    grad_w2 = _grouped_mm(pool_grad.t(), act, plan.expert_ends)
    grad_x_rows = _grouped_mm(grad_h, w1, plan.expert_ends)
    x_in = _as_compute(saved.pool_x, saved.pool_x_scales, plan.num_rows, cfg.dtype)
    grad_w1 = _grouped_mm(grad_h.t(), x_in, plan.expert_ends)

    # 3. Push dX rows and d(topk weight) home; shared experts; barrier; reduce.
    K_.push_rows(
        peers, regions["combine"], grad_x_rows, plan.row_src, plan.row_token, plan.row_slot, plan.num_rows,
        scalar_region=regions["combine_weight_grads"], scalar_values=grad_row_w, topk=K,
    )
    if shared is not None:
        _join_side_stream(buf)
    buf.barrier()
    grad_x = _reduce_slots(buf, saved.own_mask, T)
    grad_tw = torch.where(saved.own_mask, buf.region("combine_weight_grads")[:T], 0.0)
    return grad_x, grad_tw, grad_w1, grad_w2, grad_shared[0], grad_shared[1]
