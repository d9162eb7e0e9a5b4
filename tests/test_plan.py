"""The owner's plan (plan.py, tensor ops) against a plain-Python statement of the same rules,
on fresh random routings with masked slots, repeats, zero tokens and out-of-range ids."""

import pytest
import torch

from megamoe_train.plan import build_plan, max_pool_rows, owner_mask


def python_plan(ids, owner, E_l, align):
    R, T, K = ids.shape
    slots = []  # (expert, src, token, k) of every slot routed here
    for s in range(R):
        for t in range(T):
            for k in range(K):
                e = int(ids[s, t, k]) - owner * E_l
                if int(ids[s, t, k]) >= 0 and 0 <= e < E_l:
                    slots.append((e, s, t, k))
    slots.sort()
    pool, ends, counts = [], [], []
    for e in range(E_l):
        mine = [x for x in slots if x[0] == e]
        counts.append(len(mine))
        pool += [(s, t, k) for _, s, t, k in mine] + [None] * (-len(mine) % align)
        ends.append(len(pool))
    recv = sorted({(s, t) for _, s, t, _ in slots})
    return pool, ends, counts, recv


@pytest.mark.parametrize(
    "R,E,T,K,align,seed",
    [
        (1, 4, 9, 2, 4, 0),
        (2, 8, 33, 3, 8, 1),
        (4, 16, 20, 4, 16, 2),
        (3, 6, 1, 2, 1, 3),
        (2, 4, 17, 4, 1, 4),
        (4, 4, 12, 3, 2, 5),
    ],
)
def test_plan_matches_python(R, E, T, K, align, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, E + 2, (R, T, K), generator=g)  # masks, repeats and out-of-range ids
    E_l = E // R
    for owner in range(R):
        plan = build_plan(ids, owner, E_l, align)
        pool, ends, counts, recv = python_plan(ids, owner, E_l, align)
        P = max_pool_rows(R, T, K, E_l, align)
        assert plan.pool_rows == P and int(plan.num_rows) == len(pool)
        assert plan.expert_ends.tolist() == ends and plan.expert_counts.tolist() == counts
        # received rows: every (source, token) with a slot here, once, in order
        U = int(plan.num_recv)
        assert U == len(recv)
        assert list(zip(plan.recv_src[:U].tolist(), plan.recv_token[:U].tolist())) == recv
        assert (plan.recv_src[U:] == -1).all() and (plan.recv_rows[U:] == -1).all()
        # pool rows: what each holds, and the received row's slot table points back at it
        for p, entry in enumerate(pool):
            u, k = int(plan.row_recv[p]), int(plan.row_slot[p])
            if entry is None:
                assert u == -1 and k == -1
                continue
            s, t, slot = entry
            assert recv[u] == (s, t) and k == slot
            assert int(plan.recv_rows[u, k]) == p
        assert (plan.row_recv[len(pool) :] == -1).all()
        assert int((plan.recv_rows >= 0).sum()) == sum(counts)  # every slot has exactly one pool row
        blocks = [e for e in range(E_l) for _ in range((ends[e] - (ends[e - 1] if e else 0)) // align)]
        assert plan.block_expert[: len(blocks)].tolist() == blocks
        assert (plan.block_expert[len(blocks) :] == -1).all()


def test_owner_mask():
    idx = torch.tensor([[0, 5], [-1, -1], [3, 2], [7, -1]])
    assert owner_mask(idx, 4, 2).tolist() == [
        [True, False, True, False],
        [False] * 4,
        [False, True, False, False],
        [False, False, False, True],
    ]
