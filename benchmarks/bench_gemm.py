"""Grouped expert GEMMs of one rank, one GPU: our CUTLASS fp8 and bf16 kernels (every compiled
variant and two scheduler swizzles) vs our Triton fp8 kernel vs torch's grouped GEMMs, in one run
with the measured peaks.

  python benchmarks/bench_gemm.py [--shapes S1,S2,S3,S4,proxy,proxy16] [--ep 2] \
[--gemms fwd,wgrad,wgrad_acc,dense_acc] [--routed]

Per layer shape (bench_layer.SHAPES, plus "proxy" / "proxy16", the DeepSeek-V3 training proxy at
8192 / 32768 tokens per GPU) the rank's
pool under uniform routing: T*topk rows over E/ep experts, each padded to 128 rows; with --routed
(fwd only) each expert's rows drawn as uniform routing gives them and padded to 16, as in the
layer, where an expert's last 128-row tile is mostly partial.
- fwd (forward and dgrad, row-grouped): forward L1 (N=2I, K=H) and L2 (N=H, K=I), and the
  backward dgrads L2 (N=I, K=H) and L1 (N=H, K=2I). TFLOP/s count 2*M*N*K useful FLOPs.
- wgrad (K-grouped, out [G, M, N]): W2 grad (M=H, N=I) and W1 grad (M=2I, N=H), K = each expert's
  pool rows; our fp8 kernel (cutlass_gemm.fp8_wgrad_grouped_gemm) and our bf16 kernel on the pool
  operands as stored (cutlass_gemm.bf16_wgrad_grouped_gemm), every variant and swizzle, vs
  torch._grouped_mm bf16 2-D x 2-D with offs. TFLOP/s count
  2*M*N*rows; next to the FLOPs floor the output floor: G*M*N*2 bytes at the measured write rate.
- wgrad_acc (the same two wgrads, accumulated into an fp32 main_grad [G, M, N], as a training step
  with gradient-accumulation fusion does): our bf16 CUTLASS GEMM adding in its epilogue
  (cutlass_gemm.bf16_wgrad_grouped_gemm_accumulate, every variant) vs torch._grouped_mm bf16 then
  main_grad.add_ (what DDP's hook does without the fusion). Floors: FLOPs at the bf16 peak, and the
  accumulator's fp32 read + write (8 bytes per element) at the measured write rate. Also the same
  GEMM writing fp32 over main_grad (a step's first micro-batch when DDP's buffer is not zeroed,
  megatron_patch.grad_buffers), every variant, against accumulating plus DDP's zero_ of main_grad.
- dense_acc (not in the default list): the DeepSeek-V3 proxy's dense weight gradients (attention
  QKV and projection, the dense layer's MLP, the output layer; one micro-batch of 8192 tokens)
  added into fp32 main_grad, one group: what megamoe_trainer.perf.dense_wgrad runs for Megatron's
  gradient_accumulation_fusion, every variant, vs torch bf16 mm then add_ (Megatron's unfused wgrad
  and DDP's add).
Peaks: torch.mm bf16 and torch._scaled_mm fp8 (row-wise scales) at 8192^3, and the HBM write rate
(zero_ of 4 GiB of fp32), same run.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_layer import SHAPES as LAYER_SHAPES  # noqa: E402  (experts, topk, hidden, intermediate, tokens per GPU)
from timing import median_ms  # noqa: E402

from megamoe_train.backends import cutlass_gemm  # noqa: E402
from megamoe_train.backends import triton_kernels as K_  # noqa: E402
from megamoe_train.precision import get_recipe  # noqa: E402
from megamoe_train.quant import dequantize_act, dequantize_weight, quantize_act, quantize_weight  # noqa: E402

FP8 = get_recipe("fp8")
SWIZZLES = (1, 4)
# the DeepSeek-V3 training proxy (bench_train): micro-batches of 8192 tokens per GPU (4 sequences; the
# 1-GPU recipe), and of 32768 (16 sequences; the 2-GPU recipes)
SHAPES = {**LAYER_SHAPES, "proxy": (256, 8, 2048, 512, 8192), "proxy16": (256, 8, 2048, 512, 32768)}


def bench(fn, iters=30, warmup=5) -> float:
    return median_ms(fn, iters, warmup)


def peaks(dev) -> tuple[float, float, float]:
    """bf16 and fp8 dense TFLOP/s, HBM write GB/s."""
    n = 8192
    flops = 2.0 * n**3
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    bf16 = flops / bench(lambda: torch.mm(a, b)) / 1e9
    aq, bq = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    sa, sb = torch.rand(n, 1, device=dev) + 0.5, torch.rand(1, n, device=dev) + 0.5
    fp8 = flops / bench(lambda: torch._scaled_mm(aq, bq, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)) / 1e9
    # fp32, the dtype of the main_grad the write floors bound: a uint8 zero_ wrote ~3.35 TB/s where
    # main_grad.zero_ (fp32) of the same run wrote ~4.4 TB/s, so it was no floor (2026-12-01 raw file)
    buf = torch.empty(1 << 30, dtype=torch.float32, device=dev)
    write = buf.numel() * buf.element_size() / bench(lambda: buf.zero_()) / 1e6
    del buf
    return bf16, fp8, write


def pool_sizes(shape: str, ep: int, routed: bool, seed: int = 0) -> tuple[list[int], int]:
    """(rows per local expert group, useful rows) of one rank's pool: every expert exactly the mean
    rounded up to 128 rows, or (routed) as the layer's pool under uniform routing: each expert's
    slot count drawn Binomial(tokens of all ranks, topk / E), padded to 16 rows (the executor's
    GROUP_ALIGN), so most experts end in a partial 128-row tile."""
    E, topk, H, I, T = SHAPES[shape]
    groups = E // ep
    if not routed:
        rows = max(128, -(-T * topk // groups // 128) * 128)
        return [rows] * groups, rows * groups
    gen = torch.Generator().manual_seed(seed)
    counts = torch.binomial(torch.full((groups,), float(T * ep)), torch.full((groups,), topk / E), generator=gen)
    counts = [int(c) for c in counts.tolist()]
    return [-(-c // 16) * 16 for c in counts], sum(counts)


def case(name, sizes, n, k, dgrad, dev):
    """Every implementation on one GEMM over expert groups of `sizes` rows; returns {label: ms}
    and {label: relative error}. The Triton kernel runs only where every group is a
    multiple of 128 rows (its block table)."""
    groups, m = len(sizes), sum(sizes)
    ends = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(groups, n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
    aq, a_s = quantize_act(a, FP8)
    bq, b_s = quantize_weight(b, FP8)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    times, errors = {}, {}
    # reference: the dequantized product of the first and last group
    first, last = sizes[0], sizes[-1]
    ad, bd = dequantize_act(aq, a_s, FP8), dequantize_weight(bq, b_s, FP8)
    ref = torch.cat([ad[:first] @ bd[0].t(), ad[m - last :] @ bd[-1].t()])
    ref_bf16 = torch.cat([a[:first].float() @ b[0].float().t(), a[m - last :].float() @ b[-1].float().t()])

    def err(reference):
        got = torch.cat([out[:first], out[m - last :]]).float()
        return float((got - reference).norm() / reference.norm())

    if cutlass_gemm.available(dev):
        for variant in range(cutlass_gemm._cuda.FP8_VARIANTS):
            for swizzle in SWIZZLES:
                label = f"cutlass_fp8 v{variant} s{swizzle}"
                times[label] = bench(
                    lambda: cutlass_gemm.fp8_grouped_gemm(aq, a_s, bq, b_s, ends, out, variant, swizzle)
                )
                errors[label] = err(ref)
        # bf16: the forward reads W [N, K]; the dgrad reads the same weight untransposed, [K, N]
        layout = "kn" if dgrad else "nk"
        b_in = b.transpose(1, 2).contiguous() if dgrad else b
        for variant in range(cutlass_gemm._cuda.BF16_VARIANTS):
            for swizzle in SWIZZLES:
                label = f"cutlass_bf16 v{variant} s{swizzle}"
                times[label] = bench(
                    lambda: cutlass_gemm.bf16_grouped_gemm(a, b_in, ends, out, layout, variant, swizzle)
                )
                errors[label] = err(ref_bf16)
    if all(size % 128 == 0 for size in sizes):
        block_expert = torch.repeat_interleave(
            torch.arange(groups, device=dev), torch.tensor(sizes, device=dev) // 128
        ).to(torch.int32)
        times["triton_fp8"] = bench(lambda: K_.grouped_gemm(aq, bq, block_expert, out, a_s, b_s, block_m=128))
        errors["triton_fp8"] = err(ref)
    b_torch = b.transpose(1, 2).contiguous().transpose(1, 2) if dgrad else b  # same storage as ours
    times["torch_bf16"] = bench(lambda: torch._grouped_mm(a, b_torch.transpose(1, 2), offs=ends))
    a_row = a.float().abs().amax(1).clamp_min(1e-4) / 448
    b_row = b.float().abs().amax(2).clamp_min(1e-4) / 448
    aq_row = (a.float() / a_row[:, None]).to(torch.float8_e4m3fn)
    bq_row = (b.float() / b_row[:, :, None]).to(torch.float8_e4m3fn)
    try:
        times["torch_fp8_rowwise"] = bench(
            lambda: torch._scaled_grouped_mm(
                aq_row, bq_row.transpose(1, 2), a_row, b_row, offs=ends, out_dtype=torch.bfloat16
            )
        )
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        print(f"  torch._scaled_grouped_mm failed: {type(exc).__name__}: {str(exc)[:100]}")
    return times, errors


def wgrad_case(groups, rows_per_group, m, n, dev):
    """One K-grouped wgrad GEMM, out[g] = A_t[:, rows of g] @ B_t[:, rows of g]^T, for our fp8 and
    bf16 kernels' every configuration and torch's bf16 grouped GEMM; returns ({label: ms}, errors)."""
    p = groups * rows_per_group
    ends = (torch.arange(1, groups + 1, device=dev) * rows_per_group).to(torch.int32)
    # the pool's rows as the executor holds them ([P, M]: e.g. dY rows, [P, N]: activations)
    a = torch.randn(p, m, device=dev, dtype=torch.bfloat16)
    b = torch.randn(p, n, device=dev, dtype=torch.bfloat16)
    times, errors = {}, {}
    # reference for the first and last expert: the float product of the dequantized operands
    a_tq, a_ts = quantize_act(a.t().contiguous(), FP8)
    b_tq, b_ts = quantize_act(b.t().contiguous(), FP8)
    first, last = slice(0, rows_per_group), slice(p - rows_per_group, p)
    ad, bd = dequantize_act(a_tq, a_ts, FP8), dequantize_act(b_tq, b_ts, FP8)
    ref = torch.stack([ad[:, first] @ bd[:, first].t(), ad[:, last] @ bd[:, last].t()])
    ref_bf16 = torch.stack([a[first].float().t() @ b[first].float(), a[last].float().t() @ b[last].float()])
    del ad, bd

    def err(out, reference):
        got = torch.stack([out[0], out[-1]]).float()
        return float((got - reference).norm() / reference.norm())

    if cutlass_gemm.available(dev):
        out = torch.empty(groups, m, n, device=dev, dtype=torch.bfloat16)
        for variant in range(cutlass_gemm._cuda.FP8_WGRAD_VARIANTS):
            for swizzle in SWIZZLES:
                label = f"cutlass_fp8 v{variant} s{swizzle}"
                times[label] = bench(
                    lambda: cutlass_gemm.fp8_wgrad_grouped_gemm(a_tq, a_ts, b_tq, b_ts, ends, out, variant, swizzle)
                )
                errors[label] = err(out, ref)
        for variant in range(cutlass_gemm._cuda.BF16_WGRAD_VARIANTS):
            for swizzle in SWIZZLES:
                label = f"cutlass_bf16 v{variant} s{swizzle}"
                out.fill_(float("nan"))
                cutlass_gemm.bf16_wgrad_grouped_gemm(a, b, ends, out, variant, swizzle)
                errors[label] = err(out, ref_bf16)
                times[label] = bench(lambda: cutlass_gemm.bf16_wgrad_grouped_gemm(a, b, ends, out, variant, swizzle))
        del out
    got = torch._grouped_mm(a.t(), b, offs=ends)
    errors["torch_bf16"] = err(got, ref_bf16)
    del got
    times["torch_bf16"] = bench(lambda: torch._grouped_mm(a.t(), b, offs=ends))
    return times, errors


def wgrad_shapes(shapes: str, ep: int):
    """(shape, wgrad name, groups, rows per expert, M, N) of the two expert wgrads of each shape."""
    for shape in shapes.split(","):
        E, topk, H, I, T = SHAPES[shape]
        groups = E // ep
        rows = max(128, -(-T * topk // groups // 128) * 128)
        for name, m, n in (("W2 grad", H, I), ("W1 grad", 2 * I, H)):
            yield shape, name, groups, rows, m, n


# the DeepSeek-V3 proxy's dense linear layers (recipes/deepseek_v3_proxy_2gpu_*.yaml: H 2048, 16
# heads, dense FFN 8192, vocab 32768): (name, out features, in features); one micro-batch's tokens
DENSE_PROXY = (
    ("attention QKV", 3 * 2048, 2048),
    ("attention proj", 2048, 2048),
    ("dense fc1", 2 * 8192, 2048),
    ("dense fc2", 2048, 8192),
    ("output layer", 32768, 2048),
)
DENSE_TOKENS = 8192


def wgrad_acc_case(groups, rows_per_group, m, n, dev):
    """main_grad[g] += A[rows of g]^T @ B[rows of g]: fused (every variant) vs torch + add_."""
    p = groups * rows_per_group
    ends = (torch.arange(1, groups + 1, device=dev) * rows_per_group).to(torch.int32)
    a = torch.randn(p, m, device=dev, dtype=torch.bfloat16)
    b = torch.randn(p, n, device=dev, dtype=torch.bfloat16)
    main_grad = torch.zeros(groups, m, n, device=dev)
    times, errors = {}, {}
    ref = torch._grouped_mm(a.t(), b, offs=ends).float()
    if cutlass_gemm.available(dev):
        # added into zeros; written over NaN (never read)
        kinds = (
            ("cutlass_acc", cutlass_gemm.bf16_wgrad_grouped_gemm_accumulate, 0.0),
            ("cutlass_store32", cutlass_gemm.bf16_wgrad_grouped_gemm, float("nan")),
        )
        for prefix, gemm, start in kinds:
            for variant in range(cutlass_gemm._cuda.BF16_WGRAD_VARIANTS):
                label = f"{prefix} v{variant}"
                main_grad.fill_(start)
                gemm(a, b, ends, main_grad, variant)
                errors[label] = float((main_grad - ref).norm() / ref.norm())
                times[label] = bench(lambda: gemm(a, b, ends, main_grad, variant))
        times["zero_"] = bench(lambda: main_grad.zero_())  # DDP's reset of main_grad, which the store makes unneeded
    del ref
    times["torch_bf16+add"] = bench(lambda: main_grad.add_(torch._grouped_mm(a.t(), b, offs=ends)))
    return times, errors


def _speedup(times: dict, prefix: str, baseline: str) -> str:
    """The baseline's time over the fastest configuration whose label starts with prefix."""
    ours = min((v for key, v in times.items() if key.startswith(prefix)), default=None)
    return f"{times[baseline] / ours:.2f}x" if ours else "-"


