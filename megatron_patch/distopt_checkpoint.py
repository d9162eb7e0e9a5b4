"""Distributed-optimizer checkpoints that move between stock and MegaMoE expert layers.

Megatron's DistributedOptimizer writes its parameter state (fp32 master weights, Adam moments)
in one of these formats (`metadata["distrib_optim_sharding_type"]`):

- `fully_reshardable`: keyed by model parameter through the model's sharded state dict. A
  MegaMoE stacked expert weight's ShardedTensorFactory builds SequentialMLP's per-expert tensors
  (experts.py), so the state is stored per expert, as a stock model stores it: nothing to do.
- `dp_reshardable` (Megatron-LM's default): the optimizer's grad-buffer space, one flat tensor
  per bucket. Stock buffers hold one weight per expert, MegaMoE buffers two stacked weights per
  layer, so the same offsets mean different experts. A MegaMoE optimizer therefore writes and
  reads these tensors in the layout the stock model of the same config has: that layout is
  computed with Megatron's own layout function (`_compute_per_buffer_param_layout`) on the stock
  per-expert weights (shapes only), and each DP shard of a stacked weight maps to its pieces of
  the stock buckets. Checkpoints of either kind load into the other exactly, also with
  megatron-core alone on the stock side.
- `dp_zero_gather_scatter` (deprecated) stores the gathered grad-buffer space as one object, and
  `fully_sharded_model_space` passes `flattened_range`, which megatron-core 0.19's own
  ShardedTensor rejects (for a stock model as well): a MegaMoE optimizer raises
  DistOptCheckpointError for them, when saving and when loading.

`install()` (run on import of megatron_patch) wraps DistributedOptimizer's sharded_state_dict
and its dp_reshardable save and load for that; an optimizer without MegaMoE expert weights takes
Megatron's code unchanged. It also fixes, for every DistributedOptimizer, three defects of
megatron-core 0.19.2's torch-Adam path (no TE / Apex, as on CPU) that make a load inexact or fail
for any model:

- `load_state_dict` gives all parameters one shared `step` tensor, which torch then increments
  once per parameter at each step (the first step after a resume had the bias correction of
  step 1 + the number of parameters): each parameter gets its own copy.
- The `fully_reshardable` load hands `_set_main_param_and_optimizer_states` no `step` (it is in
  param_groups), which that function requires where torch Adam keeps one per parameter
  (KeyError): the wrapper passes the parameter's own, which load_state_dict has just set.
- A fresh optimizer (no step taken) cannot build a load's sharded state dict (its state_dict()
  asserts on a step): megatron's own dummy step runs first, its values then overwritten.
"""

from __future__ import annotations

import torch

from .experts import SEQUENTIAL, MegaMoEExperts

__all__ = ["DistOptCheckpointError", "SUPPORTED_FORMATS", "install", "stock_grad_buffer_layout"]

SUPPORTED_FORMATS = ("dp_reshardable", "fully_reshardable")
_REFUSED = {
    "dp_zero_gather_scatter": "it stores the gathered grad-buffer order, which stock and MegaMoE layers do not share",
    "fully_sharded_model_space": "megatron-core 0.19's ShardedTensor rejects the flattened_range it passes",
}
_DEFAULT_FORMAT = "fully_sharded_model_space"  # DistributedOptimizer.sharded_state_dict's default


class DistOptCheckpointError(RuntimeError):
    """A distributed-optimizer checkpoint format a MegaMoE model cannot save or load exactly."""


def _stacks(opt) -> dict[int, tuple[MegaMoEExperts, int]]:
    """{id(stacked weight): (its MegaMoEExperts, 1 or 2)} of the optimizer's model chunks."""
    out = {}
    for chunk in getattr(opt, "model_chunks", None) or ():
        for m in chunk.modules():
            if isinstance(m, MegaMoEExperts):
                out[id(m.fc1_weight)] = (m, 1)
                out[id(m.fc2_weight)] = (m, 2)
    return out


