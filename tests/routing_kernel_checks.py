"""Checks of the router kernels (megamoe_trainer.perf.router_topk's top-k selection, megatron_patch.routing's
routing-map slots) against megatron's torch router, one device.

On CPU through Triton's interpreter (`TRITON_INTERPRET=1 python tests/routing_kernel_checks.py`,
run by tests/megatron/test_routing.py); on CUDA by tests/megatron/test_adapter_gpu.py. Scores
are fresh random values (distinct, so the chosen set is unique), outputs start poisoned.
"""

from __future__ import annotations

import os

import torch

# (T, E, topk, num_groups, group_topk): DeepSeek-V3's group-limited routing, plain top-k at the
# recipes' widths, T not a multiple of the kernel's 16 rows, and an E that is not a power of two
ROUTER_CASES = [
    (37, 256, 8, 8, 4),
    (50, 64, 6, None, None),
    (19, 8, 2, None, None),
    (33, 128, 8, None, None),
    (21, 60, 4, None, None),
    (40, 64, 4, 4, 2),
]


def _scores(T, E, gen, device):
    return torch.rand(T, E, generator=gen, device=device) + torch.randn(E, generator=gen, device=device) * 0.1


def _reference_topk(scores, topk, num_groups, group_topk):
    from megatron.core.transformer.moe import moe_utils

    if group_topk:
        return moe_utils.group_limited_topk(scores, topk, scores.shape[0], scores.shape[1], num_groups, group_topk)[1]
    return torch.topk(scores, topk, dim=1)[1]


def check_select_topk(device):
    from megamoe_trainer.perf.router_topk import select_topk

    gen = torch.Generator(device=device).manual_seed(1)
    for T, E, K, G, GK in ROUTER_CASES:
        scores = _scores(T, E, gen, device)
        got = select_topk(scores, K, G, GK)
        assert got is not None, (T, E, K, G, GK)
        want = _reference_topk(scores, K, G, GK)
        assert torch.equal(got.sort(1).values, want.sort(1).values), f"different experts chosen for {(T, E, K, G, GK)}"
        picked = scores.gather(1, got)
        assert (picked[:, :-1] >= picked[:, 1:]).all(), "not largest first"
    # shapes the kernel leaves to torch
    assert select_topk(torch.rand(4, 96, device=device), 4, 8, 2) is None  # 12 experts per group
    assert select_topk(torch.rand(4, 64, device=device, dtype=torch.float64), 4) is None
    assert select_topk(torch.rand(0, 64, device=device), 4).shape == (0, 4)
    print("select_topk ok")


