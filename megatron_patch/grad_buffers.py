"""Megatron DDP grad buffers whose per-step zeroing leaves out the MegaMoE expert weights.

Megatron's DDP zeroes every grad buffer at the start of a step (`zero_grad_buffer`), and with
gradient-accumulation fusion mega_moe's wgrad GEMM then reads main_grad back to add into it.
For the stacked expert weights (most of an MoE model's parameters) both passes are avoidable:
the step's first backward can write the gradient over main_grad instead (megamoe_train's
`overwrite_main_grad` flag, main_grad.py). Per expert weight and step that drops the zeroing's
4-byte write and the GEMM's 4-byte read.

`overwrite_expert_main_grads(ddp_model)` switches a DDP model to that: each grad buffer's reset
zeroes everything except the main_grads of fused MegaMoE expert weights (the rest of the
buffer: other parameters, padding) and flags those weights instead. As a safety net,
`finish_grad_sync` zeroes the main_grad of any weight still flagged, i.e. one whose layer did not
run a backward this step, before the gradients are reduced or read.
"""

from __future__ import annotations

import torch

from .experts import MegaMoEExperts

__all__ = ["fused_expert_weights", "overwrite_expert_main_grads", "overwrites_expert_main_grads"]


def fused_expert_weights(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The stacked expert weights whose gradients mega_moe puts into main_grad itself (layers
    built with moe_megamoe_fuse_wgrad_accumulation)."""
    weights = []
    for m in module.modules():
        if isinstance(m, MegaMoEExperts) and getattr(m.config, "moe_megamoe_fuse_wgrad_accumulation", False):
            weights += [m.fc1_weight, m.fc2_weight]
    return weights


def _gaps(spans: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """[0, size) minus the sorted, disjoint spans."""
    gaps, pos = [], 0
    for start, end in spans:
        if start > pos:
            gaps.append((pos, start))
        pos = max(pos, end)
    if pos < size:
        gaps.append((pos, size))
    return gaps


def _views_into(t: torch.Tensor, base: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def overwrite_expert_main_grads(ddp_model) -> int:
    """Switch a megatron DistributedDataParallel model's grad buffers as the module docstring says.
    Returns the number of expert weights whose main_grad is written over (0: nothing changed)."""
    if getattr(ddp_model, "_megamoe_overwrite", None) is not None:
        return len(ddp_model._megamoe_overwrite)
    candidates = set(fused_expert_weights(ddp_model.module))
    switched: list[torch.nn.Parameter] = []
    for buffer in list(ddp_model.buffers) + list(ddp_model.expert_parallel_buffers):
        grad_data = buffer.grad_data
        if grad_data is None or (
            getattr(buffer, "param_data", None) is not None and _views_into(buffer.param_data, grad_data)
        ):
            continue  # a grad buffer that also holds parameters at times: left as megatron made it
        mine = [
            p
            for p in buffer.params
            if p in candidates
            and hasattr(p, "main_grad")
            and p.main_grad.dtype == torch.float32
            and _views_into(p.main_grad, grad_data)
        ]
        if not mine:
            continue
        spans = sorted(buffer.param_index_map[p][:2] for p in mine)
        zeroed = [grad_data[start:end] for start, end in _gaps(spans, grad_data.numel())]

        def reset(buffer=buffer, mine=tuple(mine), zeroed=tuple(zeroed)):
            for view in zeroed:
                view.zero_()
            for grad in buffer.extra_main_grads:
                grad.zero_()
            for p in mine:
                p.overwrite_main_grad = True

        buffer.reset = reset
        switched += mine
    if not switched:
        return 0
    ddp_model._megamoe_overwrite = tuple(switched)
    finish = ddp_model.finish_grad_sync

    def finish_grad_sync(*args, **kwargs):
        for p in ddp_model._megamoe_overwrite:
            if getattr(p, "overwrite_main_grad", False):  # no backward wrote it this step
                p.main_grad.zero_()
                p.overwrite_main_grad = False
        return finish(*args, **kwargs)

    ddp_model.finish_grad_sync = finish_grad_sync
    return len(switched)


def overwrites_expert_main_grads(ddp_model) -> bool:
    """Whether overwrite_expert_main_grads switched any of this DDP model's expert weights."""
    return bool(getattr(ddp_model, "_megamoe_overwrite", None))
