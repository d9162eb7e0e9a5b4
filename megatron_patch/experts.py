"""MegaMoEExperts: one MoE layer's local experts as two stacked parameters that mega_moe reads
directly.

    fc1_weight [E_local, 2I, H]  (each expert's linear_fc1.weight: gate rows, then up rows)
    fc2_weight [E_local, H, I]   (each expert's linear_fc2.weight)

No per-forward stack and no per-expert gradient scatter: the kernels read these tensors and
write their gradients. What Megatron sees stays as with its own expert modules:

- Checkpoints. `state_dict()` emits the per-expert keys of the module Megatron would have built
  for the same config (SequentialMLP `local_experts.{i}.linear_fc{1,2}.weight`, or TEGroupedMLP
  `linear_fc{1,2}.weight{i}`), plus their `_extra_state` entries; `load_state_dict` takes either
  naming (or the stacked parameter names). `sharded_state_dict()` gives each stacked parameter
  one ShardedTensorFactory that builds exactly SequentialMLP's per-expert ShardedTensors (global
  expert offsets, gate/up halves, expert-data-parallel replica ids), so dist checkpoints move
  between stock and MegaMoE layers unchanged; one factory per parameter is also what Megatron's
  optimizers need to checkpoint their state in the same per-expert keys.
- Parameter attributes (`allreduce=False` for expert-data-parallel reduction, tensor-parallel
  markers): copied from the native expert weights, so DDP buckets them with the experts and the
  optimizer puts them in the expert group.

Weight transforms (fp8 quantization) are cached by megamoe_train on the parameter's version.
Megatron's mixed-precision optimizers copy main params into these through `param.data`, which
does not bump the version; so every optimizer step (torch's global optimizer step hook, which
also fires for the torch optimizer inside Megatron's wrappers) bumps the version of every
stacked parameter: one transform per step, reused by every micro-batch and by recompute.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.transformer.module import MegatronModule
from torch.optim.optimizer import register_optimizer_step_post_hook

from .config import MegaMoEConfigError

__all__ = ["MegaMoEExperts", "invalidate_expert_weight_caches", "native_expert_weights"]

SEQUENTIAL, TE_GROUPED = "sequential_mlp", "te_grouped_mlp"

# Attributes of Megatron's expert weights (allreduce, tensor_model_parallel, partition_dim, ...) are
# copied to the stack, except per-tensor state; partition_dim names a dim of one expert's 2-D
# weight, so it moves by one on the stack.
_SKIP_ATTRS = {"main_grad", "grad_added_to_main_grad", "_version"}


def native_expert_weights(experts, num_local_experts: int) -> tuple[str, list[torch.Tensor], list[torch.Tensor]]:
    """(naming, fc1 weights, fc2 weights) of a Megatron expert module (SequentialMLP or
    TEGroupedMLP with per-expert weights)."""
    local = getattr(experts, "local_experts", None)
    if local is not None:
        return SEQUENTIAL, [e.linear_fc1.weight for e in local], [e.linear_fc2.weight for e in local]
    fc1, fc2 = getattr(experts, "linear_fc1", None), getattr(experts, "linear_fc2", None)
    if fc1 is not None and hasattr(fc1, "weight0"):
        return (
            TE_GROUPED,
            [getattr(fc1, f"weight{i}") for i in range(num_local_experts)],
            [getattr(fc2, f"weight{i}") for i in range(num_local_experts)],
        )
    raise MegaMoEConfigError(
        f"experts: unsupported expert module {type(experts).__name__} (MegaMoE takes SequentialMLP or "
        "TEGroupedMLP with per-expert weights)"
    )


def _stacked_parameter(weights: list[torch.Tensor]) -> torch.nn.Parameter:
    with torch.no_grad():
        param = torch.nn.Parameter(torch.stack([w.detach() for w in weights]), requires_grad=weights[0].requires_grad)
    for name, value in vars(weights[0]).items():
        if name in _SKIP_ATTRS:
            continue
        setattr(param, name, value + 1 if name == "partition_dim" and isinstance(value, int) and value >= 0 else value)
    return param


# Every live MegaMoEExperts; the optimizer step hook invalidates their weight transforms.
_LIVE: "weakref.WeakSet[MegaMoEExperts]" = weakref.WeakSet()
_step_hook = None


def invalidate_expert_weight_caches() -> None:
    """Mark every MegaMoE expert weight as changed, so its transform (fp8 quantization) is redone at
    the next forward. Runs after every torch optimizer step by itself; call it after writing expert
    weights through `.data` outside an optimizer step."""
    for experts in list(_LIVE):
        for p in (experts.fc1_weight, experts.fc2_weight):
            torch.autograd.graph.increment_version(p)


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    invalidate_expert_weight_caches()


def _ensure_step_hook() -> None:
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(_after_optimizer_step)


class MegaMoEExperts(MegatronModule):
    """The local experts of one MegaMoE layer, stacked (see the module docstring).

    Built from the expert module Megatron's spec made (same initialization, same RNG use as a
    stock model), which is then dropped: `MegaMoEExperts.from_native(native, ...)`.
    """

    def __init__(self, config, fc1: list[torch.Tensor], fc2: list[torch.Tensor], naming: str, ep_group, expt_dp_group):
        super().__init__(config=config)
        if naming not in (SEQUENTIAL, TE_GROUPED):
            raise ValueError(f"naming: must be {SEQUENTIAL!r} or {TE_GROUPED!r}, got {naming!r}")
        self.num_local_experts = len(fc1)
        self.naming = naming
        self.ep_group = ep_group
        self.expt_dp_group = expt_dp_group
        self.fc1_weight = _stacked_parameter(fc1)
        self.fc2_weight = _stacked_parameter(fc2)
        _LIVE.add(self)
        _ensure_step_hook()

    @classmethod
    def from_native(cls, experts, config, num_local_experts: int, ep_group, expt_dp_group) -> "MegaMoEExperts":
        naming, fc1, fc2 = native_expert_weights(experts, num_local_experts)
        return cls(config, fc1, fc2, naming, ep_group, expt_dp_group)

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1 [E_local, 2I, H], w2 [E_local, H, I]) as mega_moe takes them. Call the module
        (`experts()`), not the attributes: module hooks that make parameters ready run first
        (Megatron DDP's forward pre-hook waits for the parameter all-gather of the distributed
        optimizer under overlap_param_gather)."""
        return self.fc1_weight, self.fc2_weight

    def backward_dw(self):  # MoELayer calls it under delayed wgrad; mega_moe computes wgrad in backward
        pass

    # -- plain state dict: per-expert keys -------------------------------------------------------
    def _expert_keys(self, prefix: str, naming: str, fc: int, i: int) -> tuple[str, Optional[str]]:
        """(weight key, extra-state key or None) of expert i's fc1 / fc2 under `naming`."""
        if naming == SEQUENTIAL:
            base = f"{prefix}local_experts.{i}.linear_fc{fc}."
            return base + "weight", base + "_extra_state"
        return f"{prefix}linear_fc{fc}.weight{i}", None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # in the order the stock module emits its keys
        if self.naming == SEQUENTIAL:
            order = [(i, fc) for i in range(self.num_local_experts) for fc in (1, 2)]
        else:
            order = [(i, fc) for fc in (1, 2) for i in range(self.num_local_experts)]
        for i, fc in order:
            param = self.fc1_weight if fc == 1 else self.fc2_weight
            key, extra = self._expert_keys(prefix, self.naming, fc, i)
            destination[key] = param[i] if keep_vars else param[i].detach()
            if extra is not None:
                destination[extra] = None  # what the stock linear layers save (no extra state)
            if self.naming == TE_GROUPED and i == self.num_local_experts - 1:
                destination[f"{prefix}linear_fc{fc}._extra_state"] = None

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        used = set()
        for fc, param, own in ((1, self.fc1_weight, "fc1_weight"), (2, self.fc2_weight, "fc2_weight")):
            value = state_dict.get(prefix + own)
            if value is not None:
                used.add(prefix + own)
            else:
                for naming in (SEQUENTIAL, TE_GROUPED):
                    keys = [self._expert_keys(prefix, naming, fc, i)[0] for i in range(self.num_local_experts)]
                    if all(k in state_dict for k in keys):
                        value = torch.stack([state_dict[k].detach() for k in keys])
                        used.update(keys)
                        break
            if value is None:
                missing_keys.extend(
                    self._expert_keys(prefix, self.naming, fc, i)[0] for i in range(self.num_local_experts)
                )
                continue
            if tuple(value.shape) != tuple(param.shape):
                error_msgs.append(
                    f"size mismatch for {prefix}{own}: checkpoint {list(value.shape)}, model {list(param.shape)}"
                )
                continue
            with torch.no_grad():
                param.copy_(value)  # bumps the version: the weight transforms see the new values
        for key in state_dict:
            if not key.startswith(prefix) or key in used:
                continue
            rest = key[len(prefix) :]
            if rest.endswith("_extra_state") and (rest.startswith("local_experts.") or rest.startswith("linear_fc")):
                continue  # the stock linear layers' (empty) extra state
            if strict:
                unexpected_keys.append(key)

    # -- dist checkpoint: SequentialMLP's sharded tensors, one factory per stacked parameter ----
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        if (metadata or {}).get("singleton_local_shards"):
            raise NotImplementedError("MegaMoEExperts: singleton_local_shards checkpoints are not supported")
        ep_size, ep_rank = self.ep_group.size(), self.ep_group.rank()
        num_global = ep_size * self.num_local_experts
        first = ep_rank * self.num_local_experts
        dp_rank = self.expt_dp_group.rank() if self.expt_dp_group is not None else 0
        replica_id = (0, 0, dp_rank)  # SequentialMLP's: (PP, TP, expert-DP rank)
        ep_axis = len(sharded_offsets)

        def expert_offsets(i):
            return (*sharded_offsets, (ep_axis, first + i, num_global))

        def build(fc):
            def build_fn(key, data, replica_id, flattened_range):
                if flattened_range is not None:
                    raise NotImplementedError(
                        "MegaMoEExperts: flattened_range is not supported (nor by megatron-core 0.19's ShardedTensor)"
                    )
                out = []
                for i in range(self.num_local_experts):
                    offsets = expert_offsets(i)
                    axis = len(offsets)
                    if fc == 1:  # gate and up halves, as Megatron's SwiGLU factory splits them
                        gate, up = torch.chunk(data[i], 2, dim=0)
                        out += [
                            ShardedTensor.from_rank_offsets(
                                key, gate, *offsets, (axis, 0, 2), replica_id=replica_id, prepend_axis_num=axis
                            ),
                            ShardedTensor.from_rank_offsets(
                                key, up, *offsets, (axis, 1, 2), replica_id=replica_id, prepend_axis_num=axis
                            ),
                        ]
                    else:
                        out.append(
                            ShardedTensor.from_rank_offsets(
                                key, data[i], *offsets, replica_id=replica_id, prepend_axis_num=axis
                            )
                        )
                return out

            return build_fn

        def merge_fc1(parts):
            return torch.stack([torch.cat(parts[2 * i : 2 * i + 2], dim=0) for i in range(self.num_local_experts)])

        def merge_fc2(parts):
            return torch.stack(list(parts))

        out = {}
        for fc, param, own, merge in (
            (1, self.fc1_weight, "fc1_weight", merge_fc1),
            (2, self.fc2_weight, "fc2_weight", merge_fc2),
        ):
            key = f"{prefix}experts.linear_fc{fc}.weight"
            out[prefix + own] = ShardedTensorFactory(key, param, build(fc), merge, replica_id)
            for i in range(self.num_local_experts):
                offsets = expert_offsets(i)
                out[f"{prefix}local_experts.{i}.linear_fc{fc}._extra_state"] = ShardedObject(
                    f"{prefix}experts.linear_fc{fc}._extra_state",
                    None,
                    tuple(o[2] for o in offsets),
                    tuple(o[1] for o in offsets),
                    replica_id=replica_id,
                )
        return out
