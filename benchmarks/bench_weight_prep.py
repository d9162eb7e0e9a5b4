"""Per-step cost of preparing expert weights for mega_moe in the Megatron adapter, before and
after the stacked expert parameters (issue 9), one GPU, same run.

  python benchmarks/bench_weight_prep.py [--experts 128] [--hidden 2048] [--inter 512] [--layers 5]

Default shapes: one GPU's share of the DeepSeek-V3 proxy (recipes/deepseek_v3_proxy_2gpu_*.yaml:
256 experts over EP=2, H=2048, I=512, 5 MoE layers), bf16 parameters.

before, per layer and forward (the recompute pass runs it again):
  stack   torch.stack of every local expert's fc1 and fc2 (a new tensor each time, so the weight
          cache never hits) and
  fp8     quantization + interleave of the stacked weights (transform_weights, uncached), plus
          what the backward reads: since the fp8 dgrads (issue 12) the transposed e4m3 copies
          w1_t / w2_t, made inside transform_weights, instead of bf16 compute copies;
  bf16    a copy + gate/up interleave of the stacked weights (the old native transform).
after: the stacked parameters are passed as they are; bf16 reads them in place (no work), fp8
quantizes once per optimizer step (the same transform, once instead of per forward).
Prints milliseconds per layer for each piece and the per-step totals of both.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from megamoe_train import MegaMoEConfig
from megamoe_train.weights import interleave_gate_up, transform_weights, clear_weight_cache


def bench(fn, iters=10, warmup=2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=128, help="local experts per GPU")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--layers", type=int, default=5, help="MoE layers per GPU")
    args = ap.parse_args()
    E, H, I = args.experts, args.hidden, args.inter
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    fc1 = [torch.randn(2 * I, H, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(E)]
    fc2 = [torch.randn(H, I, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(E)]
    w1, w2 = torch.stack(fc1), torch.stack(fc2)
    cfg = {r: MegaMoEConfig(num_experts=2 * E, hidden=H, intermediate=I, topk=8, num_max_tokens_per_rank=8192, recipe=r) for r in ("bf16", "fp8")}

    def stack():
        torch.stack(fc1), torch.stack(fc2)

    def fp8_transform():
        clear_weight_cache()
        transform_weights(w1, w2, cfg["fp8"])  # incl. the dgrads' transposed copies

    def bf16_old_transform():  # what the native transform did before: copy + interleave in chunks of 8
        interleave_gate_up(w1.to(torch.bfloat16, copy=True), 8), w2.to(torch.bfloat16, copy=True).contiguous()

    def bf16_new_transform():
        clear_weight_cache()
        ew = transform_weights(w1, w2, cfg["bf16"])
        assert ew.w1.data_ptr() == w1.data_ptr()

    t = {
        "stack": bench(stack),
        "fp8_transform": bench(fp8_transform),
        "bf16_old_transform": bench(bf16_old_transform),
        "bf16_new_transform": bench(bf16_new_transform),
    }
    gb = (w1.numel() + w2.numel()) * 2 / 1e9
    print(f"{torch.cuda.get_device_name()} | E_local={E} H={H} I={I} layers={args.layers} | expert weights {gb:.2f} GB bf16 per layer")
    for k, v in t.items():
        print(f"  {k:20s} {v:8.3f} ms per layer")
    L = args.layers
    for passes, label in ((1, "no recompute"), (2, "with recompute")):
        before_bf16 = L * passes * (t["stack"] + t["bf16_old_transform"])
        before_fp8 = L * passes * (t["stack"] + t["fp8_transform"])
        after_fp8 = L * t["fp8_transform"]
        print(f"  per step, 1 micro-batch, {label}: bf16 before {before_bf16:.2f} ms, after {L * t['bf16_new_transform']:.3f} ms | "
              f"fp8 before {before_fp8:.2f} ms, after {after_fp8:.2f} ms")


if __name__ == "__main__":
    main()
