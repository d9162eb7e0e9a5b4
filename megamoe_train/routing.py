"""Routing plans as torch tensors: the send plan of a source rank and the pool plan of an
expert owner (both computed by the C++ host code, see csrc/routing_plan.h)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _C


@dataclass
class SendPlan:
    counts: torch.Tensor  # int32 [R, E_local]: tokens announced to each owner, per local expert
    names: torch.Tensor  # int32 [R, T*K]: token*K+k grouped by local expert, -1 past the end

    def total(self, owner: int) -> int:
        return int(self.counts[owner].sum())


@dataclass
class PoolPlan:
    expert_offsets: torch.Tensor  # int32 [E_local+1], multiples of block_m
    expert_counts: torch.Tensor  # int32 [E_local], real rows per expert
    row_src: torch.Tensor  # int32 [P]: source rank of each pool row, -1 for padding
    row_pos: torch.Tensor  # int32 [P]: index into that source's name list, -1 for padding

    @property
    def num_rows(self) -> int:
        return self.row_src.numel()


def build_send_plan(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> SendPlan:
    idx = topk_idx.detach().to("cpu", torch.int64).contiguous().numpy()
    counts, names = _C.build_send_plan(idx, num_experts, num_ranks)
    return SendPlan(torch.from_numpy(counts), torch.from_numpy(names))


def build_pool_plan(recv_counts: torch.Tensor, block_m: int, owner_rank: int) -> PoolPlan:
    counts = recv_counts.detach().to("cpu", torch.int32).contiguous().numpy()
    offsets, expert_counts, row_src, row_pos = _C.build_pool_plan(counts, block_m, owner_rank)
    return PoolPlan(*(torch.from_numpy(a) for a in (offsets, expert_counts, row_src, row_pos)))
