"""Megatron's router top-k path per MoE layer call, torch vs the kernels (megamoe_trainer.perf.router_topk,
megatron_patch.routing), one GPU.

What a training step runs per MoE layer call with megatron's router and no Transformer Engine:
`topk_routing_with_score_function` (score function, expert bias, group-limited top-k, dense
probs and map), `compute_routing_scores_for_aux_loss` (the sequence-wise aux loss's own top-k),
the adapter's `routing_to_topk` (dense map -> per-token expert slots), and the backward of the
weights into the logits. Timed forward+backward with CUDA events (median), both ways in one run:
- torch: megatron's functions as shipped, routing_to_topk's argsort;
- fused: the same functions with the selections from select_topk, the slots from one kernel.

    python benchmarks/bench_router.py [--tokens 8192] [--experts 256] [--topk 8] [--groups 8 --group-topk 4]

Defaults: the DeepSeek-V3 proxy's router (sigmoid scores, expert bias, 8 groups, top-4 groups,
scaling 2.5; 8192 tokens per GPU per micro-batch).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import median_ms  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-topk", type=int, default=4)
    p.add_argument("--score-function", default="sigmoid")
    args = p.parse_args()

    from megatron.core.transformer.moe import moe_utils

    from megamoe_trainer.perf.router_topk import fused_aux_loss_scores, fused_topk_routing
    from megatron_patch.routing import argsort_slots, routing_map_slots

    dev = torch.device("cuda")
    T, E, K = args.tokens, args.experts, args.topk
    groups = dict(num_groups=args.groups, group_topk=args.group_topk) if args.group_topk else {}
    logits = torch.randn(T, E, device=dev)
    bias = torch.randn(E, device=dev) * 0.01 if args.score_function == "sigmoid" else None

    variants = {
        # torch: routing_to_topk's slots before the kernel (its CPU path)
        "torch": (
            moe_utils.topk_routing_with_score_function,
            moe_utils.compute_routing_scores_for_aux_loss,
            argsort_slots,
        ),
        "fused": (
            fused_topk_routing(moe_utils.topk_routing_with_score_function),
            fused_aux_loss_scores(moe_utils.compute_routing_scores_for_aux_loss),
            routing_map_slots,
        ),
    }
    print(f"# {torch.cuda.get_device_name(dev)}: T={T} E={E} top-{K} {args.score_function} groups={groups or None}")
    print("| variant | forward ms | forward+backward ms | selection only ms |")
    print("| --- | ---: | ---: | ---: |")
    maps = {}
    for name, (routing, aux, slots) in variants.items():

        def step(backward: bool):
            x = logits.detach().requires_grad_(backward)
            probs, routing_map = routing(
                x, K, scaling_factor=2.5, score_function=args.score_function, expert_bias=bias, **groups
            )
            aux_map, aux_scores = aux(x, K, args.score_function)
            idx = slots(routing_map, K)
            weights = torch.where(idx >= 0, probs.gather(1, idx.clamp_min(0)), 0.0)
            if backward:
                (weights.sum() + aux_scores.sum()).backward()
            return routing_map, aux_map

        def select():
            with torch.no_grad():
                routing(logits, K, scaling_factor=2.5, score_function=args.score_function, expert_bias=bias, **groups)

        maps[name] = step(False)
        fwd = median_ms(lambda: step(False), iters=50, warmup=5)
        fwdbwd = median_ms(lambda: step(True), iters=50, warmup=5)
        sel = median_ms(select, iters=50, warmup=5)
        print(f"| {name} | {fwd:.3f} | {fwdbwd:.3f} | {sel:.3f} |", flush=True)
    same = all(torch.equal(a, b) for a, b in zip(maps["torch"], maps["fused"]))
    print(f"routing maps identical (router and aux loss): {same}")


if __name__ == "__main__":
    main()