def _segments(buffer, stacks) -> tuple[list[torch.Tensor], dict[int, list[tuple[int, int, torch.Tensor]]]]:
    """(the buffer's parameter list as the stock model has it, {id(real param): [(start, end,
    stock param)]}): a stacked weight becomes its per-expert weights (shape-only meta tensors) in
    the stock module's registration order, each over its span [start, end) of the stacked weight
    flattened; any other parameter is itself over its whole span."""
    stock, segments = [], {}
    params = buffer.params
    k = 0
    while k < len(params):
        p = params[k]
        if id(p) not in stacks:
            stock.append(p)
            segments[id(p)] = [(0, p.numel(), p)]
            k += 1
            continue
        experts, fc = stacks[id(p)]
        if fc != 1 or k + 1 == len(params) or params[k + 1] is not experts.fc2_weight:
            raise DistOptCheckpointError(
                "dp_reshardable: a MegaMoE layer's fc1_weight and fc2_weight are not adjacent in the grad "
                "buffer, so its stock layout cannot be derived; save with 'fully_reshardable'"
            )
        n = experts.num_local_experts
        per_expert = {
            w: [torch.empty(w.shape[1:], dtype=w.dtype, device="meta") for _ in range(n)]
            for w in (experts.fc1_weight, experts.fc2_weight)
        }
        if experts.naming == SEQUENTIAL:  # local_experts.{i}.linear_fc1, .linear_fc2
            order = [(w, i) for i in range(n) for w in (experts.fc1_weight, experts.fc2_weight)]
        else:  # TEGroupedMLP: linear_fc1.weight{i}, then linear_fc2.weight{i}
            order = [(w, i) for w in (experts.fc1_weight, experts.fc2_weight) for i in range(n)]
        stock += [per_expert[w][i] for w, i in order]
        for w in (experts.fc1_weight, experts.fc2_weight):
            size = w[0].numel()
            segments[id(w)] = [(i * size, (i + 1) * size, per_expert[w][i]) for i in range(n)]
        k += 2
    return stock, segments


def _layout(params, bucket_size, buffer):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DistributedOptimizer._compute_per_buffer_param_layout(
        params, bucket_size, buffer.data_parallel_world_size, buffer.ddp_config
    )


def stock_grad_buffer_layout(buffer, stacks):
    """(stock layout, segments) of one grad buffer holding MegaMoE stacked weights: the
    PerBufferParamLayout Megatron would have built for the stock model's per-expert weights
    (param_index_map keyed by the stock params of `segments`, see _segments). The bucket size is
    the one that reproduces the buffer's own layout from its own parameters."""
    real = {id(p): v for p, v in buffer.param_index_map.items()}
    for bucket_size in dict.fromkeys((buffer.ddp_config.bucket_size, None)):
        mine = _layout(buffer.params, bucket_size, buffer)
        if {id(p): v for p, v in mine.param_index_map.items()} == real and list(mine.bucket_indices) == list(
            buffer.bucket_indices
        ):
            stock, segments = _segments(buffer, stacks)
            return _layout(stock, bucket_size, buffer), segments
    raise DistOptCheckpointError(
        "dp_reshardable: this grad buffer's layout is not the one megatron-core's layout function gives, so the "
        "stock layout of its MegaMoE expert weights cannot be derived; save with 'fully_reshardable'"
    )


class _Translation:
    """One optimizer's translated buffers: {gbuf_idx: (stock layout, segments)}."""

    def __init__(self, opt, stacks):
        self.buffers = {}
        for gbuf_idx, buffer in enumerate(opt.buffers):
            if any(id(p) in stacks for p in buffer.params):
                self.buffers[gbuf_idx] = stock_grad_buffer_layout(buffer, stacks)

    def per_bucket_numel(self, opt, padded: bool):
        """The optimizer's per_bucket_numel(_unpadded), with the stock values for translated buffers."""
        out = []
        for gbuf_idx, own in enumerate(opt.per_bucket_numel if padded else opt.per_bucket_numel_unpadded):
            if gbuf_idx not in self.buffers:
                out.append(own)
                continue
            layout = self.buffers[gbuf_idx][0]
            numel = [e - s for s, e in layout.bucket_indices] if padded else list(layout.per_bucket_numel_unpadded)
            out.append({dtype: numel for dtype in own})
        return out


def _translation(opt):
    stacks = _stacks(opt)
    return _Translation(opt, stacks) if stacks else None


