"""The executor contract: what protocol.py asks of an executor, step by step.

protocol.forward and protocol.backward own the order of the steps, the barriers, the status
exchange and the verdicts; an executor owns the row movement and the expert math. There are
two: backends/reference.py (plain PyTorch, the numerics oracle, runs anywhere) and
backends/triton_backend.py (Triton and CUTLASS kernels, CUDA sm90+). tests/test_executor.py
holds both against this class.

Names in the shapes: R ranks, this rank `buf.rank`, T its tokens in this call (T <= T_max =
config.num_max_tokens_per_rank), K = config.topk, H = config.hidden, I = config.intermediate,
E_l = the local experts, P = plan.pool_rows (plan.max_pool_rows: fixed by the config, not by
the routing), U = R * T_max received-row slots of the plan. dtype = config.dtype, the compute
dtype; "stored" = as the recipe stores an activation (config.precision: e4m3 data with fp32
1x128 scales for fp8, else dtype and no scales). Every tensor lives on the buffer's device.

Every rank calls the same steps in the same order; between the steps that read peers and those
that write them the protocol puts a barrier. An executor may assume what the protocol
guarantees at each step (below) and must not read the device on the host unless it says so
(reads_device_on_host), since a GPU call without host reads is CUDA-graph capturable. Values an
executor hands itself from one step to a later one (the pool, the saved expert state, the
pulled gradient) are its own types; the protocol only carries them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from ..config import MegaMoEConfig
from ..main_grad import WgradTarget
from ..plan import Plan
from ..symm_buffer import SymmBuffer
from ..weights import ExpertWeights

PoolInputs = Any  # pull_inputs' result, read by experts_forward: the executor's own type
ExpertState = Any  # experts_forward's saved state, read by experts_backward (kept in SavedForward)
PoolGrad = Any  # pull_grad's result, read by experts_backward


@runtime_checkable
class Executor(Protocol):
    name: str  # the backend name mega_moe(backend=...) takes
    # True: the host may read device values (sizes, verdicts): bad input raises in the same call
    # on every rank. False: no host reads, so the call is capturable; verdicts reach the host later.
    reads_device_on_host: bool
    # True: store_routing's verdict is the only range check of the ids. False: mega_moe checks
    # them on the host first (validation.check_inputs), with a precise message.
    checks_ids_on_device: bool

    def row_align(self, cfg: MegaMoEConfig) -> int:
        """Rows each expert's pool group is padded to (build_plan's align): what the expert
        GEMMs' tiles and the quantized wgrads' row blocks need. 1 where nothing does."""
        ...

    # ----------------------------------------------------------------- 1. publish (own buffer only)

    def store_inputs(
        self, cfg: MegaMoEConfig, x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None
    ) -> None:
        """x [T, H] dtype (this rank's input, T >= 0) into its own buffer as stored: data = the x
        region's rows [:T] (the recipe's storage dtype), scales = x_scales' rows [:T] (fp32
        [T, H / act_block]) or None for an unquantized recipe. Bit for bit quant.quantize_act."""
        ...

    def store_routing(
        self,
        cfg: MegaMoEConfig,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        ids_out: torch.Tensor,
        weights_out: torch.Tensor,
    ) -> torch.Tensor:
        """Publish the routing into this rank's own buffer. topk_idx int64 [T, K] (anything: no
        range check before unless checks_ids_on_device is False), topk_weights fp32 [T, K];
        ids_out int32 [T_max, K] and weights_out fp32 [T_max, K] are the whole regions. Writes
        ids_out[:T] = the ids with those outside [-1, num_experts) as -1, ids_out[T:] = -1,
        weights_out[:T] = the weights. Returns this rank's verdict, an int32 0-d device tensor:
        faults.STATUS_BAD if any id was out of range, else STATUS_OK."""
        ...

    # ----------------------------------------------------------------- shared experts (own buffer only)

    def shared_forward(
        self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, clamp: float | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense shared-expert MLP of this rank's tokens, as expert_math.shared_forward: x [T, H]
        dtype, w1 [2 I_s, H] in master order [gate; up], w2 [H, I_s]. Returns (out [T, H],
        pre-activation [T, 2 I_s], kept for shared_backward). May run on a side stream (the
        protocol orders it)."""
        ...

    def shared_backward(
        self,
        x: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        h: torch.Tensor,
        clamp: float | None,
        grad_out: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dx [T, H], dw1 [2 I_s, H], dw2 [H, I_s]) of shared_forward; h its pre-activation,
        grad_out [T, H] dtype."""
        ...

    # ----------------------------------------------------------------- 3. plan (after the first barrier)

    def build_plan(self, buf: SymmBuffer, all_ok: torch.Tensor, align: int) -> Plan:
        """This rank's plan (plan.build_plan's tables, bit for bit) from every source's published
        ids. all_ok: bool 0-d device tensor, False when any rank rejected its input or the ranks
        are in different calls; the plan then routes nothing. May assume every rank has
        published (the exchange barrier passed) and align == row_align(config)."""
        ...

    # ----------------------------------------------------------------- 4. pull (reads peers)

    def pull_inputs(self, buf: SymmBuffer, plan: Plan) -> PoolInputs:
        """Each received (source, token) of the plan read once from the source's buffer: its x
        row as stored (with its scales) and its topk weights, written into the pool row of every
        slot it has here, with that slot's topk weight (fp32 [P]). Padding rows may hold anything
        that experts_forward ignores. Reads peers: the exchange barrier has passed."""
        ...

    # ----------------------------------------------------------------- 5. expert MLP (local)

    def prepare_weights(self, cfg: MegaMoEConfig, weights: ExpertWeights) -> None:
        """Makes every operand that experts_forward and experts_backward derive from the weights
        and cache on them (ExpertWeights.mma_operands and the like), so that later calls only read
        them. Called by a graphed layer (graphs.py) in its weight-preparation graph, replayed once
        per weight update: an operand first made inside one captured forward or backward would be
        remade by that graph's replays only. Makes nothing a call of this executor does not read;
        harmless eagerly (a call would make the same on first use)."""
        ...

    def experts_forward(
        self, cfg: MegaMoEConfig, weights: ExpertWeights, plan: Plan, pool: PoolInputs
    ) -> tuple[torch.Tensor, ExpertState]:
        """L1 (pool rows of expert e times weights.w1[e], gate/up interleaved in chunks of
        weights.chunk), clamp + SwiGLU times the row's topk weight in fp32, the L2 input stored,
        L2. Returns (output rows [P, H] dtype, padding rows anything push_partials ignores,
        the state experts_backward needs)."""
        ...

    # ----------------------------------------------------------------- 6. push (writes peers)

    def push_partials(
        self, buf: SymmBuffer, plan: Plan, rows: torch.Tensor, row_scalars: torch.Tensor | None = None
    ) -> None:
        """Per received (source, token): the rows [P, H] of its slots here summed in fp32 in
        ascending slot order, rounded to dtype, written into the source's partials[this rank,
        token]; with row_scalars (fp32 [P], backward), each slot's scalar into the source's
        topk_weight_grads[token, slot]. Writes only those elements: other owners write the rest
        of the same regions at the same time. The protocol's barrier follows."""
        ...

    # ----------------------------------------------------------------- 7. reduce (own buffer, after the push barrier)

    def routing_masks(
        self, ids: torch.Tensor, all_ok: torch.Tensor, num_ranks: int, experts_per_rank: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids: this rank's published ids, int32 [T, K] (-1 = no row). Returns (own bool [T, K]:
        the slots that carried a row, partial bool [T, R]: the owners that pushed a partial row
        per token), both all False when all_ok (bool 0-d device tensor) is False."""
        ...

    def reduce_partials(self, buf: SymmBuffer, mask: torch.Tensor, T: int, has_shared: bool) -> torch.Tensor:
        """This rank's output rows [T, H] dtype: per token, the partial rows of owners 0..R-1
        where mask (bool [T, R]) summed in fp32 in that order, then the shared experts' row
        (partials[R]) if has_shared, rounded to dtype once. Bitwise deterministic."""
        ...

    # ----------------------------------------------------------------- backward

    def pull_grad(self, buf: SymmBuffer, plan: Plan) -> PoolGrad:
        """dY (the grad_y region, [T_max, H] dtype on each source) pulled like pull_inputs' x:
        once per received (source, token), into the pool row of each of its slots; the forward's
        plan. Reads peers: the backward's exchange barrier has passed."""
        ...

    def experts_backward(
        self,
        cfg: MegaMoEConfig,
        weights: ExpertWeights,
        plan: Plan,
        state: ExpertState,
        pool_grad: PoolGrad,
        wgrad_targets: tuple[WgradTarget, WgradTarget] | None = None,
    ):
        """The expert MLP's backward from the forward's state and the pulled dY. Returns (dX rows
        [P, H] dtype, d(topk weight) per pool row fp32 [P], grad_w1 [E_l, 2I, H] in master order
        [gate; up], grad_w2 [E_l, H, I]), the weight gradients in fp32 or dtype. With
        wgrad_targets (w1's, w2's) the weight gradients go into those tensors instead (added,
        or written over) and both are returned as None. Backward treats the forward's
        quantizations as straight-through (see reference.py for the numerics)."""
        ...
