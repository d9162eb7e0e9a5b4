"""Grouped expert GEMMs of one rank, one GPU: our CUTLASS fp8 kernel vs our Triton fp8 kernel vs
torch's grouped GEMMs, in one run with the measured peaks.

  python benchmarks/bench_gemm.py [--shapes S1,S2,S3,S4] [--ep 2]

Per layer shape (bench_layer.SHAPES) the rank's pool under uniform routing: T*topk rows over
E/ep experts, each padded to 128 rows. GEMMs: forward L1 (N=2I, K=H) and L2 (N=H, K=I), and
the backward dgrads L2 (N=I, K=H) and L1 (N=H, K=2I). TFLOP/s count 2*M*N*K useful FLOPs.
Peaks: torch.mm bf16 and torch._scaled_mm fp8 (row-wise scales) at 8192^3, same run.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_layer import SHAPES  # noqa: E402  (experts, topk, hidden, intermediate, tokens per GPU)

from megamoe_train.backends import cutlass_gemm  # noqa: E402
from megamoe_train.backends import triton_kernels as K_  # noqa: E402
from megamoe_train.precision import get_recipe  # noqa: E402
from megamoe_train.quant import dequantize_act, dequantize_weight, quantize_act, quantize_weight  # noqa: E402

FP8 = get_recipe("fp8")


def bench(fn, iters=30, warmup=5) -> float:
    """Median ms of one call, each timed alone by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def peaks(dev) -> tuple[float, float]:
    n = 8192
    flops = 2.0 * n**3
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    bf16 = flops / bench(lambda: torch.mm(a, b)) / 1e9
    aq, bq = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    sa, sb = torch.rand(n, 1, device=dev) + 0.5, torch.rand(1, n, device=dev) + 0.5
    fp8 = flops / bench(lambda: torch._scaled_mm(aq, bq, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)) / 1e9
    return bf16, fp8


def case(name, groups, rows_per_group, n, k, dev):
    m = groups * rows_per_group
    ends = (torch.arange(1, groups + 1, device=dev) * rows_per_group).to(torch.int32)
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(groups, n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
    aq, a_s = quantize_act(a, FP8)
    bq, b_s = quantize_weight(b, FP8)
    block_expert = (torch.arange(m // 128, device=dev) // (rows_per_group // 128)).to(torch.int32)
    flops = 2.0 * m * n * k
    tf = lambda ms: flops / ms / 1e9  # noqa: E731
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    # reference: the dequantized product of the first and last group
    ad, bd = dequantize_act(aq, a_s, FP8), dequantize_weight(bq, b_s, FP8)
    ref = torch.cat([ad[:rows_per_group] @ bd[0].t(), ad[-rows_per_group:] @ bd[-1].t()])

    def err():
        got = torch.cat([out[:rows_per_group], out[-rows_per_group:]]).float()
        return float((got - ref).norm() / ref.norm())

    row = {"gemm": name, "M": m, "N": n, "K": k, "groups": groups}
    if cutlass_gemm.available(dev):
        row["cutlass_ms"] = bench(lambda: cutlass_gemm.fp8_grouped_gemm(aq, a_s, bq, b_s, ends, out))
        row["cutlass_err"] = err()
    row["triton_ms"] = bench(lambda: K_.grouped_gemm(aq, bq, block_expert, out, a_s, b_s, block_m=128))
    row["triton_err"] = err()
    row["torch_bf16_ms"] = bench(lambda: torch._grouped_mm(a, b.transpose(1, 2), offs=ends))
    a_row = a.float().abs().amax(1).clamp_min(1e-4) / 448
    b_row = b.float().abs().amax(2).clamp_min(1e-4) / 448
    aq_row = (a.float() / a_row[:, None]).to(torch.float8_e4m3fn)
    bq_row = (b.float() / b_row[:, :, None]).to(torch.float8_e4m3fn)
    try:
        row["torch_fp8_rowwise_ms"] = bench(lambda: torch._scaled_grouped_mm(
            aq_row, bq_row.transpose(1, 2), a_row, b_row, offs=ends, out_dtype=torch.bfloat16))
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        row["torch_fp8_rowwise_ms"] = None
        print(f"  torch._scaled_grouped_mm failed: {type(exc).__name__}: {str(exc)[:100]}")
    row["tflops"] = {key[:-3]: tf(v) for key, v in row.items() if key.endswith("_ms") and v}
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="S1,S2,S3,S4")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel ranks the shape is split over")
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    bf16_peak, fp8_peak = peaks(dev)
    print(f"# {torch.cuda.get_device_name(dev)}, EP{args.ep} per-rank pools; peaks: bf16 torch.mm {bf16_peak:.0f} TFLOP/s, "
          f"fp8 torch._scaled_mm {fp8_peak:.0f} TFLOP/s; CUTLASS extension: {cutlass_gemm.available(dev)}")
    print("| shape | GEMM | M x N x K | CUTLASS fp8 ms (TF/s) | Triton fp8 ms (TF/s) | torch bf16 ms (TF/s) | torch fp8 row-wise ms (TF/s) | fp8 floor ms | CUTLASS err |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for shape in args.shapes.split(","):
        E, topk, H, I, T = SHAPES[shape]
        groups = E // args.ep
        rows = max(128, -(-T * topk // groups // 128) * 128)
        for name, n, k in (("L1 fwd", 2 * I, H), ("L2 fwd", H, I), ("L2 dgrad", I, H), ("L1 dgrad", H, 2 * I)):
            r = case(name, groups, rows, n, k, dev)
            t = r["tflops"]
            cell = lambda key: f"{r[key + '_ms']:.3f} ({t[key]:.0f})" if r.get(key + "_ms") else "-"  # noqa: E731
            floor = 2.0 * r["M"] * n * k / fp8_peak / 1e9
            print(f"| {shape} | {name} | {r['M']} x {n} x {k} | {cell('cutlass')} | {cell('triton')} | {cell('torch_bf16')} | "
                  f"{cell('torch_fp8_rowwise')} | {floor:.3f} | {r.get('cutlass_err', float('nan')):.1e} |", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
