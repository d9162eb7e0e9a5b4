"""MegaMoEMoELayer: Megatron's MoELayer with dispatch, experts, combine (and shared experts) run
as one megamoe_train.mega_moe call.

What stays Megatron's: the router (score function, group-limited top-k, aux / seq / global aux
losses, z-loss, expert bias and its token counts) and the shared-expert module
(`shared_experts.linear_fc{1,2}`). The routed experts become a MegaMoEExperts (experts.py): two
stacked parameters `experts.fc1_weight` [E_local, 2I, H] and `experts.fc2_weight` [E_local, H, I],
built from the expert module Megatron's spec made (same init), with Megatron's `allreduce`
flags, and the per-expert checkpoint keys of SequentialMLP / TEGroupedMLP, so checkpoints move
between stock and MegaMoE layers without conversion. The stock token dispatcher is still
constructed (unused).

Per forward: the router's dense (probs [T,E], routing_map [T,E]) become topk_idx [T,K] (ascending
global expert ids, -1 for empty slots) and topk_weights [T,K] fp32 gathered from probs, so the
router's gradient (and the aux losses attached to probs) flow as in the stock layer. mega_moe
reads the stacked parameters as they are and writes their gradients.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from megamoe_train import MegaMoEConfig, get_symm_buffer, mega_moe, register_layer
from megamoe_train.backends import executor_choice
from megamoe_train.graphs import GraphedMegaMoE

from .config import MegaMoEConfigError, cuda_graphs_enabled, megamoe_config, megamoe_enabled, validate_megamoe
from .experts import MegaMoEExperts, native_expert_weights
from .routing import argsort_slots, routing_map_slots

__all__ = ["MegaMoEMoELayer", "get_expert_load", "routing_to_topk"]

logger = logging.getLogger(__name__)


def routing_to_topk(probs: torch.Tensor, routing_map: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense router output -> (topk_idx int64 [T,K], topk_weights fp32 [T,K]).

    Selected experts of a row in ascending id order, -1 / weight 0 in slots a row does not fill
    (padding tokens). Differentiable in probs (a gather), so router gradients and the aux losses
    Megatron attaches to probs reach the router exactly as in the stock layer.
    """
    if routing_map.shape[1] < topk:
        raise ValueError(f"routing_map has {routing_map.shape[1]} experts < topk={topk}")
    topk_idx = routing_map_slots(routing_map, topk)  # one kernel on the GPU
    if topk_idx is None:
        topk_idx = argsort_slots(routing_map, topk)
    valid = topk_idx >= 0
    topk_weights = torch.where(valid, probs.gather(1, topk_idx.clamp_min(0)).float(), 0.0)
    return topk_idx, topk_weights


class MegaMoECall:
    """What one MoE layer needs to call mega_moe: the buffer config (fixed at the first call),
    the expert-parallel group and the modules that own the weights: a MegaMoEExperts (stacked
    parameters, read as they are), or Megatron's own expert module where Megatron keeps owning
    it (the megakernel backend, megakernel.py), whose per-expert weights are then stacked per
    forward."""

    def __init__(self, config, ep_group, experts, shared_experts, num_local_experts: int, tp_group=None):
        validate_megamoe(config)
        self.config = config
        self.ep_group = ep_group
        self.tp_group = tp_group  # the shared experts' weights are split over it (Megatron's MLP)
        self.experts = experts
        self.shared_experts = shared_experts
        self.num_local_experts = num_local_experts
        self.max_tokens = config.moe_megamoe_max_tokens_per_rank
        self._mm_configs: dict[torch.dtype, MegaMoEConfig] = {}
        self.layer_id = register_layer(ep_group)  # layers of equal shape share a buffer; this tells them apart
        self.graphed: GraphedMegaMoE | None = None  # moe_megamoe_cuda_graph: built at the first CUDA call
        self._graphs: dict[MegaMoEConfig, bool] = {}  # cuda_graphs_enabled per call config
        self.buffer = None  # the symmetric buffer of the latest call (get_peer_wait_ns reads its counter)
        self.executor: str | None = None  # the executor of the latest call config ('triton', 'reference')

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
            cfg = megamoe_config(self.config, num_max_tokens_per_rank=self.max_tokens, dtype=x.dtype)
            self._mm_configs[x.dtype] = cfg
        return cfg

    def __call__(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, recv_stats=None
    ) -> torch.Tensor:
        """x [T, H] -> y [T, H]: routed experts (+ shared experts) of this layer."""
        cfg = self.megamoe_config(x)
        buffer = get_symm_buffer(self.ep_group, cfg, device=x.device)  # shared by layers of equal shape
        self.buffer = buffer
        if isinstance(self.experts, MegaMoEExperts):
            w1, w2 = self.experts()  # through the module: its pre-hooks (param all-gather) run
        else:
            # the native modules are not called either: their pre-hooks (DDP's param all-gather wait) run here
            for module in self.experts.modules():
                if next(module.parameters(recurse=False), None) is not None:
                    _run_forward_pre_hooks(module)
            _, fc1, fc2 = native_expert_weights(self.experts, self.num_local_experts)
            w1, w2 = torch.stack(fc1), torch.stack(fc2)
        shared = {}
        if cfg.num_shared_experts:
            fc1, fc2 = self.shared_experts.linear_fc1, self.shared_experts.linear_fc2
            for module in (fc1, fc2):  # mega_moe reads their weights, never calls them
                _run_forward_pre_hooks(module)
            shared = dict(zip(("shared_w1", "shared_w2"), _full_shared_weights(fc1.weight, fc2.weight, self.tp_group)))
        # Gradient-accumulation fusion where the weights are DDP's stacked parameters (main_grad
        # set); the megakernel backend's per-forward stack has no accumulator of its own.
        fuse = (
            getattr(self.config, "moe_megamoe_fuse_wgrad_accumulation", False)
            and isinstance(self.experts, MegaMoEExperts)
            and hasattr(w1, "main_grad")
            and hasattr(w2, "main_grad")
        )
        graphs = self._graphs.get(cfg)
        if graphs is None:  # asked once per config (the auto mode reads the device)
            graphs = self._graphs[cfg] = cuda_graphs_enabled(self.config, cfg, x.device)
            self.executor, reason = executor_choice(self.config.moe_megamoe_backend, cfg, x.device)
            logger.info(
                "MegaMoE layer %d: recipe %s on %s, executor %s%s%s",
                self.layer_id,
                cfg.recipe,
                x.device,
                self.executor,
                ", CUDA graphs" if graphs else "",
                f" (the GPU executor cannot: {reason})" if reason and x.device.type == "cuda" else "",
            )
        if graphs and isinstance(self.experts, MegaMoEExperts):
            if self.graphed is None or not self.graphed.serves(buffer, w1, w2, fuse_wgrad_accumulation=fuse, **shared):
                self.graphed = GraphedMegaMoE(
                    buffer,
                    w1,
                    w2,
                    backend=self.config.moe_megamoe_backend,
                    layer_id=self.layer_id,
                    fuse_wgrad_accumulation=fuse,
                    **shared,
                )
            return self.graphed(x, topk_idx, topk_weights, recv_stats)
        return mega_moe(
            x,
            topk_idx,
            topk_weights,
            w1,
            w2,
            buffer,
            recv_stats=recv_stats,
            backend=self.config.moe_megamoe_backend,
            layer_id=self.layer_id,
            fuse_wgrad_accumulation=fuse,
            **shared,
        )


