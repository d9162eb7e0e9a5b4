"""The C++ routing plans against plain-Python versions, on fresh random routings."""

import pytest
import torch

from megamoe_train.routing import build_pool_plan, build_send_plan


def python_send_plan(idx, E, R):
    T, K = idx.shape
    El = E // R
    counts = [[0] * El for _ in range(R)]
    lists = [[[] for _ in range(El)] for _ in range(R)]
    for name in range(T * K):
        e = int(idx.view(-1)[name])
        if e >= 0:
            counts[e // El][e % El] += 1
            lists[e // El][e % El].append(name)
    names = [[n for lst in lists[o] for n in lst] for o in range(R)]
    return counts, names


def python_pool_plan(counts, block_m, owner):
    R, El = len(counts), len(counts[0])
    offsets, row_src, row_pos = [0], [], []
    base = [0] * R
    for e in range(El):
        queues = {s: list(range(base[s], base[s] + counts[s][e])) for s in range(R)}
        for s in range(R):
            base[s] += counts[s][e]
        total = sum(counts[s][e] for s in range(R))
        src = (owner + e) % R
        placed = 0
        while placed < total:
            if queues[src]:
                row_src.append(src)
                row_pos.append(queues[src].pop(0))
                placed += 1
            src = (src + 1) % R
        pad = -total % block_m
        row_src += [-1] * pad
        row_pos += [-1] * pad
        offsets.append(offsets[-1] + total + pad)
    return offsets, row_src, row_pos


@pytest.mark.parametrize("seed", range(6))
def test_send_and_pool_plans_match_python(seed):
    g = torch.Generator().manual_seed(seed)
    R = [1, 2, 4, 8][seed % 4]
    E = R * int(torch.randint(1, 5, (1,), generator=g))
    K = int(torch.randint(1, E + 1, (1,), generator=g))
    T = int(torch.randint(0, 50, (1,), generator=g))
    idx = torch.randint(-1, E, (T, K), generator=g)  # repeats and masks allowed
    send = build_send_plan(idx, E, R)
    counts, names = python_send_plan(idx, E, R)
    assert send.counts.tolist() == counts
    for o in range(R):
        n = send.total(o)
        assert send.names[o, :n].tolist() == names[o]
        assert (send.names[o, n:] == -1).all()

    block_m = [1, 4, 16][seed % 3]
    recv = torch.randint(0, 20, (R, E // R), generator=g, dtype=torch.int32)
    owner = seed % R
    plan = build_pool_plan(recv, block_m, owner)
    offsets, row_src, row_pos = python_pool_plan(recv.tolist(), block_m, owner)
    assert plan.expert_offsets.tolist() == offsets
    assert plan.expert_counts.tolist() == recv.sum(0).tolist()
    assert plan.row_src.tolist() == row_src
    assert plan.row_pos.tolist() == row_pos


def test_round_robin_interleaves_sources():
    recv = torch.tensor([[3], [2]], dtype=torch.int32)  # 2 sources, 1 local expert
    plan = build_pool_plan(recv, block_m=8, owner_rank=1)
    # owner 1 starts at source 1, alternates, then drains source 0; pads to 8 rows
    assert plan.row_src.tolist() == [1, 0, 1, 0, 0, -1, -1, -1]
    assert plan.row_pos.tolist() == [0, 0, 1, 1, 2, -1, -1, -1]


def test_send_plan_rejects_out_of_range_ids():
    with pytest.raises(ValueError, match="expert id 9"):
        build_send_plan(torch.tensor([[0, 9]]), 8, 2)
    with pytest.raises(ValueError, match="multiple"):
        build_send_plan(torch.tensor([[0, 1]]), 8, 3)
