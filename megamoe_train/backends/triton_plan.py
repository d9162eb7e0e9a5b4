"""The owner's plan (plan.py) built on the GPU in three Triton launches, bit for bit.

plan.build_plan states the tables with ~40 torch ops (a stable argsort, scatters, cumsums):
about 1.1-1.6 ms of host time per call and 1.1-1.9 ms of small kernels at the layer shapes
(benchmarks/bench_plan.py). Here the same tables come from a counting sort over chunks of CHUNK
(source, token) pairs, reading each source's ids where they lie (its symmetric buffer, through
its base address) instead of a gathered [R, T, K] copy (one copy kernel and its launch fewer per
forward; the first read of the peers' ids after the exchange stays slow, ~95 us, whichever
kernel makes it):

1. count: per chunk, how many of its slots go to each local expert and how many of its pairs
   have any slot here (one histogram per chunk); also fills the output tables with -1;
2. scan: per expert, the exclusive prefix of its counts over the chunks (one program per
   expert), and the same for the pairs (one more program);
3. place: per chunk, each slot's pool row = its expert's first row + the expert's rows in
   earlier chunks + the earlier slots of the same expert in this chunk (flattened (pair, slot)
   order: the stable sort's order), and each pair's received-row index likewise.

Sizes come from the shapes only; nothing is read on the host (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import Plan, max_pool_rows

CHUNK = 16  # (source, token) pairs per program of the count and place kernels


@triton.jit
def _local_experts(
    src_bases, ids_offset, ok, chunk, num_pairs, T, owner, E, K: tl.constexpr, KP: tl.constexpr, CP: tl.constexpr
):
    """Local expert of each slot of one chunk, [CP, KP] (E: no row here), and the pair index.
    Pair s * T + t reads source s's ids [T, K] (int32) at src_bases[s] + ids_offset; a call
    whose ok flag is False routes nothing."""
    pairs = chunk * CP + tl.arange(0, CP)
    ks = tl.arange(0, KP)
    live = pairs < num_pairs
    m = live[:, None] & (ks[None, :] < K) & (tl.load(ok).to(tl.int32) != 0)
    base = tl.load(src_bases + tl.where(live, pairs // T, 0))
    row = base + ids_offset + (pairs % T).to(tl.int64) * (K * 4)
    g = tl.load((row[:, None] + ks[None, :] * 4).to(tl.pointer_type(tl.int32)), mask=m, other=-1)
    local = g - owner * E
    valid = m & (g >= 0) & (local >= 0) & (local < E)
    return tl.where(valid, local, E), pairs


@triton.jit
def _plan_count_kernel(
    src_bases,
    ids_offset,
    ok,
    num_pairs,
    T,
    owner,
    E,
    counts,
    pair_counts,
    fill,
    fill_len,
    fill_per_prog,
    K: tl.constexpr,
    KP: tl.constexpr,
    CP: tl.constexpr,
    NB: tl.constexpr,
    FILL_BLOCK: tl.constexpr,
):
    c = tl.program_id(0)
    e, _ = _local_experts(src_bases, ids_offset, ok, c, num_pairs, T, owner, E, K, KP, CP)
    hist = tl.histogram(tl.reshape(e, [CP * KP]), NB)  # bin E collects the slots not here
    tl.store(counts + c.to(tl.int64) * NB + tl.arange(0, NB), hist)
    pair_here = tl.max((e < E).to(tl.int32), axis=1)
    tl.store(pair_counts + c, tl.sum(pair_here, axis=0))
    # -1 into this program's share of the output tables (their unwritten entries stay -1)
    start = c.to(tl.int64) * fill_per_prog
    for off in range(0, fill_per_prog, FILL_BLOCK):
        i = start + off + tl.arange(0, FILL_BLOCK)
        tl.store(fill + i, tl.full([FILL_BLOCK], -1, tl.int32), mask=(i < fill_len) & (i < start + fill_per_prog))


@triton.jit
def _plan_scan_kernel(
    counts, pair_counts, chunk_base, pair_base, totals, num_chunks, E, NB: tl.constexpr, TILE: tl.constexpr
):
    """Program e < E: exclusive prefix of counts[:, e] over the chunks, total into totals[e].
    Program E: the same for pair_counts (total: the received-row count)."""
    e = tl.program_id(0)
    run = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, num_chunks, TILE):
        c = c0 + tl.arange(0, TILE)
        m = c < num_chunks
        if e < E:
            v = tl.load(counts + c.to(tl.int64) * NB + e, mask=m, other=0)
        else:
            v = tl.load(pair_counts + c, mask=m, other=0)
        incl = tl.cumsum(v, axis=0)
        if e < E:
            tl.store(chunk_base + c.to(tl.int64) * NB + e, run + incl - v, mask=m)
        else:
            tl.store(pair_base + c, run + incl - v, mask=m)
        run += tl.sum(v, axis=0)
    tl.store(totals + e, run)


@triton.jit
def _plan_place_kernel(
    src_bases,
    ids_offset,
    ok,
    num_pairs,
    T,
    owner,
    E,
    align,
    chunk_base,
    pair_base,
    totals,
    starts_scratch,
    row_recv,
    row_slot,
    recv_src,
    recv_token,
    recv_rows,
    num_recv,
    num_rows,
    expert_ends,
    expert_counts,
    block_expert,
    num_blocks,
    blocks_per_prog,
    K: tl.constexpr,
    KP: tl.constexpr,
    CP: tl.constexpr,
    NB: tl.constexpr,
    BB: tl.constexpr,
):
    c = tl.program_id(0)
    experts = tl.arange(0, NB)
    in_range = experts < E
    count = tl.load(totals + experts, mask=in_range, other=0)
    padded = (count + align - 1) // align * align
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded

    e, pairs = _local_experts(src_bases, ids_offset, ok, c, num_pairs, T, owner, E, K, KP, CP)
    here = e < E
    # pool row: first row of the expert + its rows in earlier chunks + earlier slots of it here
    flat_e = tl.reshape(e, [CP * KP])
    idx = tl.arange(0, CP * KP)
    earlier_same = (flat_e[:, None] == flat_e[None, :]) & (idx[None, :] < idx[:, None])
    rank = tl.reshape(tl.sum(earlier_same.to(tl.int32), axis=1), [CP, KP])
    # Every program computes the same first rows; they reach the slots through memory (a gather
    # from registers is not expressible). Concurrent stores of equal values are harmless.
    tl.store(starts_scratch + experts, starts)
    tl.debug_barrier()
    e_safe = tl.where(here, e, 0)
    first = tl.load(starts_scratch + e_safe)
    base = tl.load(chunk_base + c.to(tl.int64) * NB + e_safe)
    row = first + base + rank
    # received row: this chunk's first + the earlier pairs of the chunk that have a slot here
    pair_here = tl.max(here.to(tl.int32), axis=1)
    u = tl.load(pair_base + c) + tl.cumsum(pair_here, axis=0) - pair_here
    ks = tl.arange(0, KP)
    tl.store(row_recv + row, tl.broadcast_to(u[:, None], [CP, KP]), mask=here)
    tl.store(row_slot + row, tl.broadcast_to(ks[None, :], [CP, KP]), mask=here)
    live = pair_here > 0
    tl.store(recv_src + u, pairs // T, mask=live)
    tl.store(recv_token + u, pairs % T, mask=live)
    tl.store(
        recv_rows + u[:, None].to(tl.int64) * K + ks[None, :],
        tl.where(here, row, -1),
        mask=live[:, None] & (ks[None, :] < K),
    )

    # expert tables (program 0) and this program's share of the block -> expert table
    if c == 0:
        tl.store(expert_ends + experts, ends, mask=in_range)
        tl.store(expert_counts + experts, count.to(tl.int64), mask=in_range)
        tl.store(num_rows, tl.sum(padded, axis=0))
        tl.store(num_recv, tl.load(totals + E))
    b0 = c * blocks_per_prog
    for off in range(0, blocks_per_prog, BB):
        b = b0 + off + tl.arange(0, BB)
        after = tl.sum(((ends[None, :] <= b[:, None] * align) & in_range[None, :]).to(tl.int32), axis=1)
        tl.store(
            block_expert + b,
            tl.where(after < E, after, -1),
            mask=(b < num_blocks) & (off + tl.arange(0, BB) < blocks_per_prog),
        )


def build_plan(ids: torch.Tensor, owner: int, experts_per_rank: int, align: int) -> Plan:
    """plan.build_plan on the GPU: the same tables, bit for bit. ids: int32 [R, T, K] in one tensor."""
    R, T, K = ids.shape
    ids = ids.to(torch.int32).contiguous()
    bases = torch.tensor([ids.data_ptr() + s * T * K * 4 for s in range(R)], dtype=torch.int64, device=ids.device)
    ok = torch.ones((), dtype=torch.bool, device=ids.device)
    return _build(bases, 0, ok, R, T, K, owner, experts_per_rank, align, ids.device)


def build_plan_from_buffers(
    peer_bases: torch.Tensor, ids_region, ok: torch.Tensor, owner: int, experts_per_rank: int, align: int
) -> Plan:
    """The same from every source's published ids where they lie (region `ids_region`, int32
    [T, K], of each rank's symmetric buffer; peer_bases: their base addresses): no gathered copy
    of the ids. ok (bool device scalar) False: the call routes nothing (empty tables)."""
    T, K = ids_region.shape
    return _build(
        peer_bases, ids_region.offset, ok, peer_bases.shape[0], T, K, owner, experts_per_rank, align, peer_bases.device
    )


def _build(src_bases, ids_offset: int, ok, R: int, T: int, K: int, owner: int, E: int, align: int, dev) -> Plan:
    num_pairs = R * T
    P = max_pool_rows(R, T, K, E, align)
    num_blocks = P // align
    KP, NB = triton.next_power_of_2(K), triton.next_power_of_2(E + 1)
    num_chunks = max(1, triton.cdiv(num_pairs, CHUNK))

    # one allocation for the outputs that start at -1, one for the rest and the scratch (views)
    filled_sizes = [P, P, num_pairs, num_pairs, num_pairs * K]
    filled = torch.empty(sum(filled_sizes), dtype=torch.int32, device=dev)
    row_recv, row_slot, recv_src, recv_token, recv_rows = filled.split(filled_sizes)
    recv_rows = recv_rows.view(num_pairs, K)
    scratch_sizes = [num_chunks * NB, num_chunks * NB, num_chunks, num_chunks, NB, 1, 1, NB, E, num_blocks]
    (
        counts,
        chunk_base,
        pair_counts,
        pair_base,
        totals,
        num_recv,
        num_rows,
        starts_scratch,
        expert_ends,
        block_expert,
    ) = torch.empty(sum(scratch_sizes), dtype=torch.int32, device=dev).split(scratch_sizes)
    expert_counts = torch.empty(E, dtype=torch.int64, device=dev)

    fill_per_prog = triton.cdiv(filled.numel(), num_chunks)
    _plan_count_kernel[(num_chunks,)](
        src_bases,
        ids_offset,
        ok,
        num_pairs,
        T,
        owner,
        E,
        counts,
        pair_counts,
        filled,
        filled.numel(),
        fill_per_prog,
        K=K,
        KP=KP,
        CP=CHUNK,
        NB=NB,
        FILL_BLOCK=1024,
        num_warps=4,
    )
    _plan_scan_kernel[(E + 1,)](
        counts, pair_counts, chunk_base, pair_base, totals, num_chunks, E, NB=NB, TILE=1024, num_warps=4
    )
    blocks_per_prog = triton.cdiv(num_blocks, num_chunks)
    _plan_place_kernel[(num_chunks,)](
        src_bases,
        ids_offset,
        ok,
        num_pairs,
        T,
        owner,
        E,
        align,
        chunk_base,
        pair_base,
        totals,
        starts_scratch,
        row_recv,
        row_slot,
        recv_src,
        recv_token,
        recv_rows,
        num_recv,
        num_rows,
        expert_ends,
        expert_counts,
        block_expert,
        num_blocks,
        blocks_per_prog,
        K=K,
        KP=KP,
        CP=CHUNK,
        NB=NB,
        BB=64,
        num_warps=4,
    )
    return Plan(
        num_recv=num_recv,
        recv_src=recv_src,
        recv_token=recv_token,
        recv_rows=recv_rows,
        num_rows=num_rows,
        row_recv=row_recv,
        row_slot=row_slot,
        block_expert=block_expert,
        expert_ends=expert_ends,
        expert_counts=expert_counts,
    )
