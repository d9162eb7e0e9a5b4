"""MegaMoEMoELayer: Megatron's MoELayer with dispatch, experts, combine (and shared experts) run
as one megamoe_train.mega_moe call.

What stays Megatron's: the router (score function, group-limited top-k, aux / seq / global aux
losses, z-loss, expert bias and its token counts), the expert modules (SequentialMLP
`experts.local_experts.{i}.linear_fc{1,2}`, or TEGroupedMLP `experts.linear_fc{1,2}.weight{i}`)
and the shared-expert module (`shared_experts.linear_fc{1,2}`), which keep owning the
parameters. So parameter names, `allreduce` flags, DDP buckets, optimizer groups and sharded
checkpoint keys are exactly Megatron's, and checkpoints move between stock and MegaMoE layers
without conversion. The stock token dispatcher is still constructed (unused).

Per forward: the router's dense (probs [T,E], routing_map [T,E]) become topk_idx [T,K] (ascending
global expert ids, -1 for empty slots) and topk_weights [T,K] fp32 gathered from probs, so the
router's gradient (and the aux losses attached to probs) flow as in the stock layer. The native
expert weights are stacked with torch.stack (autograd reaches every native parameter; the
weight cache sees a new tensor every step, so optimizer writes through `.data` are never missed).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_layer import MoELayer

from megamoe_train import MegaMoEConfig, get_symm_buffer, mega_moe

from .config import MegaMoEConfigError, megamoe_enabled, validate_megamoe

__all__ = ["MegaMoEMoELayer", "get_expert_load", "routing_to_topk"]


def routing_to_topk(probs: torch.Tensor, routing_map: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense router output -> (topk_idx int64 [T,K], topk_weights fp32 [T,K]).

    Selected experts of a row in ascending id order, -1 / weight 0 in slots a row does not fill
    (padding tokens). Differentiable in probs (a gather), so router gradients and the aux losses
    Megatron attaches to probs reach the router exactly as in the stock layer.
    """
    if routing_map.shape[1] < topk:
        raise ValueError(f"routing_map has {routing_map.shape[1]} experts < topk={topk}")
    idx = torch.argsort(routing_map.to(torch.int8), dim=1, descending=True, stable=True)[:, :topk]
    valid = routing_map.gather(1, idx)
    topk_weights = probs.gather(1, idx).float() * valid
    topk_idx = torch.where(valid, idx, torch.full_like(idx, -1))
    return topk_idx, topk_weights


def _expert_weights(experts, num_local_experts: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """fc1 ([2I, H], gate rows first) and fc2 ([H, I]) weights of each local expert, as owned by
    Megatron's expert module."""
    local = getattr(experts, "local_experts", None)
    if local is not None:  # SequentialMLP
        return [e.linear_fc1.weight for e in local], [e.linear_fc2.weight for e in local]
    fc1, fc2 = getattr(experts, "linear_fc1", None), getattr(experts, "linear_fc2", None)
    if fc1 is not None and hasattr(fc1, "weight0"):  # TEGroupedMLP (TE GroupedLinear)
        return (
            [getattr(fc1, f"weight{i}") for i in range(num_local_experts)],
            [getattr(fc2, f"weight{i}") for i in range(num_local_experts)],
        )
    raise MegaMoEConfigError(
        f"experts: unsupported expert module {type(experts).__name__} (MegaMoE takes SequentialMLP or "
        "TEGroupedMLP with per-expert weights)"
    )


class MegaMoECall:
    """What one MoE layer needs to call mega_moe: the buffer config (fixed at the first call),
    the expert-parallel group and the native modules that own the weights."""

    def __init__(self, config, ep_group, experts, shared_experts, num_local_experts: int):
        validate_megamoe(config)
        self.config = config
        self.ep_group = ep_group
        self.experts = experts
        self.shared_experts = shared_experts
        self.num_local_experts = num_local_experts
        self.max_tokens = config.moe_megamoe_max_tokens_per_rank
        self._mm_configs: dict[torch.dtype, MegaMoEConfig] = {}

    def _agree_max_tokens(self, tokens: int, device: torch.device) -> int:
        t = torch.tensor([tokens], dtype=torch.int64, device=device)
        if self.ep_group is not None and dist.get_world_size(self.ep_group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ep_group)
        return max(1, int(t.item()))

    def megamoe_config(self, x: torch.Tensor) -> MegaMoEConfig:
        cfg = self._mm_configs.get(x.dtype)
        if cfg is None:
            if self.max_tokens is None:  # collective, once per layer (every rank runs the same layers)
                self.max_tokens = self._agree_max_tokens(x.shape[0], x.device)
            c = self.config
            shared = c.moe_shared_expert_intermediate_size
            cfg = MegaMoEConfig(
                num_experts=c.num_moe_experts,
                hidden=c.hidden_size,
                intermediate=c.moe_ffn_hidden_size,
                topk=c.moe_router_topk,
                num_max_tokens_per_rank=self.max_tokens,
                recipe=c.moe_megamoe_recipe,
                num_shared_experts=1 if shared else 0,
                shared_intermediate=shared if shared else None,
                activation_clamp=c.activation_func_clamp_value,
                dtype=x.dtype,
            )
            self._mm_configs[x.dtype] = cfg
        return cfg

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, recv_stats=None) -> torch.Tensor:
        """x [T, H] -> y [T, H]: routed experts (+ shared experts) of this layer."""
        cfg = self.megamoe_config(x)
        buffer = get_symm_buffer(self.ep_group, cfg, device=x.device)  # shared by layers of equal shape
        fc1, fc2 = _expert_weights(self.experts, self.num_local_experts)
        shared = {}
        if cfg.num_shared_experts:
            shared = dict(shared_w1=self.shared_experts.linear_fc1.weight, shared_w2=self.shared_experts.linear_fc2.weight)
        return mega_moe(
            x,
            topk_idx,
            topk_weights,
            torch.stack(fc1),
            torch.stack(fc2),
            buffer,
            recv_stats=recv_stats,
            backend=self.config.moe_megamoe_backend,
            **shared,
        )


