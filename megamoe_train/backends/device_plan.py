"""The owner's pool plan built on the device, from every source's published topk ids.

Same plan as the host code (csrc/routing_plan.cpp): pool rows are expert-major, each expert
padded to block_m, and within an expert the sources are taken row by row, round-robin,
starting at source (owner + expert) % R; a source's rows keep their (token, k) order. Built
from fixed-size tensor ops only (two stable sorts, scatters, cumsums), so nothing waits for
the host and the shapes do not depend on the routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DevicePlan:
    num_rows: torch.Tensor  # int32 [1]: live pool rows (sum of padded expert sizes)
    row_src: torch.Tensor  # int32 [P]: source rank of each pool row, -1 for padding
    row_token: torch.Tensor  # int32 [P]: token on the source rank
    row_slot: torch.Tensor  # int32 [P]: topk slot k of that token
    block_expert: torch.Tensor  # int32 [P / block_m]: local expert of each block, -1 past the end
    expert_ends: torch.Tensor  # int32 [E_local]: cumulative padded row ends (grouped-GEMM offsets)
    expert_counts: torch.Tensor  # int64 [E_local]: real rows per expert


def build_device_plan(ids: torch.Tensor, owner: int, experts_per_rank: int, block_m: int, pool_rows: int) -> DevicePlan:
    """ids: int [R, T, K] global expert ids of every source (-1 or out of range = no row)."""
    R, T, K = ids.shape
    dev = ids.device
    E_l = experts_per_rank
    n = R * T * K
    ids = ids.long()
    local = ids - owner * E_l
    valid = (ids >= 0) & (local >= 0) & (local < E_l)
    local = torch.where(valid, local, E_l).flatten()  # E_l = "no expert here"
    src = torch.arange(R, device=dev).repeat_interleave(T * K)
    valid = valid.flatten()

    # Rank of each row among its (expert, source) group, in (token, k) order.
    group = local * R + src
    order1 = torch.argsort(group, stable=True)
    group_sizes = torch.zeros(E_l * R + R, dtype=torch.long, device=dev).scatter_add_(0, group, torch.ones_like(group))
    group_start = torch.cumsum(group_sizes, 0) - group_sizes
    index_in_group = torch.empty_like(group)
    index_in_group[order1] = torch.arange(n, device=dev) - group_start[group[order1]]

    # Pool order: expert, then round (index in group), then source rotated to start at (owner+e)%R.
    rotated = (src - owner - local) % R
    key = (local * (T * K) + index_in_group) * R + rotated
    order = torch.argsort(key, stable=True)

    counts = group_sizes[: E_l * R].view(E_l, R).sum(1)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    count_start = torch.cumsum(counts, 0) - counts
    sorted_local = local[order]
    sorted_valid = valid[order]
    e = sorted_local.clamp(max=E_l - 1)
    row = (ends - padded)[e] + torch.arange(n, device=dev) - count_start[e]
    row = torch.where(sorted_valid, row, pool_rows)  # one dump row past the end for non-rows

    def scatter(values):
        out = torch.full((pool_rows + 1,), -1, dtype=torch.int32, device=dev)
        out.scatter_(0, row, values.to(torch.int32))
        return out[:pool_rows]

    flat = order
    row_src = scatter(flat // (T * K))
    row_token = scatter((flat // K) % T)
    row_slot = scatter(flat % K)

    starts = torch.arange(0, pool_rows, block_m, device=dev)
    block_e = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_e < E_l, block_e, -1).to(torch.int32)
    return DevicePlan(
        num_rows=ends[-1:].to(torch.int32),
        row_src=row_src,
        row_token=row_token,
        row_slot=row_slot,
        block_expert=block_expert,
        expert_ends=ends.to(torch.int32),
        expert_counts=counts,
    )
