"""MegaMoELayer across processes: parameters, stats, gradients, shared experts."""

import pytest
import torch
from dense_moe import dense_moe

from megamoe_train import MegaMoEConfig, MegaMoELayer


def layer_step(rank, world, shared):
    torch.manual_seed(0)
    cfg = MegaMoEConfig(
        num_experts=8,
        hidden=32,
        intermediate=16,
        topk=2,
        num_max_tokens_per_rank=64,
        block_m=8,
        dtype=torch.float32,
        num_shared_experts=shared,
    )
    layer = MegaMoELayer(cfg)
    E_l = cfg.num_experts // world
    assert tuple(layer.w1.shape) == (E_l, 32, 32) and tuple(layer.w2.shape) == (E_l, 32, 16)
    assert list(layer.local_expert_ids) == list(range(rank * E_l, (rank + 1) * E_l))
    assert (layer.shared_w1 is not None) == bool(shared)
    assert "expert_recv_stats" not in layer.state_dict()  # a running stat, not checkpointed

    # gather every rank's weights for the dense oracle
    import torch.distributed as dist

    def gather(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.detach().contiguous())
        return torch.cat(parts)

    W1, W2 = gather(layer.w1), gather(layer.w2)
    g = torch.Generator().manual_seed(rank + 10)
    total = torch.zeros(E_l, dtype=torch.int64)
    for step in range(2):
        x = torch.randn(50, 32, generator=g, requires_grad=True)
        idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(50)])
        w = torch.rand(50, 2, generator=g)
        y = layer(x, idx, w)
        y.square().sum().backward()
        shared_w = (layer.shared_w1, layer.shared_w2) if shared else ()
        ref = dense_moe(x.detach(), idx, w, W1, W2, cfg, *[t.detach() for t in shared_w])
        assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
        all_idx = gather(idx)
        total += torch.stack([(all_idx == e).sum() for e in layer.local_expert_ids])
        assert torch.equal(layer.expert_recv_stats, total)
    assert layer.w1.grad is not None and layer.w1.grad.abs().sum() > 0
    assert x.grad is not None
    assert torch.equal(layer.reset_expert_recv_stats(), total)
    assert layer.expert_recv_stats.sum() == 0


@pytest.mark.parametrize("shared", [0, 1])
def test_layer_forward_backward_stats(rank_pools, shared):
    rank_pools(2).run(layer_step, shared)


def layer_rejects_buffer_of_other_group(rank, world):
    import torch.distributed as dist

    from megamoe_train import get_symm_buffer

    cfg = MegaMoEConfig(
        num_experts=4, hidden=16, intermediate=8, topk=1, num_max_tokens_per_rank=4, block_m=4, dtype=torch.float32
    )
    buf = get_symm_buffer(None, cfg, timeout_s=20)
    sub = dist.new_group([0, 1], backend="gloo")
    with pytest.raises(ValueError, match="different process group"):
        MegaMoELayer(cfg, process_group=sub, buffer=buf)


def test_layer_rejects_buffer_of_other_group(rank_pools):
    rank_pools(2).run(layer_rejects_buffer_of_other_group)


def layer_rejects_params_dtype_forward_cannot_take(rank, world):
    cfg = MegaMoEConfig(
        num_experts=4, hidden=16, intermediate=8, topk=1, num_max_tokens_per_rank=4, block_m=4, dtype=torch.float32
    )
    with pytest.raises(ValueError, match="^params_dtype"):  # accepted before; the first forward then failed
        MegaMoELayer(cfg, params_dtype=torch.float64)
    assert MegaMoELayer(cfg, params_dtype=torch.bfloat16).w1.dtype == torch.bfloat16


def test_layer_rejects_params_dtype_forward_cannot_take(rank_pools):
    rank_pools(2).run(layer_rejects_params_dtype_forward_cannot_take)


def test_demo_runs_and_learns(capfd):
    from megamoe_train import demo

    demo.main(["--steps", "60", "--log-every", "59"])
    out = capfd.readouterr().out
    losses = [float(line.split("loss ")[1].split()[0]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) >= 2 and losses[-1] < losses[0], out
    assert "tokens per expert" in out
