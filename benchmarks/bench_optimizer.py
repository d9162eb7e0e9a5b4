"""The optimizer step's GPU passes of the DeepSeek-V3 proxy on one GPU (2-GPU recipe, EP=2):
AdamW on fp32 main params plus the bf16 model params, two ways:

  torch    torch's fused AdamW (`fused=True`, what the trainer used) then megatron's main -> model
           copy (`_foreach_copy_` fp32 -> bf16, what fused_optimizer._scale runs);
  kernel   megamoe_trainer.perf.adam_kernel.adamw_update per tensor, writing the bf16 copy itself.

  python benchmarks/bench_optimizer.py [--scale 1.0]

Parameters shaped like one rank's of the proxy (5 MoE layers of 128 local experts with fc1
[1024, 2048] and fc2 [2048, 512], stacked per layer; a dense layer, attention, embeddings and the
output layer: ~2.3 G parameters, 41 GB with state), `--scale` shrinks the expert count. Floor:
bytes moved (kernel: 16 read + 14 written per parameter) over the HBM bandwidth of a 4 GiB
device-to-device copy in the same run. Both ways start from the same state and must agree
(params within 1e-6 relative, each bf16 copy its param rounded) before timing.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import hbm_bandwidth, median_ms  # noqa: E402

from megamoe_trainer.perf.adam_kernel import adamw_update  # noqa: E402

KW = dict(lr=2.2e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def proxy_shapes(scale: float) -> list[tuple[int, ...]]:
    experts = max(1, int(128 * scale))
    h, i, ffn, vocab, layers = 2048, 512, 8192, 32768, 6
    shapes = [(vocab, h), (vocab, h)]  # embedding, output layer
    for _ in range(layers):
        shapes += [(3 * h, h), (h, h), (h,), (h,)]  # qkv, proj, two norms
    shapes += [(2 * ffn, h), (h, ffn)]  # the dense first layer
    for _ in range(layers - 1):
        shapes += [(experts, 2 * i, h), (experts, h, i), (256, h), (2 * i, h), (h, i)]  # experts, router, shared
    return shapes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = proxy_shapes(args.scale)
    n = sum(torch.Size(s).numel() for s in shapes)
    bw = hbm_bandwidth()
    print(f"{len(shapes)} tensors, {n / 1e9:.3f} G parameters; HBM copy bandwidth {bw / 1e12:.2f} TB/s")

    def state():
        params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g) * 0.02) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=g) * 1e-3
        return params

    params = state()
    model = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    adam = torch.optim.AdamW(params, **KW, fused=True)
    adam.step()  # state allocated

    def torch_way():
        adam.step()
        torch._foreach_copy_(model, [p.detach() for p in params])

    steps = {"count": 1}
    moments = [(adam.state[p]["exp_avg"], adam.state[p]["exp_avg_sq"]) for p in params]

    def kernel_way():
        steps["count"] += 1
        for p, (m, v), c in zip(params, moments, model):
            adamw_update(
                p.data,
                p.grad,
                m,
                v,
                c,
                step=steps["count"],
                lr=KW["lr"],
                beta1=KW["betas"][0],
                beta2=KW["betas"][1],
                eps=KW["eps"],
                weight_decay=KW["weight_decay"],
            )

    # agreement: one step each way from the same state
    saved = [(p.detach().clone(), m.clone(), v.clone()) for p, (m, v) in zip(params, moments)]
    torch_way()
    want = [(p.detach().clone(), c.clone()) for p, c in zip(params, model)]
    for p, (m, v), (p0, m0, v0) in zip(params, moments, saved):
        p.data.copy_(p0), m.copy_(m0), v.copy_(v0)
    adam.state[params[0]]["step"].fill_(1.0)
    kernel_way()
    for p, c, (wp, wc) in zip(params, model, want):
        rel = ((p.detach().double() - wp.double()).norm() / wp.double().norm()).item()
        # each copy is its own param rounded (the params agree to ~1e-8, not bit for bit)
        assert (
            rel < 1e-6 and torch.equal(c, p.detach().to(torch.bfloat16)) and torch.equal(wc, wp.to(torch.bfloat16))
        ), rel
    del saved, want

    torch_ms = median_ms(torch_way, iters=10)
    kernel_ms = median_ms(kernel_way, iters=10)
    kernel_bytes = 30 * n
    floor_ms = kernel_bytes / bw * 1e3
    torch_bytes = 28 * n + 6 * n  # Adam, then the copy reads fp32 and writes bf16
    print("| way | ms | GB moved | GB/s | x floor |")
    print("| --- | ---: | ---: | ---: | ---: |")
    print(
        f"| torch fused AdamW + copy | {torch_ms:.2f} | {torch_bytes / 1e9:.1f} | "
        f"{torch_bytes / torch_ms / 1e6:.0f} | {torch_ms / floor_ms:.2f} |"
    )
    print(
        f"| kernel (AdamW writing the copy) | {kernel_ms:.2f} | {kernel_bytes / 1e9:.1f} | "
        f"{kernel_bytes / kernel_ms / 1e6:.0f} | {kernel_ms / floor_ms:.2f} |"
    )
    print(f"floor (kernel bytes / copy bandwidth): {floor_ms:.2f} ms")


if __name__ == "__main__":
    main()