def _detail(label: str, times: dict, errors: dict) -> str:
    """One line of the closing list: every configuration's time and error of a case."""
    return f"{label}: " + ", ".join(
        f"{key} {v:.3f} ms err {errors.get(key, float('nan')):.1e}" for key, v in times.items()
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="S1,S2,S3,S4")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel ranks the shape is split over")
    p.add_argument(
        "--routed",
        action="store_true",
        help="fwd: expert groups sized as the layer's pool under uniform routing (padded to 16 rows; "
        "TFLOP/s count the routed rows) instead of exactly the mean, rounded up to 128",
    )
    p.add_argument(
        "--gemms",
        default="fwd,wgrad,wgrad_acc",
        help="fwd (forward and dgrad GEMMs), wgrad (weight gradients), wgrad_acc (accumulated into fp32), "
        "dense_acc (the proxy's dense wgrads accumulated into fp32)",
    )
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    bf16_peak, fp8_peak, write_gbs = peaks(dev)
    gemms = set(args.gemms.split(","))
    print(
        f"# {torch.cuda.get_device_name(dev)}, EP{args.ep} per-rank pools; "
        f"peaks: bf16 torch.mm {bf16_peak:.0f} TFLOP/s, "
        f"fp8 torch._scaled_mm {fp8_peak:.0f} TFLOP/s, HBM write (fp32 zero_ 4 GiB) {write_gbs:.0f} GB/s; "
        f"CUTLASS extension: {cutlass_gemm.available(dev)}"
    )
    details = []

    def best(times, prefix, tf):
        got = {key: v for key, v in times.items() if key.startswith(prefix)}
        if not got:
            return "-"
        key = min(got, key=got.get)
        return f"{got[key]:.3f} ({tf(got[key]):.0f}) {key[len(prefix) :].strip()}"

    if "fwd" in gemms:
        print(
            "| shape | GEMM | M x N x K | CUTLASS fp8 ms (TF/s) best config | Triton fp8 | CUTLASS bf16 | torch bf16 | "
            "torch fp8 row-wise | fp8 floor ms |"
        )
        print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for shape in args.shapes.split(","):
            E, topk, H, I, T = SHAPES[shape]
            sizes, m = pool_sizes(shape, args.ep, args.routed)
            for name, n, k, dgrad in (
                ("L1 fwd", 2 * I, H, False),
                ("L2 fwd", H, I, False),
                ("L2 dgrad", I, H, True),
                ("L1 dgrad", H, 2 * I, True),
            ):
                times, errors = case(name, sizes, n, k, dgrad, dev)
                tf = lambda ms: 2.0 * m * n * k / ms / 1e9  # noqa: E731
                floor = 2.0 * m * n * k / fp8_peak / 1e9
                print(
                    f"| {shape} | {name} | {m} x {n} x {k} | {best(times, 'cutlass_fp8', tf)} | "
                    f"{best(times, 'triton_fp8', tf)} | "
                    f"{best(times, 'cutlass_bf16', tf)} | {best(times, 'torch_bf16', tf)} | "
                    f"{best(times, 'torch_fp8_rowwise', tf)} | {floor:.3f} |",
                    flush=True,
                )
                details.append(_detail(f"{shape} {name}", times, errors))
                torch.cuda.empty_cache()
    if "wgrad" in gemms:
        print(
            "\n| shape | wgrad | G x M x N, rows per expert | CUTLASS fp8 ms (TF/s) best config | "
            "CUTLASS bf16 ms (TF/s) best config | "
            "torch bf16 ms (TF/s) | bf16 speedup | fp8 FLOPs floor ms | bf16 FLOPs floor ms | output floor ms |"
        )
        print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for shape, name, groups, rows, m, n in wgrad_shapes(args.shapes, args.ep):
            times, errors = wgrad_case(groups, rows, m, n, dev)
            flops = 2.0 * groups * rows * m * n
            tf = lambda ms: flops / ms / 1e9  # noqa: E731
            speedup = _speedup(times, "cutlass_bf16", "torch_bf16")
            out_floor = groups * m * n * 2 / write_gbs / 1e6
            print(
                f"| {shape} | {name} | {groups} x {m} x {n}, {rows} | {best(times, 'cutlass_fp8', tf)} | "
                f"{best(times, 'cutlass_bf16', tf)} | {best(times, 'torch_bf16', tf)} | {speedup} | "
                f"{flops / fp8_peak / 1e9:.3f} | {flops / bf16_peak / 1e9:.3f} | {out_floor:.3f} |",
                flush=True,
            )
            details.append(_detail(f"{shape} {name}", times, errors))
            torch.cuda.empty_cache()
    if "wgrad_acc" in gemms:
        print(
            "\n| shape | wgrad into fp32 main_grad | G x M x N, rows per expert | CUTLASS fused ms (TF/s) best | "
            "torch bf16 + add_ ms | speedup | bf16 FLOPs floor ms | main_grad r+w floor ms | "
            "written over ms (TF/s) best | zero_ ms | write floor ms |"
        )
        print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for shape, name, groups, rows, m, n in wgrad_shapes(args.shapes, args.ep):
            times, errors = wgrad_acc_case(groups, rows, m, n, dev)
            flops = 2.0 * groups * rows * m * n
            tf = lambda ms: flops / ms / 1e9  # noqa: E731
            speedup = _speedup(times, "cutlass_acc", "torch_bf16+add")
            print(
                f"| {shape} | {name} | {groups} x {m} x {n}, {rows} | {best(times, 'cutlass_acc', tf)} | "
                f"{times['torch_bf16+add']:.3f} | {speedup} | {flops / bf16_peak / 1e9:.3f} | "
                f"{groups * m * n * 8 / write_gbs / 1e6:.3f} | {best(times, 'cutlass_store32', tf)} | "
                f"{times.get('zero_', float('nan')):.3f} | {groups * m * n * 4 / write_gbs / 1e6:.3f} |",
                flush=True,
            )
            details.append(_detail(f"{shape} {name} acc", times, errors))
            torch.cuda.empty_cache()
    if "dense_acc" in gemms:
        print(
            "\n| layer | dense wgrad into fp32 main_grad | out x in, tokens | CUTLASS fused ms (TF/s) best | "
            "torch bf16 + add_ ms | "
            "speedup | bf16 FLOPs floor ms |"
        )
        print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
        for name, out_f, in_f in DENSE_PROXY:
            times, errors = wgrad_acc_case(1, DENSE_TOKENS, out_f, in_f, dev)
            flops = 2.0 * DENSE_TOKENS * out_f * in_f
            tf = lambda ms: flops / ms / 1e9  # noqa: E731
            print(
                f"| proxy | {name} | {out_f} x {in_f}, {DENSE_TOKENS} | {best(times, 'cutlass_acc', tf)} | "
                f"{times['torch_bf16+add']:.3f} | {_speedup(times, 'cutlass_acc', 'torch_bf16+add')} | "
                f"{flops / bf16_peak / 1e9:.3f} |",
                flush=True,
            )
            details.append(_detail(f"proxy dense {name}", times, errors))
            torch.cuda.empty_cache()
    print("\n# every configuration (ms, relative error against the float product of the same operands)")
    print("\n".join(details))


if __name__ == "__main__":
    main()
