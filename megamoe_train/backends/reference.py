"""The reference backend: the protocol of DESIGN.md in plain PyTorch, and the numerics oracle.

Every step goes through the SymmBuffer exactly as a fused kernel would: inputs are published in
this rank's buffer, names and counts are written into the owners' workspaces, the owner pulls
rows from the sources' buffers into its expert-major pool, runs both GEMMs on its pool and
pushes each output row into the home rank's combine buffer at [k slot, token], and the home
rank reduces its slots in a fixed order. Backward mirrors it with the plan saved by forward.

Numerics (what every fast path must reproduce):
- activations are stored as the recipe says (quant.py) and GEMMs run on the dequantized values
  with float32 accumulation; the L2 input is re-quantized from float32;
- SwiGLU, clamp and the topk weight are applied in float32 in the L1 epilogue;
- combine rows travel in config.dtype and are summed in float32 in slot order 0..K-1, then the
  shared-expert slot;
- backward treats every quantization as identity (straight-through) and computes in float32
  on the dequantized forward operands; dY and dX rows travel in config.dtype;
- shared experts run densely in float32 on the home rank, in every recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..quant import dequantize_act, quantize_act
from ..routing import build_pool_plan, build_send_plan
from ..symm_buffer import SymmBuffer
from ..validation import MegaMoEInputError
from ..weights import ExpertWeights, deinterleave_gate_up

STATUS_OK, STATUS_BAD = 1, 2


# ----------------------------------------------------------------------------- expert math


def _split_gate_up(h: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up columns of an interleaved fc1 output [n, 2I] -> two [n, I] views."""
    n, width = h.shape
    pairs = h.view(n, width // (2 * chunk), 2, chunk)
    return pairs[:, :, 0, :].reshape(n, width // 2), pairs[:, :, 1, :].reshape(n, width // 2)


def _join_gate_up(g: torch.Tensor, u: torch.Tensor, chunk: int) -> torch.Tensor:
    n, half = g.shape
    return torch.stack((g.view(n, half // chunk, chunk), u.view(n, half // chunk, chunk)), dim=2).reshape(n, 2 * half)


def swiglu(h: torch.Tensor, chunk: int, clamp: float | None) -> torch.Tensor:
    """silu(min(g, c)) * clamp(u, -c, c) of an interleaved [n, 2I] pre-activation, in float32."""
    g, u = _split_gate_up(h.float(), chunk)
    if clamp is not None:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    return F.silu(g) * u


def swiglu_backward(h: torch.Tensor, chunk: int, clamp: float | None, grad_s: torch.Tensor) -> torch.Tensor:
    """d(pre-activation) [n, 2I] (interleaved) from d(silu(g)*u) [n, I]."""
    g, u = _split_gate_up(h.float(), chunk)
    g_mask = u_mask = None
    if clamp is not None:
        g_mask, u_mask = g <= clamp, (u >= -clamp) & (u <= clamp)  # torch.clamp's gradient rule
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    sig = torch.sigmoid(g)
    silu_g = g * sig
    grad_g = grad_s * u * sig * (1 + g * (1 - sig))
    grad_u = grad_s * silu_g
    if clamp is not None:
        grad_g, grad_u = grad_g * g_mask, grad_u * u_mask
    return _join_gate_up(grad_g, grad_u, chunk)


def _store_act(a32: torch.Tensor, recipe, dtype: torch.dtype):
    """How an activation row is stored for the next GEMM: the recipe's quantization, or a cast."""
    return quantize_act(a32 if recipe.quantized else a32.to(dtype), recipe)


def _scale_rows(scales: torch.Tensor | None, rows):
    """Rows of a scale tensor; None stays None (the native recipe has no scales)."""
    return None if scales is None else scales[rows]


def shared_forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, clamp):
    """Dense shared-expert MLP (fc1 is [gate; up]) in float32; returns (out, pre-activation)."""
    h = x.float() @ w1.float().t()
    width = w2.shape[1]
    s = swiglu(h, width, clamp)  # [gate; up] is the interleave with one chunk of width I
    return s @ w2.float().t(), h


def shared_backward(x, w1, w2, h, clamp, grad_out):
    width = w2.shape[1]
    s = swiglu(h, width, clamp)
    grad_w2 = grad_out.t() @ s
    grad_h = swiglu_backward(h, width, clamp, grad_out @ w2.float())
    return grad_h @ w1.float(), grad_h.t() @ x.float(), grad_w2


# ----------------------------------------------------------------------------- protocol


@dataclass
class SavedForward:
    """What backward needs from forward (copied out of the buffer, which later calls reuse)."""

    num_tokens: int
    topk_idx: torch.Tensor
    expert_offsets: list[int]
    expert_counts: list[int]
    row_src: torch.Tensor  # int64 [P]
    row_name: torch.Tensor  # int64 [P]
    pool_x: torch.Tensor  # L1 input rows as stored (recipe format)
    pool_x_scales: torch.Tensor | None
    pre_act: torch.Tensor  # float32 [P, 2I], interleaved
    row_weights: torch.Tensor  # float32 [P]
    x: torch.Tensor | None  # home rank's input, kept for the shared expert
    shared_pre_act: torch.Tensor | None


def _exchange_status(buf: SymmBuffer, problem: str | None):
    """Publish this rank's verdict on its inputs to every peer, barrier, and raise everywhere if any
    rank had bad input. Rows are never exchanged for a failed call, so the buffer stays usable."""
    buf.call_count += 1
    parity = buf.call_count % 2
    verdict = torch.tensor([STATUS_BAD if problem else STATUS_OK, buf.call_count, 0, 0], dtype=torch.int32)
    for peer in range(buf.world_size):
        buf.region("status", peer)[parity, buf.rank].copy_(verdict)
    buf.barrier()
    status = buf.region("status")[parity].cpu()
    if problem:
        raise MegaMoEInputError(f"mega_moe (rank {buf.rank}): {problem}")
    bad = [r for r in range(buf.world_size) if int(status[r, 0]) != STATUS_OK]
    if bad:
        raise MegaMoEInputError(f"mega_moe (rank {buf.rank}): rank(s) {bad} rejected their input; no rows were exchanged")
    seqs = status[:, 1].tolist()
    if len(set(seqs)) != 1:
        raise RuntimeError(f"mega_moe: ranks are at different calls of this buffer {seqs}; every rank must call each layer")


def _rows_by_source(buf: SymmBuffer, row_src: torch.Tensor, row_name: torch.Tensor):
    """(source, pool rows, tokens, k slots) for every source rank with rows in the pool."""
    K = buf.config.topk
    for src in range(buf.world_size):
        rows = (row_src == src).nonzero().squeeze(1)
        if rows.numel():
            names = row_name[rows]
            yield src, rows, names // K, names % K


def reference_forward(buf: SymmBuffer, x, topk_idx, topk_weights, weights: ExpertWeights, shared, recv_stats, problem):
    cfg, recipe = buf.config, buf.config.precision
    R, me, K, T = buf.world_size, buf.rank, cfg.topk, (x.shape[0] if problem is None else 0)

    # 1. Publish inputs in this rank's buffer, announce names and counts to every owner.
    if problem is None:
        x_data, x_scales = _store_act(x.float(), recipe, cfg.dtype)
        buf.region("x")[:T].copy_(x_data)
        if x_scales is not None:
            buf.region("x_scales")[:T].copy_(x_scales)
        buf.region("topk_idx")[:T].copy_(topk_idx)
        buf.region("topk_weights")[:T].copy_(topk_weights)
        send = build_send_plan(topk_idx, cfg.num_experts, R)
        for owner in range(R):
            n = send.total(owner)
            buf.region("recv_counts", owner)[me].copy_(send.counts[owner])
            buf.region("recv_names", owner)[me, :n].copy_(send.names[owner, :n])
    _exchange_status(buf, problem)  # the count-exchange barrier

    # 2. Plan the expert-major pool from what every source announced.
    plan = build_pool_plan(buf.region("recv_counts"), cfg.block_m, me)
    P = plan.num_rows
    row_src = plan.row_src.long().to(buf.device)
    row_name = torch.full((P,), -1, dtype=torch.long, device=buf.device)
    real = row_src >= 0
    row_name[real] = buf.region("recv_names")[row_src[real], plan.row_pos.long().to(buf.device)[real]].long()
    buf.region("row_src")[:P].copy_(row_src)
    buf.region("row_name")[:P].copy_(row_name)
    if recv_stats is not None:
        recv_stats += plan.expert_counts.to(recv_stats.device, torch.int64)

    # 3. Pull: every pool row reads its token from the source rank's published input.
    pool_x, pool_w = buf.region("pool_x"), buf.region("pool_weights")
    pool_xs = buf.region("pool_x_scales") if recipe.quantized else None
    for src, rows, tokens, slots in _rows_by_source(buf, row_src, row_name):
        pool_x[rows] = buf.region("x", src)[tokens]
        if pool_xs is not None:
            pool_xs[rows] = buf.region("x_scales", src)[tokens]
        pool_w[rows] = buf.region("topk_weights", src)[tokens, slots]
    blocks = P // cfg.block_m
    buf.region("arrival")[:blocks].fill_(cfg.block_m)  # every block complete (kernels count rows)

    # 4. L1 -> clamp, SwiGLU, topk weight -> stored L2 input -> L2 -> push to the home rank.
    w1, w2 = weights.dequantize_w1(), weights.dequantize_w2()
    pre_act = torch.zeros(P, 2 * cfg.intermediate, dtype=torch.float32, device=buf.device)
    pool_act = buf.region("pool_act")
    pool_as = buf.region("pool_act_scales") if recipe.quantized else None
    out_rows = torch.zeros(P, cfg.hidden, dtype=cfg.dtype, device=buf.device)
    offsets, counts = plan.expert_offsets.tolist(), plan.expert_counts.tolist()
    for e in range(buf.num_local_experts):
        rows = slice(offsets[e], offsets[e] + counts[e])
        x_in = dequantize_act(pool_x[rows], _scale_rows(pool_xs, rows), recipe)
        h = x_in @ w1[e].t()
        pre_act[rows] = h
        a = swiglu(h, weights.chunk, cfg.activation_clamp) * pool_w[rows, None]
        a_data, a_scales = _store_act(a, recipe, cfg.dtype)
        pool_act[rows] = a_data
        if pool_as is not None:
            pool_as[rows] = a_scales
        out_rows[rows] = (dequantize_act(pool_act[rows], _scale_rows(pool_as, rows), recipe) @ w2[e].t()).to(cfg.dtype)
    for src, rows, tokens, slots in _rows_by_source(buf, row_src, row_name):
        buf.region("combine", src)[slots, tokens] = out_rows[rows]

    # 5. Shared experts fill the home rank's extra slot.
    shared_pre_act = None
    if shared is not None:
        shared_out, shared_pre_act = shared_forward(x, shared[0], shared[1], cfg.activation_clamp)
        buf.region("combine")[K, :T] = shared_out.to(cfg.dtype)

    buf.barrier()  # every owner has pushed its rows
    y = _reduce_slots(buf, topk_idx, T)

    saved = SavedForward(
        num_tokens=T,
        topk_idx=topk_idx,
        expert_offsets=offsets,
        expert_counts=counts,
        row_src=row_src,
        row_name=row_name,
        pool_x=pool_x[:P].clone(),
        pool_x_scales=None if pool_xs is None else pool_xs[:P].clone(),
        pre_act=pre_act,
        row_weights=pool_w[:P].clone(),
        x=x if shared is not None else None,
        shared_pre_act=shared_pre_act,
    )
    return y.to(cfg.dtype), saved


def _reduce_slots(buf: SymmBuffer, topk_idx: torch.Tensor, T: int) -> torch.Tensor:
    """Sum this rank's combine slots per token in fixed order (routed 0..K-1, then shared)."""
    cfg = buf.config
    combine = buf.region("combine")
    out = torch.zeros(T, cfg.hidden, dtype=torch.float32, device=buf.device)
    for k in range(cfg.topk):
        out += torch.where((topk_idx[:, k] >= 0)[:, None], combine[k, :T].float(), 0.0)
    if cfg.num_shared_experts:
        out += combine[cfg.topk, :T].float()
    return out


def reference_backward(buf: SymmBuffer, saved: SavedForward, grad_y: torch.Tensor, weights: ExpertWeights, shared, master=None):
    """Returns (grad_x, grad_topk_weights, grad_w1, grad_w2, grad_shared_w1, grad_shared_w2), weight
    gradients in float32 and fc1's in master order [gate; up]. `master` (the parameters) is unused:
    the oracle differentiates the dequantized kernel-layout weights."""
    cfg, recipe = buf.config, buf.config.precision
    K, T = cfg.topk, saved.num_tokens

    # 1. Publish dY; owners pull it by the saved plan after the barrier (no new count exchange).
    buf.region("grad_y")[:T].copy_(grad_y)
    buf.barrier()
    pool_grad = buf.region("pool_grad")
    for src, rows, tokens, _ in _rows_by_source(buf, saved.row_src, saved.row_name):
        pool_grad[rows] = buf.region("grad_y", src)[tokens]

    # 2. Per expert: L2 dgrad/wgrad, SwiGLU backward with d(topk weight), L1 dgrad/wgrad.
    w1, w2 = weights.dequantize_w1(), weights.dequantize_w2()
    grad_w1, grad_w2 = torch.zeros_like(w1), torch.zeros_like(w2)
    P = saved.row_src.numel()
    dx_rows = torch.zeros(P, cfg.hidden, dtype=cfg.dtype, device=buf.device)
    dw_rows = torch.zeros(P, dtype=torch.float32, device=buf.device)
    for e in range(buf.num_local_experts):
        rows = slice(saved.expert_offsets[e], saved.expert_offsets[e] + saved.expert_counts[e])
        dy = pool_grad[rows].float()
        h, w = saved.pre_act[rows], saved.row_weights[rows, None]
        s = swiglu(h, weights.chunk, cfg.activation_clamp)
        a = dequantize_act(*_store_act(s * w, recipe, cfg.dtype), recipe)  # the L2 input forward used
        grad_a = dy @ w2[e]
        grad_w2[e] = dy.t() @ a
        dw_rows[rows] = (grad_a * s).sum(1)
        grad_h = swiglu_backward(h, weights.chunk, cfg.activation_clamp, grad_a * w)
        x_in = dequantize_act(saved.pool_x[rows], _scale_rows(saved.pool_x_scales, rows), recipe)
        dx_rows[rows] = (grad_h @ w1[e]).to(cfg.dtype)
        grad_w1[e] = grad_h.t() @ x_in

    # 3. Push dX rows and d(topk weight) back to each token's home rank.
    for src, rows, tokens, slots in _rows_by_source(buf, saved.row_src, saved.row_name):
        buf.region("combine", src)[slots, tokens] = dx_rows[rows]
        buf.region("combine_weight_grads", src)[tokens, slots] = dw_rows[rows]
    grad_shared = (None, None)
    if shared is not None:
        dx_shared, *grad_shared = shared_backward(saved.x, shared[0], shared[1], saved.shared_pre_act, cfg.activation_clamp, grad_y.float())
        buf.region("combine")[K, :T] = dx_shared.to(cfg.dtype)
    buf.barrier()

    # 4. Reduce dX slots in fixed order; masked slots get no weight gradient.
    grad_x = _reduce_slots(buf, saved.topk_idx, T).to(cfg.dtype)
    mask = saved.topk_idx >= 0
    grad_topk_w = torch.where(mask, buf.region("combine_weight_grads")[:T], 0.0)
    grad_w1 = deinterleave_gate_up(grad_w1, weights.chunk)
    return grad_x, grad_topk_w, grad_w1, grad_w2, grad_shared[0], grad_shared[1]
