"""The steps of a forward before the pull, old path against new, one GPU, one run:

  python benchmarks/bench_plan.py [--shapes S1,S4,P]

- plan: plan.build_plan (~40 torch ops, the reference executor's) vs the device plan
  (backends/triton_plan.py, three Triton launches), both from the ids of every rank (EP2,
  uniform routing), at the fp8 (128) and bf16 (16) row alignments;
- input storage (fp8): expert_math.store_act (torch ops) + copy into the buffer vs the Triton
  executor's store_inputs (one quantization kernel writing the buffer).
GPU time: median of single calls between CUDA events. Host time: wall time per call of 50 calls
issued back to back without synchronizing (what the host spends; the GPU is not the limit).
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_layer import SHAPES  # (experts, topk, hidden, intermediate, tokens per GPU)
from timing import median_ms

from megamoe_train import MegaMoEConfig
from megamoe_train.backends.triton_backend import TritonExecutor
from megamoe_train.backends.triton_plan import build_plan as device_plan
from megamoe_train.expert_math import store_act
from megamoe_train.plan import build_plan


def host_ms(fn, calls: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e3
    torch.cuda.synchronize()
    return host


def row(what, old, new):
    (g_old, h_old), (g_new, h_new) = old, new
    return (
        f"{what}: GPU {g_old:.3f} -> {g_new:.3f} ms ({g_old / g_new:.1f}x), "
        f"host {h_old:.3f} -> {h_new:.3f} ms ({h_old / h_new:.1f}x)"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", default="S1,S4,P")
    p.add_argument("--world", type=int, default=2, help="ranks whose ids the plan reads (EP size)")
    a = p.parse_args()
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}, plan for EP{a.world}")
    for shape in a.shapes.split(","):
        E, topk, H, I, T = SHAPES[shape]
        E_l = E // a.world
        ids = torch.randint(0, E, (a.world, T, topk), device=dev, dtype=torch.int32)
        for align in (128, 16):
            old, new = (lambda: build_plan(ids, 0, E_l, align)), (lambda: device_plan(ids, 0, E_l, align))
            want, got = old(), new()
            same = all(torch.equal(getattr(want, f), getattr(got, f)) for f in want.__dataclass_fields__)
            print(
                row(
                    f"{shape} E{E} top-{topk} T{T} plan align {align} (same tables: {same})",
                    (median_ms(old), host_ms(old)),
                    (median_ms(new), host_ms(new)),
                )
            )
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        data = torch.empty(T, H, device=dev, dtype=torch.float8_e4m3fn)
        scales = torch.empty(T, H // 128, device=dev, dtype=torch.float32)
        cfg = MegaMoEConfig(num_experts=E, hidden=H, intermediate=I, topk=topk, num_max_tokens_per_rank=T, recipe="fp8")

        def old_store():
            d, s = store_act(x, cfg.precision, torch.bfloat16)
            data.copy_(d)
            scales.copy_(s)

        new_store = lambda: TritonExecutor().store_inputs(cfg, x, data, scales)
        print(
            row(
                f"{shape} fp8 input storage T{T} H{H}",
                (median_ms(old_store), host_ms(old_store)),
                (median_ms(new_store), host_ms(new_store)),
            )
        )


if __name__ == "__main__":
    main()