def check_router_functions(device):
    """The wrapped megatron functions return what megatron's own return, gradients included."""
    from megatron.core.transformer.moe import moe_utils

    from megamoe_trainer.perf.router_topk import fused_aux_loss_scores, fused_topk_routing

    routing = fused_topk_routing(moe_utils.topk_routing_with_score_function)
    gen = torch.Generator(device=device).manual_seed(2)
    cases = [
        dict(score_function="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5, bias=True),  # DeepSeek-V3
        dict(score_function="sigmoid", num_groups=None, group_topk=None, scaling_factor=None, bias=False),
        dict(score_function="softmax", num_groups=None, group_topk=None, scaling_factor=None, bias=False),
        dict(score_function="softmax", num_groups=None, group_topk=None, scaling_factor=None, bias=False, pre=True),
        dict(score_function="sqrtsoftplus", num_groups=8, group_topk=4, scaling_factor=None, bias=True),
    ]
    T, E, K = 45, 256, 8
    for case in cases:
        logits = torch.randn(T, E, generator=gen, device=device)
        bias = torch.randn(E, generator=gen, device=device) * 0.05 if case["bias"] else None
        grad_out = torch.randn(T, E, generator=gen, device=device)
        results = []
        for fn in (moe_utils.topk_routing_with_score_function, routing):
            x = logits.clone().requires_grad_(True)
            probs, routing_map = fn(
                x,
                K,
                use_pre_softmax=case.get("pre", False),
                num_groups=case["num_groups"],
                group_topk=case["group_topk"],
                scaling_factor=case["scaling_factor"],
                score_function=case["score_function"],
                expert_bias=bias,
            )
            (probs * grad_out).sum().backward()
            results.append((probs.detach(), routing_map, x.grad))
        (p0, m0, g0), (p1, m1, g1) = results
        assert torch.equal(m0, m1), f"routing maps differ: {case}"
        assert torch.allclose(p0, p1, rtol=1e-6, atol=0), f"probs differ: {case}"
        assert torch.allclose(g0, g1, rtol=1e-5, atol=1e-7), f"logit gradients differ: {case}"

    # softmax without pre-softmax ranks the logits in their own dtype (moe_router_dtype): fp64 logits that
    # are equal in fp32, and bf16 logits whose group sums tie in bf16 but not in fp32, as megatron picks them
    logits = torch.tensor([[1.0, 1.0 + 1e-12, -3.0, -4.0]], dtype=torch.float64, device=device)
    for fn in (moe_utils.topk_routing_with_score_function, routing):
        assert fn(logits, 1, score_function="softmax")[1][0].nonzero().flatten().tolist() == [1], "fp64 logits"
    logits = (torch.randn(512, 64, generator=gen, device=device) * 2).to(torch.bfloat16)
    m0 = moe_utils.topk_routing_with_score_function(logits, 4, num_groups=8, group_topk=2, score_function="softmax")[1]
    m1 = routing(logits, 4, num_groups=8, group_topk=2, score_function="softmax")[1]
    assert torch.equal(m0, m1), f"bf16 group-limited routing maps differ in {(m0 != m1).any(1).sum().item()} rows"

    aux = fused_aux_loss_scores(moe_utils.compute_routing_scores_for_aux_loss)
    for score_function in ("sigmoid", "softmax"):
        logits = torch.randn(T, E, generator=gen, device=device)
        padding = torch.rand(T, generator=gen, device=device) < 0.2
        for padding_mask in (None, padding):
            m0, s0 = moe_utils.compute_routing_scores_for_aux_loss(logits, K, score_function, padding_mask=padding_mask)
            m1, s1 = aux(logits, K, score_function, padding_mask=padding_mask)
            assert m1.dtype == m0.dtype and torch.equal(m0, m1), f"aux routing maps differ: {score_function}"
            assert torch.equal(s0, s1)
    print("router functions ok")


def check_routing_map_slots(device):
    from megatron_patch.moe_layer import routing_to_topk
    from megatron_patch.routing import argsort_slots, routing_map_slots

    gen = torch.Generator(device=device).manual_seed(3)
    for T, E, K in [(53, 256, 8), (17, 60, 6), (16, 8, 2), (1, 128, 8)]:
        counts = torch.randint(0, K + 1, (T,), generator=gen, device=device)
        order = torch.rand(T, E, generator=gen, device=device).argsort(1)
        routing_map = torch.zeros(T, E, dtype=torch.bool, device=device)
        routing_map.scatter_(1, order, torch.arange(E, device=device).expand(T, E) < counts[:, None])
        got = routing_map_slots(routing_map, K)
        assert got is not None and torch.equal(got, argsort_slots(routing_map, K)), (T, E, K)
        probs = torch.rand(T, E, generator=gen, device=device, requires_grad=True)
        idx, weights = routing_to_topk(probs, routing_map, K)
        assert torch.equal(idx, got)
        want = torch.where(got >= 0, probs.detach().gather(1, got.clamp_min(0)), 0.0)
        assert torch.equal(weights.detach(), want)
        weights.sum().backward()
        assert torch.equal(probs.grad, routing_map.float()), "gradient reaches exactly the routed probs"
    assert routing_map_slots(torch.zeros(0, 64, dtype=torch.bool, device=device), 4).shape == (0, 4)
    print("routing_map_slots ok")


def run_all(device):
    check_select_topk(device)
    check_router_functions(device)
    check_routing_map_slots(device)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    run_all(torch.device("cpu"))
    print("all routing checks passed")