def _inside_backward() -> bool:
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


class MegaMoEMoELayer(MoELayer):
    """MoELayer whose dispatch + experts + combine + shared experts are one mega_moe call.

    Built through the layer spec (see megatron_patch.spec) with a config whose
    `moe_megamoe_recipe` is set. The forward (router, recompute wrapper) is MoELayer's; only
    the stages after routing are replaced.

    expert_recv_stats: int64 [num_local_experts] buffer (not in checkpoints): rows each of this
    rank's experts received, accumulated over forwards (the recompute pass of activation
    recompute, which runs inside backward, is not counted again). Read/reset with get_expert_load().
    """

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer=False, name=None, **kwargs):
        if not megamoe_enabled(config):
            raise MegaMoEConfigError("moe_megamoe_recipe: must be set to build a MegaMoEMoELayer (None = stock MoELayer)")
        validate_megamoe(config)
        super().__init__(
            config,
            submodules=submodules,
            layer_number=layer_number,
            pg_collection=pg_collection,
            is_mtp_layer=is_mtp_layer,
            name=name,
            **kwargs,
        )
        device = next(self.router.parameters()).device
        self.register_buffer(
            "expert_recv_stats", torch.zeros(self.num_local_experts, dtype=torch.int64, device=device), persistent=False
        )
        self.megamoe = MegaMoECall(config, self.ep_group, self.experts, self.shared_experts, self.num_local_experts)
        self._hidden_shape = None

    # -- MoELayer stages ------------------------------------------------------------------------
    def shared_experts_compute(self, hidden_states):
        return None  # shared experts run inside mega_moe, on the same tokens

    def preprocess(self, hidden_states, probs, routing_map):
        self._hidden_shape = hidden_states.shape
        topk = routing_to_topk(probs, routing_map, self.config.moe_router_topk)
        return hidden_states.reshape(-1, hidden_states.shape[-1]), topk

    def dispatch(self, hidden_states, probs):
        return hidden_states, probs

    def routed_experts_compute(self, hidden_states, probs):
        topk_idx, topk_weights = probs
        stats = self.expert_recv_stats if self._counts_this_pass() else None
        if stats is not None and stats.device != hidden_states.device:
            stats = None
        return self.megamoe(hidden_states, topk_idx, topk_weights, recv_stats=stats), None

    def combine(self, output):
        return output

    def postprocess(self, output, shared_expert_output):
        assert shared_expert_output is None
        return output.view(self._hidden_shape)

    # -- helpers ---------------------------------------------------------------------------------
    def _counts_this_pass(self) -> bool:
        """False for the recompute pass of activation recompute (it runs inside backward, and the
        first forward of the same tokens counted them already)."""
        return not _inside_backward()

    def reset_expert_recv_stats(self) -> torch.Tensor:
        out = self.expert_recv_stats.clone()
        self.expert_recv_stats.zero_()
        return out


def _modules(model) -> Iterable[torch.nn.Module]:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        yield from chunk.modules()


def get_expert_load(model, reset: bool = True) -> torch.Tensor:
    """Rows each of this rank's local experts received, per MegaMoE layer, since the last reset.

    model: a module or a list of model chunks (virtual pipeline). Returns int64
    [num_megamoe_layers_on_this_rank, num_local_experts] in module order (local experts are the
    global ids [ep_rank*E_local, (ep_rank+1)*E_local)); counts include every slot routed to
    the expert, summed over forwards. For global per-expert load, all_gather the result over
    the expert-parallel group. reset=True zeroes the counters.
    """
    layers = [m for m in _modules(model) if isinstance(m, MegaMoEMoELayer)]
    if not layers:
        return torch.zeros(0, 0, dtype=torch.int64)
    load = torch.stack([m.expert_recv_stats.clone() for m in layers])
    if reset:
        for m in layers:
            m.expert_recv_stats.zero_()
    return load
