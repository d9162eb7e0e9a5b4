"""The routing map of Megatron's router turned into per-token expert slots in one Triton kernel
on the GPU (`routing_map_slots`): what the MegaMoE layer's `routing_to_topk` runs instead of a
stable argsort of the [T, E] map to list each token's experts in ascending id order.

The kernel runs on CUDA tensors (and on CPU ones under TRITON_INTERPRET=1, for the tests);
elsewhere, or for shapes it does not cover, `argsort_slots` gives the same slots in torch ops.
`kernels_run_on`, ROWS and MAX_EXPERTS are shared with the trainer's fused router top-k
(`megamoe_trainer/perf/router_topk.py`), which stands in for Transformer Engine's fused router.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: the torch paths run
    triton = None

__all__ = ["routing_map_slots", "argsort_slots", "kernels_run_on", "ROWS", "MAX_EXPERTS"]

ROWS = 16  # tokens per program
MAX_EXPERTS = 1024  # one row of scores lives in registers


def kernels_run_on(t: torch.Tensor) -> bool:
    """Whether this module's Triton kernels can run on `t`: a CUDA tensor, or any under TRITON_INTERPRET=1."""
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1")


if triton is not None:

    @triton.jit
    def _routing_map_slots_kernel(
        routing_map, out, T, E, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, ROWS: tl.constexpr
    ):
        """out[t, j] = the j-th expert (ascending) with routing_map[t, e] set, -1 past the last."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, EP)
        live = rows < T
        m = (
            tl.load(
                routing_map + rows[:, None].to(tl.int64) * E + cols[None, :],
                mask=live[:, None] & (cols[None, :] < E),
                other=0,
            )
            != 0
        )
        rank = tl.cumsum(m.to(tl.int32), axis=1) - 1  # slot of each set entry
        slots = tl.arange(0, KP)
        at = m[:, None, :] & (rank[:, None, :] == slots[None, :, None])  # [ROWS, KP, EP]
        expert = tl.sum(tl.where(at, cols[None, None, :], 0), axis=2)
        filled = tl.sum(at.to(tl.int32), axis=2) > 0
        tl.store(
            out + rows[:, None].to(tl.int64) * K + slots[None, :],
            tl.where(filled, expert, -1).to(tl.int64),
            mask=live[:, None] & (slots[None, :] < K),
        )


def argsort_slots(routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """routing_map_slots in torch ops (a stable descending argsort of the map): any device."""
    idx = torch.argsort(routing_map.to(torch.int8), dim=1, descending=True, stable=True)[:, :topk]
    return torch.where(routing_map.gather(1, idx), idx, -1)


def routing_map_slots(routing_map: torch.Tensor, topk: int) -> torch.Tensor | None:
    """int64 [T, topk]: each row's set experts of a bool routing map [T, E] in ascending id order,
    -1 after them (what a stable descending argsort of the map gives, cut to topk). None where
    the kernel does not apply."""
    if routing_map.dim() != 2 or routing_map.dtype != torch.bool or not kernels_run_on(routing_map):
        return None
    T, E = routing_map.shape
    if E > MAX_EXPERTS:
        return None
    routing_map = routing_map.contiguous()
    out = torch.empty(T, topk, dtype=torch.int64, device=routing_map.device)
    if T:
        _routing_map_slots_kernel[(triton.cdiv(T, ROWS),)](
            routing_map.view(torch.uint8),
            out,
            T,
            E,
            K=topk,
            KP=triton.next_power_of_2(topk),
            EP=triton.next_power_of_2(E),
            ROWS=ROWS,
            num_warps=4,
        )
    return out
