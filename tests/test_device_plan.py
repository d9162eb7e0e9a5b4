"""The device-built pool plan (GPU backend) equals the host plan of the reference protocol."""

import pytest
import torch

from megamoe_train.backends.device_plan import build_device_plan
from megamoe_train.routing import build_pool_plan, build_send_plan


def _host_plan(ids, owner, E, R, block_m):
    K = ids.shape[2]
    sends = [build_send_plan(ids[s], E, R) for s in range(R)]
    counts = torch.stack([sends[s].counts[owner] for s in range(R)])
    plan = build_pool_plan(counts, block_m, owner)
    src = plan.row_src.long()
    names = torch.full_like(src, -1)
    for i in range(src.numel()):
        if src[i] >= 0:
            names[i] = sends[src[i]].names[owner, plan.row_pos[i]]
    return plan, src, names // K, names % K


@pytest.mark.parametrize("R,E,T,K,block_m,seed", [(1, 4, 9, 2, 4, 0), (2, 8, 33, 3, 8, 1), (4, 16, 20, 4, 16, 2), (3, 6, 0, 2, 4, 3)])
def test_device_plan_matches_host_plan(R, E, T, K, block_m, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(R * T)]).view(R, T, K) if T else torch.zeros(R, 0, K, dtype=torch.long)
    ids[torch.rand(ids.shape, generator=g) < 0.15] = -1  # masked slots
    E_l = E // R
    pool_rows = R * T * K + E_l * block_m
    for owner in range(R):
        plan, src, tok, slot = _host_plan(ids, owner, E, R, block_m)
        dp = build_device_plan(ids, owner, E_l, block_m, pool_rows)
        P = plan.num_rows
        assert int(dp.num_rows) == P
        assert torch.equal(dp.expert_counts, plan.expert_counts.long())
        assert torch.equal(dp.expert_ends.long(), plan.expert_offsets[1:].long())
        assert torch.equal(dp.row_src[:P].long(), src)
        live = src >= 0
        assert torch.equal(dp.row_token[:P].long()[live], tok[live])
        assert torch.equal(dp.row_slot[:P].long()[live], slot[live])
        assert bool((dp.row_src[P:] == -1).all())
        blocks = torch.repeat_interleave(torch.arange(E_l), (plan.expert_offsets[1:] - plan.expert_offsets[:-1]).long() // block_m)
        assert torch.equal(dp.block_expert[: P // block_m].long(), blocks)
        assert bool((dp.block_expert[P // block_m :] == -1).all())
