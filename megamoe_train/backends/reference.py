"""The reference executor: the protocol's row movement and expert math in plain PyTorch, the
numerics oracle every fast path is tested against. Runs wherever the buffer lives (CPU
processes over /dev/shm, or GPUs), reading sizes on the host freely: it is written to be read.

Numerics (what every fast path must reproduce):
- activations are stored as the recipe says (quant.py) and GEMMs run on the dequantized values
  with float32 accumulation; the L2 input is re-quantized from float32;
- SwiGLU, clamp and the topk weight are applied in float32 in the L1 epilogue;
- each expert output row is rounded to config.dtype; the owner sums the rows of one
  (source, token) in float32 in ascending slot order and rounds the sum to config.dtype (the
  partial row pushed home); the home sums the partials in float32 in owner-rank order
  0..R-1, then the shared experts' row, and rounds to config.dtype;
- backward treats every forward quantization as identity (straight-through) and computes in
  float32 on the dequantized forward operands; dY travels in config.dtype. With a quantized
  dgrad (recipe.grad_format: fp8, mxfp8_mxfp4) the two dgrad GEMMs read the output gradients as
  the recipe stores them (quant.fake_quantize_grad): dY rows [P, H] for grad_act = dY_q @ W2, and
  dH rows [P, 2I] in master order [gate | up] (quantized from fp32) for dX = dH_q @ W1; and the
  weights as the recipe quantizes them for the dgrad (ExpertWeights.w2_t / w1_t, dequantized:
  quant.quantize_weight_t of the master weights, fc1 in master order; for fp8 the forward's
  values, for mxfp8_mxfp4 E2M1 blocked along the dgrad's reduction dim). The weight
  gradients dW2 = dY^T a and dW1 = dH^T x read the unquantized dY and dH (fp32) and the stored
  activations; with a quantized wgrad (recipe.wgrad_format, fp8) both operands of each go
  through quant.fake_quantize_tokens over the expert's rows in pool order (1x128 blocks along
  the rows from the expert's first row, the last block padded with zero rows: the blocks of
  the GPU executor's 128-aligned pool), dH rounded to config.dtype first (what the executor
  keeps). d(topk weight) and the SwiGLU backward use grad_act as computed. dX is summed per
  owner and at home exactly like the forward combine; d(topk weight) is float32 per slot;
- shared experts run densely in float32 on the home rank, in every recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..expert_math import shared_backward, shared_forward, store_act, swiglu, swiglu_backward
from ..faults import STATUS_BAD, STATUS_OK
from ..plan import Plan, build_plan, owner_mask
from ..quant import dequantize_act, fake_quantize_grad, fake_quantize_tokens
from ..symm_buffer import SymmBuffer
from ..weights import ExpertWeights, deinterleave_gate_up


@dataclass
class ReferencePoolInputs:
    x: torch.Tensor  # [P, H] L1 input rows as stored (recipe format)
    x_scales: torch.Tensor | None
    row_weights: torch.Tensor  # float32 [P]: topk weight of each pool row (0 for padding)


@dataclass
class ReferenceExpertState:
    pool: ReferencePoolInputs
    pre_act: torch.Tensor  # float32 [P, 2I], interleaved


def _scale_rows(scales: torch.Tensor | None, rows):
    return None if scales is None else scales[rows]


def _wgrad(grad_out: torch.Tensor, inputs: torch.Tensor, recipe) -> torch.Tensor:
    """grad_out^T @ inputs over one expert's rows in pool order, both operands as the recipe's
    wgrad reads them."""
    if recipe.quantized_wgrad:
        grad_out, inputs = fake_quantize_tokens(grad_out, recipe), fake_quantize_tokens(inputs, recipe)
    return grad_out.t() @ inputs


def _expert_rows(plan: Plan):
    """(expert, pool row slice of its real rows) for every local expert, read on the host."""
    ends = plan.expert_ends.tolist()
    counts = plan.expert_counts.tolist()
    start = 0
    for e, (end, count) in enumerate(zip(ends, counts)):
        yield e, slice(start, start + count)
        start = end


class ReferenceExecutor:
    name = "reference"
    reads_device_on_host = True  # verdicts are read at once: bad input raises in the same call
    checks_ids_on_device = False  # ids are range-checked on the host, with a precise message

    def row_align(self, cfg) -> int:
        return 1

    # --------------------------------------------------------------------- shared experts

    def shared_forward(self, x, w1, w2, clamp):
        """The shared experts' MLP in float32, the oracle's precision: (out, pre-activation)."""
        return shared_forward(x, w1, w2, clamp, torch.float32)

    def shared_backward(self, x, w1, w2, h, clamp, grad_out):
        """(dx, dw1, dw2) of shared_forward."""
        return shared_backward(x, w1, w2, h, clamp, grad_out, torch.float32)

    # --------------------------------------------------------------------- plan and row movement

    def build_plan(self, buf: SymmBuffer, all_ok: torch.Tensor, align: int) -> Plan:
        """This rank's plan from every source's published ids (all -1 when the call is rejected)."""
        ids = torch.stack([buf.regions(s).topk_idx for s in range(buf.world_size)])
        ids = torch.where(all_ok, ids, -1)
        return build_plan(ids, buf.rank, buf.num_local_experts, align)

    def store_routing(self, cfg, topk_idx, topk_weights, ids_out, weights_out) -> torch.Tensor:
        """Publish the routing: ids_out[:n] = the ids with those outside [-1, num_experts) as -1
        (they route nothing), ids_out[n:] = -1, weights_out[:n] = the weights; returns this
        rank's verdict (int32 scalar on the device): STATUS_BAD if any id was out of range."""
        n = topk_idx.shape[0]
        out_of_range = (topk_idx < -1) | (topk_idx >= cfg.num_experts)
        ids_out[:n].copy_(torch.where(out_of_range, -1, topk_idx))
        ids_out[n:].fill_(-1)
        weights_out[:n].copy_(topk_weights)
        return torch.where(out_of_range.any(), STATUS_BAD, STATUS_OK).to(torch.int32)

    def routing_masks(self, ids: torch.Tensor, all_ok: torch.Tensor, num_ranks: int, experts_per_rank: int):
        """(own [T, K]: the slots of this rank's published ids that carried a row, partial [T, R]:
        the owners that pushed a partial row per token), both bool; all False when the call was
        rejected (all_ok False)."""
        return (ids >= 0) & all_ok, owner_mask(ids, num_ranks, experts_per_rank) & all_ok

    def store_inputs(self, cfg, x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None):
        """This rank's input rows as peers pull them (the recipe's storage) into its buffer."""
        stored, stored_scales = store_act(x, cfg.precision, cfg.dtype)
        data.copy_(stored)
        if scales is not None:
            scales.copy_(stored_scales)

    def _read_rows(self, buf: SymmBuffer, src: int, field: str, tokens: torch.Tensor) -> torch.Tensor:
        """Rows `tokens` of region `field` in rank src's buffer (every read of a peer goes here)."""
        return getattr(buf.regions(src), field)[tokens]

    def _write_partials(self, buf: SymmBuffer, home: int, tokens: torch.Tensor, rows: torch.Tensor):
        """This rank's partial rows for `tokens` into the home rank's buffer (every row push goes here)."""
        buf.regions(home).partials[buf.rank, tokens] = rows

    def _pull_expand(self, buf: SymmBuffer, field: str, plan: Plan) -> torch.Tensor:
        """Each received (source, token) row of region `field` read once from the source's
        buffer and written into the pool row of every slot it has here; padding rows are 0."""
        sample = getattr(buf.regions(), field)
        pool = torch.zeros(plan.pool_rows, *sample.shape[1:], dtype=sample.dtype, device=buf.device)
        recv_src, recv_token, recv_rows = plan.recv_src.long(), plan.recv_token.long(), plan.recv_rows.long()
        for src in range(buf.world_size):
            u = (recv_src == src).nonzero().squeeze(1)
            if not u.numel():
                continue
            fetched = self._read_rows(buf, src, field, recv_token[u])  # one read per (source, token)
            for k in range(recv_rows.shape[1]):
                dest = recv_rows[u, k]
                here = dest >= 0
                pool[dest[here]] = fetched[here]
        return pool

    def pull_inputs(self, buf: SymmBuffer, plan: Plan) -> ReferencePoolInputs:
        x = self._pull_expand(buf, "x", plan)
        x_scales = self._pull_expand(buf, "x_scales", plan) if buf.config.precision.quantized else None
        topk_weights = self._pull_expand(buf, "topk_weights", plan)  # [P, K]: the token's whole row
        row_weights = topk_weights.gather(1, plan.row_slot.long().clamp(min=0)[:, None]).squeeze(1)
        return ReferencePoolInputs(x, x_scales, row_weights)

    def pull_grad(self, buf: SymmBuffer, plan: Plan) -> torch.Tensor:
        return self._pull_expand(buf, "grad_y", plan)

    def push_partials(self, buf: SymmBuffer, plan: Plan, rows: torch.Tensor, row_scalars: torch.Tensor | None = None):
        """Per received (source, token): its slots' rows summed in fp32 in ascending slot order,
        rounded to config.dtype, written into the source's partials[this rank, token]; with
        row_scalars, each slot's scalar into the source's topk_weight_grads[token, slot]."""
        cfg = buf.config
        recv_src, recv_token, recv_rows = plan.recv_src.long(), plan.recv_token.long(), plan.recv_rows.long()
        acc = torch.zeros(recv_rows.shape[0], rows.shape[1], dtype=torch.float32, device=buf.device)
        for k in range(recv_rows.shape[1]):
            dest = recv_rows[:, k]
            here = dest >= 0
            acc[here] += rows[dest[here]].float()
        partial = acc.to(cfg.dtype)
        for src in range(buf.world_size):
            u = (recv_src == src).nonzero().squeeze(1)
            if not u.numel():
                continue
            self._write_partials(buf, src, recv_token[u], partial[u])
            if row_scalars is not None:
                # Elements addressed in the flat [T * K] region: a column view's index_put under
                # torch.use_deterministic_algorithms copies the whole column out and back (a
                # read-modify-write), which loses the other owners' concurrent writes.
                flat = buf.regions(src).topk_weight_grads.view(-1)
                K = recv_rows.shape[1]
                for k in range(K):
                    dest = recv_rows[u, k]
                    here = dest >= 0
                    flat[recv_token[u][here] * K + k] = row_scalars[dest[here]]

    def reduce_partials(self, buf: SymmBuffer, mask: torch.Tensor, T: int, has_shared: bool) -> torch.Tensor:
        """Sum this rank's partial rows per token in fp32: owners 0..R-1 (where mask), then shared."""
        partials = buf.regions().partials
        out = torch.zeros(T, buf.config.hidden, dtype=torch.float32, device=buf.device)
        for r in range(buf.world_size):
            out += torch.where(mask[:, r, None], partials[r, :T].float(), 0.0)
        if has_shared:
            out += partials[buf.world_size, :T].float()
        return out.to(buf.config.dtype)

    # --------------------------------------------------------------------- expert MLP

    def prepare_weights(self, cfg, weights: ExpertWeights) -> None:
        """Nothing to make: the reference dequantizes the stored weights in each call."""

    def experts_forward(self, cfg, weights: ExpertWeights, plan: Plan, pool: ReferencePoolInputs):
        """L1 -> clamp, SwiGLU, topk weight -> stored L2 input -> L2; rows in config.dtype."""
        recipe = cfg.precision
        w1, w2 = weights.dequantize_w1(), weights.dequantize_w2()
        P = plan.pool_rows
        pre_act = torch.zeros(P, 2 * cfg.intermediate, dtype=torch.float32, device=pool.x.device)
        out_rows = torch.zeros(P, cfg.hidden, dtype=cfg.dtype, device=pool.x.device)
        for e, rows in _expert_rows(plan):
            x_in = dequantize_act(pool.x[rows], _scale_rows(pool.x_scales, rows), recipe)
            h = x_in @ w1[e].t()
            pre_act[rows] = h
            a = swiglu(h, weights.chunk, cfg.activation_clamp) * pool.row_weights[rows, None]
            a_in = dequantize_act(*store_act(a, recipe, cfg.dtype), recipe)  # the L2 input as stored
            out_rows[rows] = (a_in @ w2[e].t()).to(cfg.dtype)
        return out_rows, ReferenceExpertState(pool, pre_act)

    def experts_backward(
        self,
        cfg,
        weights: ExpertWeights,
        plan: Plan,
        state: ReferenceExpertState,
        pool_grad: torch.Tensor,
        wgrad_targets=None,
    ):
        """(dX rows in config.dtype, d(topk weight) per row fp32, grad_w1 [gate; up], grad_w2), fp32
        on the dequantized weights (the dgrad's, w1_t / w2_t, where the recipe quantizes the
        dgrad); fc1 and dH in master order [gate; up]. With wgrad_targets (w1's, w2's
        main_grad.WgradTarget) the weight gradients go into them and None is returned for both."""
        recipe = cfg.precision
        if recipe.quantized_dgrad:  # [E, 2I, H] and [E, H, I] as the dgrads read them
            w1, w2 = weights.dequantize_w1_t().mT, weights.dequantize_w2_t().mT
        else:
            w1 = deinterleave_gate_up(weights.dequantize_w1(), weights.chunk)
            w2 = weights.dequantize_w2()
        grad_w1 = torch.zeros(w1.shape, dtype=torch.float32, device=w1.device)
        grad_w2 = torch.zeros(w2.shape, dtype=torch.float32, device=w2.device)
        P = plan.pool_rows
        dx_rows = torch.zeros(P, cfg.hidden, dtype=cfg.dtype, device=pool_grad.device)
        dw_rows = torch.zeros(P, dtype=torch.float32, device=pool_grad.device)
        pool = state.pool
        for e, rows in _expert_rows(plan):
            dy = pool_grad[rows].float()
            h, w = state.pre_act[rows], pool.row_weights[rows, None]
            s = swiglu(h, weights.chunk, cfg.activation_clamp)
            a = dequantize_act(*store_act(s * w, recipe, cfg.dtype), recipe)  # the L2 input forward used
            grad_a = fake_quantize_grad(dy, recipe) @ w2[e]  # L2 dgrad
            grad_w2[e] = _wgrad(dy, a, recipe)  # L2 wgrad
            dw_rows[rows] = (grad_a * s).sum(1)
            grad_h = swiglu_backward(h, weights.chunk, cfg.activation_clamp, grad_a * w)
            grad_h = deinterleave_gate_up(grad_h, weights.chunk, dim=1)
            x_in = dequantize_act(pool.x[rows], _scale_rows(pool.x_scales, rows), recipe)
            dx_rows[rows] = (fake_quantize_grad(grad_h, recipe) @ w1[e]).to(cfg.dtype)  # L1 dgrad
            # L1 wgrad; a quantized wgrad reads dH as the executor keeps it, in config.dtype
            grad_h_w = grad_h.to(cfg.dtype) if recipe.quantized_wgrad else grad_h
            grad_w1[e] = _wgrad(grad_h_w, x_in, recipe)
        if wgrad_targets is not None:
            wgrad_targets[0].put(grad_w1)
            wgrad_targets[1].put(grad_w2)
            return dx_rows, dw_rows, None, None
        return dx_rows, dw_rows, grad_w1, grad_w2
