"""The owner's plan of one call, built from every source's published topk ids.

Two tables, both from fixed-size tensor ops (sorts, scatters, cumsums), so the same code runs
on CPU and on the GPU without waiting for the host and with shapes independent of the routing:

- received rows: every (source rank, token) with at least one slot on this owner's experts,
  in (source, token) order. Each crosses the link once: its row is pulled once and written
  into the pool row of every slot it has here (`recv_rows[u, k]`), and the owner's summed
  output for it goes home as one partial row.
- the expert-major pool: one row per (source, token, slot) routed to a local expert, each
  expert's rows in (source, token, slot) order and padded to a multiple of `align` rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Plan:
    num_recv: torch.Tensor  # int32 [1]: received rows (unique (source, token) pairs)
    recv_src: torch.Tensor  # int32 [U]: source rank of received row u (-1 past num_recv)
    recv_token: torch.Tensor  # int32 [U]: token on that source (-1 past num_recv)
    recv_rows: torch.Tensor  # int32 [U, K]: pool row of slot k of received row u, -1 if not here
    num_rows: torch.Tensor  # int32 [1]: live pool rows (sum of padded expert sizes)
    row_recv: torch.Tensor  # int32 [P]: received row a pool row holds, -1 for padding
    row_slot: torch.Tensor  # int32 [P]: its topk slot, -1 for padding
    block_expert: torch.Tensor  # int32 [P / align]: local expert of each align-row block, -1 past the end
    expert_ends: torch.Tensor  # int32 [E_local]: cumulative padded row ends (grouped-GEMM offsets)
    expert_counts: torch.Tensor  # int64 [E_local]: real rows per expert

    @property
    def pool_rows(self) -> int:
        return self.row_recv.shape[0]


def max_pool_rows(num_ranks: int, max_tokens: int, topk: int, experts_per_rank: int, align: int) -> int:
    """Pool rows for the worst case: every slot of every source here, plus each expert's padding."""
    routed = num_ranks * max_tokens * topk
    return -(-routed // align) * align + experts_per_rank * align


def build_plan(ids: torch.Tensor, owner: int, experts_per_rank: int, align: int) -> Plan:
    """ids: int [R, T, K] global expert ids of every source (-1 or out of range: no row)."""
    R, T, K = ids.shape
    dev = ids.device
    E_l = experts_per_rank
    n = R * T * K
    P = max_pool_rows(R, T, K, E_l, align)
    local = ids.long() - owner * E_l
    valid = ((ids >= 0) & (local >= 0) & (local < E_l)).flatten()
    expert = torch.where(valid, local.flatten(), E_l)  # E_l: "no expert here"

    # Pool rows: expert-major; a stable sort keeps (source, token, slot) order within an expert
    # (int32 keys: half the radix passes of int64).
    order = torch.argsort(expert.to(torch.int32), stable=True)
    sizes = torch.zeros(E_l + 1, dtype=torch.long, device=dev).scatter_add_(0, expert, torch.ones_like(expert))
    counts = sizes[:E_l]
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    count_start = torch.cumsum(counts, 0) - counts
    sorted_expert = expert[order]
    e = sorted_expert.clamp(max=E_l - 1)
    row_sorted = (ends - padded)[e] + torch.arange(n, device=dev) - count_start[e]
    row_sorted = torch.where(sorted_expert < E_l, row_sorted, P)  # P: a dump row past the end
    row_of_slot = torch.empty(n, dtype=torch.long, device=dev)
    row_of_slot[order] = row_sorted

    # Received rows: the (source, token) pairs with any slot here, in order (a cumsum numbers them).
    pair_valid = valid.view(R * T, K).any(1)
    recv_of_pair = torch.cumsum(pair_valid, 0) - 1  # meaningful where pair_valid
    num_recv = pair_valid.sum()
    dest = torch.where(pair_valid, recv_of_pair, R * T)  # R*T: a dump slot
    pair_order = torch.full((R * T + 1,), -1, dtype=torch.long, device=dev)
    pair_order.scatter_(0, dest, torch.arange(R * T, device=dev))
    pair_order = pair_order[: R * T]  # [U]: the pair of received row u, -1 past num_recv
    live = pair_order >= 0
    recv_src = torch.where(live, pair_order // T, -1)
    recv_token = torch.where(live, pair_order % T, -1)
    slot_rows = torch.where(valid, row_of_slot, -1).view(R * T, K)
    recv_rows = torch.where(live[:, None], slot_rows[pair_order.clamp(min=0)], -1)

    def per_pool_row(values: torch.Tensor) -> torch.Tensor:
        out = torch.full((P + 1,), -1, dtype=torch.int32, device=dev)
        out.scatter_(0, row_of_slot, values.to(torch.int32))
        return out[:P]

    slot_index = torch.arange(n, device=dev)
    row_recv = per_pool_row(recv_of_pair[slot_index // K])
    row_slot = per_pool_row(slot_index % K)

    starts = torch.arange(0, P, align, device=dev)
    block_e = torch.searchsorted(ends, starts, right=True)
    return Plan(
        num_recv=num_recv.reshape(1).to(torch.int32),
        recv_src=recv_src.to(torch.int32),
        recv_token=recv_token.to(torch.int32),
        recv_rows=recv_rows.to(torch.int32).contiguous(),
        num_rows=ends[-1:].to(torch.int32),
        row_recv=row_recv,
        row_slot=row_slot,
        block_expert=torch.where(block_e < E_l, block_e, -1).to(torch.int32),
        expert_ends=ends.to(torch.int32),
        expert_counts=counts,
    )


def owner_mask(topk_idx: torch.Tensor, num_ranks: int, experts_per_rank: int) -> torch.Tensor:
    """bool [T, R]: which owner ranks push a partial row for each of this rank's tokens."""
    T = topk_idx.shape[0]
    owner = torch.where(topk_idx >= 0, topk_idx.long() // experts_per_rank, num_ranks)
    mask = torch.zeros(T, num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    mask.scatter_(1, owner, True)
    return mask[:, :num_ranks]
