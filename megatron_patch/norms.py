"""Megatron's local (torch) norms under sequence parallelism, for model specs without Transformer
Engine or Apex (the CPU tests, `megamoe-train`'s local spec).

Megatron's WrappedTorchNorm refuses sequence_parallel: its weights would not be marked for the
tensor-parallel gradient all-reduce that finalize_model_grads gives sequence-parallel weights.
SequenceParallelTorchNorm builds the same torch norm and marks its weights `sequence_parallel`,
as TENorm and Apex's FusedLayerNorm do: each TP rank normalizes its own sequence shard and the
weight gradients are summed over the TP ranks.
"""

from __future__ import annotations

import copy
import dataclasses

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

__all__ = ["SequenceParallelTorchNorm", "sequence_parallel_norms"]


class SequenceParallelTorchNorm:
    """WrappedTorchNorm that also builds under sequence parallelism (weights marked for the TP all-reduce)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if not config.sequence_parallel:
            return WrappedTorchNorm(config, hidden_size, eps, **kwargs)
        plain = copy.copy(config)  # a shallow copy: no __post_init__ checks re-run
        plain.sequence_parallel = False
        norm = WrappedTorchNorm(plain, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm


def sequence_parallel_norms(spec):
    """A copy of a layer / block spec with every WrappedTorchNorm replaced by
    SequenceParallelTorchNorm (anything else, Transformer Engine's or Apex's norms, unchanged)."""
    if spec is WrappedTorchNorm:
        return SequenceParallelTorchNorm
    if isinstance(spec, (list, tuple)):
        return type(spec)(sequence_parallel_norms(s) for s in spec)
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(
            spec, module=sequence_parallel_norms(spec.module), submodules=sequence_parallel_norms(spec.submodules)
        )
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {}
        for f in dataclasses.fields(spec):
            if not f.init:
                continue
            value = getattr(spec, f.name)
            new = sequence_parallel_norms(value)
            if new is not value:
                changes[f.name] = new
        return dataclasses.replace(spec, **changes) if changes else spec
    return spec