def _translated_buffer_state(opt, gbuf_idx, layout, segments, is_loading):
    """The sharded state of one translated buffer: a list of pieces, each a dict of ShardedTensors
    (one per state key) at a span of a stock bucket tensor, plus where it belongs locally
    (`target`: (bucket index, param index in buffer.params, start, end) in the param's DP
    shard, or None for the stock layout's padding)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    buffer = opt.buffers[gbuf_idx]
    ((dtype, buckets),) = opt.gbuf_ranges[gbuf_idx].items()
    stock_start = [s for s, _ in layout.bucket_indices]
    unpadded = list(layout.per_bucket_numel_unpadded)
    position = {id(p): i for i, p in enumerate(buffer.params)}
    replica_id = (opt.distributed_optimizer_instance_id, 0, 0)
    key_prefix = f"optimizer.distributed.dp_group_idx_{opt.data_parallel_group_idx}.gbuf_idx_{gbuf_idx}.dtype_{dtype}"

    def sharded(bucket, key, data, offset):
        return ShardedTensor(
            f"{key_prefix}.bucket_idx_{bucket}.{key}",
            data,
            data.dtype,
            data.shape,
            (unpadded[bucket],),
            (offset,),
            axis_fragmentations=None,
            flattened_range=None,
            allow_shape_mismatch=False,
            replica_id=replica_id,
        )

    pieces, keys, like = [], None, {}  # like: a state tensor per key (dtype and device of the padding)
    for bucket_idx, bucket in enumerate(buckets):
        for model_param, ranges in bucket["param_map"].items():
            state = opt._get_main_param_and_optimizer_states(model_param)
            keys = keys or [k for k in state if k != "step"]
            like = like or {k: state[k] for k in keys}
            lo_shard, hi_shard = ranges["param"].start, ranges["param"].end
            for start, end, stock_param in segments[id(model_param)]:
                lo, hi = max(lo_shard, start), min(hi_shard, end)
                if lo >= hi:
                    continue
                s, _, stock_bucket = layout.param_index_map[stock_param]
                offset = s - stock_start[stock_bucket] + lo - start
                piece = {}
                for k in keys:
                    data = state[k].detach()[lo - lo_shard : hi - lo_shard]
                    piece[k] = sharded(stock_bucket, k, data.clone() if is_loading else data, offset)
                piece["target"] = LocalNonpersistentObject(
                    (bucket_idx, position[id(model_param)], lo - lo_shard, hi - lo_shard)
                )
                pieces.append(piece)
    if opt.data_parallel_group.rank() == 0 and keys:  # the stock layout's alignment gaps, as stock saves them
        spans = {}
        for s, e, b in layout.param_index_map.values():
            spans.setdefault(b, []).append((s - stock_start[b], e - stock_start[b]))
        for b, used in spans.items():
            pos = 0
            for s, e in sorted(used) + [(unpadded[b], unpadded[b])]:
                if s > pos:
                    piece = {k: sharded(b, k, like[k].new_empty(s - pos), pos) for k in keys}
                    piece["target"] = LocalNonpersistentObject(None)
                    pieces.append(piece)
                pos = max(pos, e)
    return {dtype: {"megamoe_stock_layout_pieces": pieces}}


def _check_format(opt, fmt: str, loading: bool) -> None:
    if fmt in _REFUSED and _stacks(opt):
        verb = "load" if loading else "save"
        raise DistOptCheckpointError(
            f"distributed-optimizer checkpoint format {fmt!r}: a model with MegaMoE layers cannot {verb} it "
            f"({_REFUSED[fmt]}); use metadata['distrib_optim_sharding_type'] = 'dp_reshardable' or "
            "'fully_reshardable' (both move between stock and MegaMoE layers exactly)"
        )


def install() -> None:
    """Wrap DistributedOptimizer.sharded_state_dict, sharded_param_state_dp_reshardable,
    load_parameter_state_from_dp_reshardable, load_state_dict and
    _set_main_param_and_optimizer_states (idempotent)."""
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if getattr(DistributedOptimizer, "_megamoe_checkpoint_translation", False):
        return
    original_sharded_state_dict = DistributedOptimizer.sharded_state_dict
    original_dp_reshardable = DistributedOptimizer.sharded_param_state_dp_reshardable
    original_load_dp_reshardable = DistributedOptimizer.load_parameter_state_from_dp_reshardable
    original_load_state_dict = DistributedOptimizer.load_state_dict
    original_set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            current = self._get_main_param_and_optimizer_states(model_param)
            if "step" in current:
                tensors = {**tensors, "step": current["step"]}
        return original_set_states(self, model_param, tensors)

    def load_state_dict(self, state_dict):
        original_load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = step.clone()  # one tensor per parameter, as torch Adam keeps it

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, sharding_type=None, metadata=None):
        fmt = sharding_type or (metadata or {}).get("distrib_optim_sharding_type", _DEFAULT_FORMAT)
        _check_format(self, fmt, is_loading)
        if is_loading and not distrib_optimizer.HAVE_APEX_OR_TE and len(self.optimizer.state) == 0:
            # a fresh torch Adam has no state, and state_dict() asserts on its step: megatron's
            # own dummy step creates it (every value is then overwritten by the load)
            self._init_optimizer_states_with_dummy_values()
        return original_sharded_state_dict(
            self,
            model_sharded_state_dict if model_sharded_state_dict is not None else {},
            is_loading,
            sharding_type,
            metadata,
        )

    def sharded_param_state_dp_reshardable(self, model_sharded_state_dict, is_loading=False, metadata=None):
        state = original_dp_reshardable(self, model_sharded_state_dict, is_loading, metadata)
        translation = _translation(self)
        if translation is None or not translation.buffers:
            return state
        from dataclasses import replace

        for key, padded in (("per_bucket_numel", True), ("per_bucket_numel_unpadded", False)):
            state[key] = replace(state[key], data=translation.per_bucket_numel(self, padded))
        for gbuf_idx, (layout, segments) in translation.buffers.items():
            state[gbuf_idx] = _translated_buffer_state(self, gbuf_idx, layout, segments, is_loading)
        return state

    def load_parameter_state_from_dp_reshardable(self, state_dict):
        translation = _translation(self)
        if translation is None or not translation.buffers:
            return original_load_dp_reshardable(self, state_dict)
        want = translation.per_bucket_numel(self, padded=False)
        got = state_dict.get("per_bucket_numel_unpadded")
        if got is not None and got != want:
            raise DistOptCheckpointError(
                f"dp_reshardable: the checkpoint's buckets hold {got} elements, this model's (in the stock layout) "
                f"{want}: a different model or DP size; 'fully_reshardable' checkpoints reshard"
            )
        for gbuf_idx, ranges in enumerate(self.gbuf_ranges):
            ((dtype, buckets),) = ranges.items()
            loaded = state_dict[gbuf_idx][dtype]
            if gbuf_idx not in translation.buffers:  # as megatron loads it
                for bucket_idx, bucket in enumerate(buckets):
                    items = [t for t in loaded[bucket_idx] if not t["padding"]]
                    assert len(items) == len(bucket["param_map"]), (len(items), len(bucket["param_map"]))
                    for src, model_param in zip(items, bucket["param_map"]):
                        self._set_main_param_and_optimizer_states(model_param, src)
                continue
            params = self.buffers[gbuf_idx].params
            filled = {}  # param index -> (model param, {state key: its DP shard, being filled})
            for piece in loaded["megamoe_stock_layout_pieces"]:
                if piece["target"] is None:
                    continue
                _, index, lo, hi = piece["target"]
                model_param = params[index]
                if index not in filled:
                    current = self._get_main_param_and_optimizer_states(model_param)
                    filled[index] = (
                        model_param,
                        {k: (v.detach().clone() if k != "step" else v) for k, v in current.items()},
                    )
                for k, v in piece.items():
                    if k != "target":
                        filled[index][1][k][lo:hi] = v
            for model_param, tensors in filled.values():
                self._set_main_param_and_optimizer_states(model_param, tensors)

    DistributedOptimizer.sharded_state_dict = sharded_state_dict
    DistributedOptimizer.load_state_dict = load_state_dict
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    DistributedOptimizer.sharded_param_state_dp_reshardable = sharded_param_state_dp_reshardable
    DistributedOptimizer.load_parameter_state_from_dp_reshardable = load_parameter_state_from_dp_reshardable
    DistributedOptimizer._megamoe_checkpoint_translation = True
