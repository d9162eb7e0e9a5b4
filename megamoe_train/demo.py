"""A small expert-parallel training run of MegaMoELayer on CPU processes (gloo + /dev/shm).

Each rank holds half of the experts. A learned top-k router and the MegaMoE layer are trained
to imitate a fixed random "teacher" MoE, so the loss falls as routing and experts specialise.
Prints step, loss, tokens/s and every expert's received tokens (the load-balancing stat).

    python -m megamoe_train.demo [--ranks 2] [--steps 30]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .config import MegaMoEConfig
from .launch import spawn
from .layer import MegaMoELayer


def _route(logits: torch.Tensor, topk: int):
    probs = logits.float().softmax(-1)
    weights, idx = probs.topk(topk, dim=-1)
    return idx, weights / weights.sum(-1, keepdim=True)


def _train(rank: int, world: int, args):
    torch.manual_seed(1234)  # same teacher and initial router on every rank
    cfg = MegaMoEConfig(
        num_experts=args.experts,
        hidden=args.hidden,
        intermediate=args.intermediate,
        topk=args.topk,
        num_max_tokens_per_rank=args.tokens,
        dtype=torch.float32,
        block_m=16,
    )
    teacher_router = torch.randn(args.hidden, args.experts)
    teacher_w1 = torch.randn(args.experts, 2 * args.intermediate, args.hidden) * args.hidden**-0.5
    teacher_w2 = torch.randn(args.experts, args.hidden, args.intermediate) * args.intermediate**-0.5

    layer = MegaMoELayer(cfg)  # experts [rank*E/R, (rank+1)*E/R) of the world group
    router = torch.nn.Linear(args.hidden, args.experts, bias=False)
    torch.manual_seed(1234 + rank)  # each rank sees its own tokens
    opt = torch.optim.Adam([*layer.parameters(), *router.parameters()], lr=args.lr)
    mine = slice(rank * layer.num_local_experts, (rank + 1) * layer.num_local_experts)
    with torch.no_grad():
        teacher = MegaMoELayer(cfg, buffer=layer.buffer)
        teacher.w1.copy_(teacher_w1[mine])
        teacher.w2.copy_(teacher_w2[mine])

    if rank == 0:
        print(
            f"[demo] {world} ranks x {layer.num_local_experts} experts, {args.tokens} tokens/rank, "
            f"hidden {args.hidden}, intermediate {args.intermediate}, top-{args.topk}",
            flush=True,
        )
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(args.tokens, args.hidden)
        with torch.no_grad():
            target = teacher(x, *_route(x @ teacher_router, args.topk))
        teacher.reset_expert_recv_stats()
        idx, weights = _route(router(x), args.topk)
        y = layer(x, idx, weights)
        loss = F.mse_loss(y, target)
        opt.zero_grad()
        loss.backward()
        for p in router.parameters():  # expert grads are local; only the router is replicated
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()

        loss_all = loss.detach().clone()
        dist.all_reduce(loss_all)
        stats = [torch.zeros_like(layer.expert_recv_stats) for _ in range(world)]
        dist.all_gather(stats, layer.reset_expert_recv_stats())
        if rank == 0 and (step % args.log_every == 0 or step == 1):
            load = torch.cat(stats)
            elapsed = time.perf_counter() - start
            print(
                f"step {step:4d} | loss {loss_all.item() / world:.5f} | "
                f"{step * args.tokens * world / elapsed:8.0f} tokens/s | "
                f"tokens per expert {load.tolist()} (max/mean {load.max().item() / load.float().mean().item():.2f})",
                flush=True,
            )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--log-every", type=int, default=15)
    args = p.parse_args(argv)
    spawn(_train, args.ranks, args=(args,))


if __name__ == "__main__":
    main()