def _full_shared_weights(w1: torch.Tensor, w2: torch.Tensor, tp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared experts' whole weights from this TP rank's shards: under tensor parallelism
    Megatron's MLP holds fc1 [2I/tp, H] as this rank's [gate; up] rows and fc2 [H, I/tp] as its
    columns. Every TP rank runs the whole shared MLP on its own sequence shard, so the parameters
    stay Megatron's (checkpoint keys, optimizer layout, grad buffers as in a stock model); the
    all-gather's backward reduce-scatters the weight gradient, the sum over the TP ranks' tokens
    that stock's gathered-sequence GEMMs compute."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return w1, w2
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    tp = dist.get_world_size(tp_group)
    gathered = gather_from_sequence_parallel_region(w1, tensor_parallel_output_grad=True, group=tp_group)
    rows, hidden = w1.shape[0] // 2, w1.shape[1]
    # [tp x (gate_r; up_r)] -> [gate_0 .. gate_tp-1; up_0 .. up_tp-1]
    full_w1 = gathered.view(tp, 2, rows, hidden).transpose(0, 1).reshape(2 * tp * rows, hidden)
    full_w2 = gather_from_sequence_parallel_region(w2.t(), tensor_parallel_output_grad=True, group=tp_group).t()
    return full_w1, full_w2.contiguous()


def _run_forward_pre_hooks(module: torch.nn.Module) -> None:
    """`module`'s forward pre-hooks without its forward: there Megatron DDP waits for the
    distributed optimizer's all-gather of the module's parameters (overlap_param_gather), as it
    would before the module ran."""
    for hook_id, hook in module._forward_pre_hooks.items():
        if hook_id in module._forward_pre_hooks_with_kwargs:
            hook(module, (), {})
        else:
            hook(module, ())


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

    def __init__(
        self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer=False, name=None, **kwargs
    ):
        if not megamoe_enabled(config):
            raise MegaMoEConfigError(
                "moe_megamoe_recipe: must be set to build a MegaMoEMoELayer (None = stock MoELayer)"
            )
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
        # Megatron's expert module (built by the spec, so initialized as in a stock model) hands
        # its weights to the stacked parameters and is dropped.
        pg = pg_collection if pg_collection is not None else get_default_pg_collection()
        self.experts = MegaMoEExperts.from_native(
            self.experts, config, self.num_local_experts, self.ep_group, pg.expt_dp
        )
        device = next(self.router.parameters()).device
        self.register_buffer(
            "expert_recv_stats", torch.zeros(self.num_local_experts, dtype=torch.int64, device=device), persistent=False
        )
        self.megamoe = MegaMoECall(
            config, self.ep_group, self.experts, self.shared_experts, self.num_local_experts, tp_group=self.tp_group
        )
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


def get_peer_wait_ns(model, by_site: bool = False) -> torch.Tensor | None:
    """Nanoseconds this rank's MegaMoE barriers have waited for their expert-parallel peers so
    far: the sum of SymmBuffer.peer_wait_ns over the buffers the model's MegaMoE layers used (one
    per shape; int64 [1] on their device, a copy: no host sync). Differences between two reads
    give the wait of the steps between them: time this GPU stood idle because a peer was late
    (more rows to compute, or its host behind), which a profile of one rank cannot tell apart
    from work. None before the first MegaMoE call. by_site: int64 [len(protocol.WAIT_SITES)], the
    wait split by the barrier that waited (forward / backward, first / push barrier)."""
    buffers = {
        id(b): b
        for m in _modules(model)
        if isinstance(m, MegaMoEMoELayer)
        for b in [m.megamoe.buffer]
        if b is not None and b.alive
    }
    if not buffers:
        return None
    return sum(b.peer_wait_ns_by_site if by_site else b.peer_wait_ns for b in buffers.values()).clone()
