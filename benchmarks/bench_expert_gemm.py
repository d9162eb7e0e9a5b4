"""The fp8 forward's expert MLP on one GPU: the split path (CUTLASS grouped GEMM for L1, the Triton
SwiGLU + requantization kernel, CUTLASS grouped GEMM for L2) against our fused kernels
(csrc/cuda/expert_gemm.h: L1 with SwiGLU in its epilogue, then L2), on a rank's routed pool
(bench_gemm.pool_sizes: uniform routing, experts padded to 16 rows), with the floor of the same run.

  python benchmarks/bench_expert_gemm.py [--shapes S1,S4,S2,P,proxy16] [--ep 1] [--out x.md] [--once]
      [--gemms fwd,dgrad]

--gemms dgrad adds the backward's two dgrad GEMMs (fp8, and the MX recipe's E2M1 weights expanded
or folded), the floor counted the same way.

Per shape: each piece's median ms and TFLOP/s of routed rows, the sum, and the floor =
max(FLOPs / the dense fp8 rate, bytes / the HBM rate), FLOPs and bytes of the routed rows (the
weights read once, the pool read, the outputs written).
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_gemm import SHAPES, peaks, pool_sizes
from timing import hbm_bandwidth, median_ms

from megamoe_train.backends import cutlass_gemm
from megamoe_train.backends import triton_kernels as K_
from megamoe_train.precision import get_recipe
from megamoe_train.quant import fold_mx_weight, mx_weight_shifts, quantize_act, quantize_weight
from megamoe_train.weights import interleave_gate_up

FP8, MX = get_recipe("fp8"), get_recipe("mxfp8_mxfp4")


def mx_operands(w, experts_per_pass: int = 32):
    """bf16 weights -> (packed E2M1, shifts, block scales) for fp8_expert_gemm_mx and (e4m3, scales)
    folded for fp8_expert_gemm: the MX recipe's weights both ways (the same bits out). Quantized a
    few experts at a time: quant.py's fp32 temporaries of all of S1's weights pass 80 GB."""
    chunks = range(0, w.shape[0], experts_per_pass)
    parts = [quantize_weight(w[e : e + experts_per_pass], MX) for e in chunks]
    packed, scales = torch.cat([d for d, _ in parts]), torch.cat([s for _, s in parts])
    folds = [fold_mx_weight(d, s) for d, s in parts]
    del parts
    folded = torch.cat([d for d, _ in folds]), torch.cat([s for _, s in folds])
    return (packed, *mx_weight_shifts(scales)), folded


def same_bits(checks, rows: int) -> bool:
    """Whether each (fn, reference_fn, dst) writes the same bits into dst's first `rows` rows as
    its reference (rows past the last expert's end are not written)."""
    same = True
    for fn, reference_fn, dst in checks:
        reference_fn()
        want = dst[:rows].clone()
        fn()
        same = same and torch.equal(dst[:rows], want)
    return same


def run_shape(shape: str, ep: int, fp8_rate: float, hbm: float, dev, once: bool = False) -> list[str]:
    E, topk, H, I, T = SHAPES[shape]
    sizes, useful = pool_sizes(shape, ep, routed=True)
    G, P = len(sizes), sum(sizes)
    ends = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    num_rows = ends[-1:].clone()
    x = torch.randn(P, H, device=dev, dtype=torch.bfloat16)
    xq, xs = quantize_act(x, FP8)
    del x
    w1 = interleave_gate_up(torch.randn(G, 2 * I, H, device=dev, dtype=torch.bfloat16) * H**-0.5, 128)
    w1q, w1s = quantize_weight(w1, FP8)
    w1_mx, w1_folded = mx_operands(w1)
    del w1
    w2 = torch.randn(G, H, I, device=dev, dtype=torch.bfloat16) * I**-0.5
    w2q, w2s = quantize_weight(w2, FP8)
    w2_mx, w2_folded = mx_operands(w2)
    del w2
    row_w = torch.rand(P, device=dev)
    h = torch.empty(P, 2 * I, device=dev, dtype=torch.bfloat16)
    act = torch.empty(P, I, device=dev, dtype=torch.float8_e4m3fn)
    act_s = torch.empty(P, I // 128, device=dev)
    out = torch.empty(P, H, device=dev, dtype=torch.bfloat16)

    def split_l1():
        cutlass_gemm.fp8_grouped_gemm(xq, xs, w1q, w1s, ends, h)

    def split_swiglu():
        K_.swiglu_forward(h, row_w, act, act_s, num_rows, 128, None)

    def l2_cutlass():
        cutlass_gemm.fp8_grouped_gemm(act, act_s, w2q, w2s, ends, out)

    def fused_l1(variant=0):
        cutlass_gemm.fp8_expert_gemm_swiglu(xq, xs, w1q, w1s, ends, row_w, 128, None, h, act, act_s, variant)

    def ours_l1_plain(variant=0):
        cutlass_gemm.fp8_expert_gemm(xq, xs, w1q, w1s, ends, h, variant)

    def l2_ours(variant=0):
        cutlass_gemm.fp8_expert_gemm(act, act_s, w2q, w2s, ends, out, variant)

    # the MX recipe's weights: E2M1 expanded in shared memory, or folded to e4m3 in HBM
    def mx_l1():
        cutlass_gemm.fp8_expert_gemm_mx(xq, xs, *w1_mx, ends, h)

    def mx_l2():
        cutlass_gemm.fp8_expert_gemm_mx(act, act_s, *w2_mx, ends, out)

    def mx_shared_l1():  # the math warpgroups share the expansion (variant + 32)
        cutlass_gemm.fp8_expert_gemm_mx(xq, xs, *w1_mx, ends, h, 32)

    def mx_shared_l2():
        cutlass_gemm.fp8_expert_gemm_mx(act, act_s, *w2_mx, ends, out, 32)

    def folded_l1():
        cutlass_gemm.fp8_expert_gemm(xq, xs, *w1_folded, ends, h)

    def folded_l2():
        cutlass_gemm.fp8_expert_gemm(act, act_s, *w2_folded, ends, out)

    if once:  # each GEMM launched once, nothing timed: for Nsight Compute
        for fn in (split_l1, l2_cutlass, fused_l1, ours_l1_plain, l2_ours, mx_l1, mx_l2, mx_shared_l1, mx_shared_l2):
            fn()
        torch.cuda.synchronize()
        return []

    # agreement first: the fused L1 + L2 against the split path on the same inputs
    split_l1()
    split_swiglu()
    l2_cutlass()
    ref_h, ref_out = h.clone(), out.clone()
    fused_l1()
    l2_ours()
    torch.cuda.synchronize()
    rows = int(ends[-1])
    err_h = float((h[:rows].float() - ref_h[:rows].float()).norm() / ref_h[:rows].float().norm())
    err_out = float((out[:rows].float() - ref_out[:rows].float()).norm() / ref_out[:rows].float().norm())
    del ref_h, ref_out
    mx_same = same_bits(  # the E2M1 kernel's bits equal the folded weights' product
        ((mx_l1, folded_l1, h), (mx_l2, folded_l2, out), (mx_shared_l1, folded_l1, h), (mx_shared_l2, folded_l2, out)),
        rows,
    )

    # variants (csrc/cuda/expert_gemm.h): 0 the staged schedule with CTA pairs (SwiGLU deferred
    # into passes), 8 its SwiGLU epilogue in place, 1 without pairs, 4 with pairs but the math
    # warpgroups not staggered, 2 the first schedule with pairs; + 16 a tile's dead halves skipped
    t = {
        name: median_ms(fn, iters=20, warmup=3)
        for name, fn in (
            ("split L1", split_l1),
            ("split SwiGLU", split_swiglu),
            ("CUTLASS L2", l2_cutlass),
            ("fused L1+SwiGLU", fused_l1),
            ("ours L1 plain", ours_l1_plain),
            ("ours L1 plain single", lambda: ours_l1_plain(1)),
            ("ours L2", l2_ours),
            ("in-place L1+SwiGLU", lambda: fused_l1(8)),
            ("unstaggered L1+SwiGLU", lambda: fused_l1(4)),
            ("unstaggered L1 plain", lambda: ours_l1_plain(4)),
            ("unstaggered L2", lambda: l2_ours(4)),
            ("first L1+SwiGLU", lambda: fused_l1(2)),
            ("first L1 plain", lambda: ours_l1_plain(2)),
            ("first L2", lambda: l2_ours(2)),
            ("dead skipped L1+SwiGLU", lambda: fused_l1(16)),
            ("dead skipped L1 plain", lambda: ours_l1_plain(16)),
            ("dead skipped L2", lambda: l2_ours(16)),
            ("mx L1", mx_l1),
            ("mx L2", mx_l2),
            ("mx shared L1", mx_shared_l1),
            ("mx shared L2", mx_shared_l2),
            ("folded L1", folded_l1),
            ("folded L2", folded_l2),
        )
    }
    f1, f2 = 2.0 * useful * H * 2 * I, 2.0 * useful * I * H
    bytes1 = G * 2 * I * H + useful * H + useful * (2 * I * 2 + I)  # weights, pool, h bf16 + act e4m3
    bytes2 = G * H * I + useful * I + useful * H * 2
    floor1 = max(f1 / (fp8_rate * 1e12), bytes1 / hbm) * 1e3
    floor2 = max(f2 / (fp8_rate * 1e12), bytes2 / hbm) * 1e3
    split, fused = t["split L1"] + t["split SwiGLU"] + t["CUTLASS L2"], t["fused L1+SwiGLU"] + t["ours L2"]
    first = t["first L1+SwiGLU"] + t["first L2"]
    unstaggered = t["unstaggered L1+SwiGLU"] + t["unstaggered L2"]
    skipped = t["dead skipped L1+SwiGLU"] + t["dead skipped L2"]
    # the MX weights' floor: half of e4m3's weight bytes
    mx_floor1 = max(f1 / (fp8_rate * 1e12), (bytes1 - G * 2 * I * H / 2) / hbm) * 1e3
    mx_floor2 = max(f2 / (fp8_rate * 1e12), (bytes2 - G * H * I / 2) / hbm) * 1e3

    def tf(flops, ms):
        return f"{flops / ms / 1e9:.0f}"

    lines = [
        f"| {shape} | {G} | {useful} | {P} | split | {t['split L1']:.3f} ({tf(f1, t['split L1'])}) | "
        f"{t['split SwiGLU']:.3f} "
        f"| {t['CUTLASS L2']:.3f} ({tf(f2, t['CUTLASS L2'])}) | {split:.3f} | {floor1 + floor2:.3f} | |",
        f"| {shape} | {G} | {useful} | {P} | fused | {t['fused L1+SwiGLU']:.3f} "
        f"({tf(f1, t['fused L1+SwiGLU'])}); plain "
        f"{t['ours L1 plain']:.3f} ({tf(f1, t['ours L1 plain'])}); no pairs {t['ours L1 plain single']:.3f} | - | "
        f"{t['ours L2']:.3f} ({tf(f2, t['ours L2'])}) "
        f"| {fused:.3f} | {floor1 + floor2:.3f} | h {err_h:.1e}, y {err_out:.1e} |",
        f"| {shape} | {G} | {useful} | {P} | fused, SwiGLU epilogue in place | {t['in-place L1+SwiGLU']:.3f} "
        f"({tf(f1, t['in-place L1+SwiGLU'])}) | - | {t['ours L2']:.3f} | {t['in-place L1+SwiGLU'] + t['ours L2']:.3f} "
        f"| {floor1 + floor2:.3f} | |",
        f"| {shape} | {G} | {useful} | {P} | fused, not staggered | {t['unstaggered L1+SwiGLU']:.3f} "
        f"({tf(f1, t['unstaggered L1+SwiGLU'])}); plain {t['unstaggered L1 plain']:.3f} "
        f"({tf(f1, t['unstaggered L1 plain'])}) | - | "
        f"{t['unstaggered L2']:.3f} ({tf(f2, t['unstaggered L2'])}) | {unstaggered:.3f} | {floor1 + floor2:.3f} | |",
        f"| {shape} | {G} | {useful} | {P} | fused, first schedule | {t['first L1+SwiGLU']:.3f} "
        f"({tf(f1, t['first L1+SwiGLU'])}); plain {t['first L1 plain']:.3f} ({tf(f1, t['first L1 plain'])}) | - | "
        f"{t['first L2']:.3f} ({tf(f2, t['first L2'])}) | {first:.3f} | {floor1 + floor2:.3f} | |",
        f"| {shape} | {G} | {useful} | {P} | fused, dead halves skipped | {t['dead skipped L1+SwiGLU']:.3f} "
        f"({tf(f1, t['dead skipped L1+SwiGLU'])}); plain {t['dead skipped L1 plain']:.3f} "
        f"({tf(f1, t['dead skipped L1 plain'])}) | - | "
        f"{t['dead skipped L2']:.3f} ({tf(f2, t['dead skipped L2'])}) | {skipped:.3f} | {floor1 + floor2:.3f} | |",
        f"| {shape} | {G} | {useful} | {P} | mxfp4 weights expanded in smem (plain L1) | {t['mx L1']:.3f} "
        f"({tf(f1, t['mx L1'])}) | - | {t['mx L2']:.3f} ({tf(f2, t['mx L2'])}) | {t['mx L1'] + t['mx L2']:.3f} "
        f"| {mx_floor1 + mx_floor2:.3f} | {'same bits as folded' if mx_same else 'OTHER BITS than folded'} |",
        f"| {shape} | {G} | {useful} | {P} | mxfp4 weights expanded in smem by every warpgroup (plain L1) | "
        f"{t['mx shared L1']:.3f} ({tf(f1, t['mx shared L1'])}) | - | {t['mx shared L2']:.3f} "
        f"({tf(f2, t['mx shared L2'])}) | {t['mx shared L1'] + t['mx shared L2']:.3f} "
        f"| {mx_floor1 + mx_floor2:.3f} | |",
        f"| {shape} | {G} | {useful} | {P} | mxfp4 weights folded to e4m3 in HBM (plain L1) | {t['folded L1']:.3f} "
        f"({tf(f1, t['folded L1'])}) | - | {t['folded L2']:.3f} ({tf(f2, t['folded L2'])}) "
        f"| {t['folded L1'] + t['folded L2']:.3f} | {floor1 + floor2:.3f} | |",
    ]
    for line in lines:
        print(line, flush=True)
    return lines


DGRAD_HEAD = [
    "",
    "The dgrads (grad_act = dY W2, grad_x = dH W1; B the transposed weights quantized along the dgrad's "
    "K): fp8 on CUTLASS, the MX recipe's E2M1 copies expanded in smem (variant 0, + 32) or folded to e4m3",
    "",
    "| shape | experts | routed rows | pool rows | path | L2 dgrad [P, I] | L1 dgrad [P, H] | total | floor | bits |",
    "| --- | ---: | ---: | ---: | --- | --- | --- | ---: | ---: | --- |",
]


def run_dgrad_shape(shape: str, ep: int, fp8_rate: float, hbm: float, dev) -> list[str]:
    """The two dgrad GEMMs the backward runs for fp8 and mxfp8_mxfp4 (executor._dgrad_gemm): L2's,
    A = dY e4m3 [P, H] against w2_t [E, I, H] (N = I, K = H), and L1's, A = dH e4m3 [P, 2I] against
    w1_t [E, H, 2I] (N = H, K = 2I)."""
    E, topk, H, I, T = SHAPES[shape]
    sizes, useful = pool_sizes(shape, ep, routed=True)
    G, P = len(sizes), sum(sizes)
    ends = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    dy_q, dy_s = quantize_act(torch.randn(P, H, device=dev, dtype=torch.bfloat16), FP8)
    dh_q, dh_s = quantize_act(torch.randn(P, 2 * I, device=dev, dtype=torch.bfloat16), FP8)
    w2_t = torch.randn(G, I, H, device=dev, dtype=torch.bfloat16) * H**-0.5
    w2_tq, w2_ts = quantize_weight(w2_t, FP8)
    w2_mx, w2_folded = mx_operands(w2_t)
    del w2_t
    w1_t = torch.randn(G, H, 2 * I, device=dev, dtype=torch.bfloat16) * (2 * I) ** -0.5
    w1_tq, w1_ts = quantize_weight(w1_t, FP8)
    w1_mx, w1_folded = mx_operands(w1_t)
    del w1_t
    grad_act = torch.empty(P, I, device=dev, dtype=torch.bfloat16)
    grad_x = torch.empty(P, H, device=dev, dtype=torch.bfloat16)

    paths = {
        "fp8, CUTLASS": (
            lambda: cutlass_gemm.fp8_grouped_gemm(dy_q, dy_s, w2_tq, w2_ts, ends, grad_act),
            lambda: cutlass_gemm.fp8_grouped_gemm(dh_q, dh_s, w1_tq, w1_ts, ends, grad_x),
        ),
        "mxfp4 folded to e4m3, CUTLASS": (
            lambda: cutlass_gemm.fp8_grouped_gemm(dy_q, dy_s, *w2_folded, ends, grad_act),
            lambda: cutlass_gemm.fp8_grouped_gemm(dh_q, dh_s, *w1_folded, ends, grad_x),
        ),
        "mxfp4 expanded in smem": (
            lambda: cutlass_gemm.fp8_expert_gemm_mx(dy_q, dy_s, *w2_mx, ends, grad_act),
            lambda: cutlass_gemm.fp8_expert_gemm_mx(dh_q, dh_s, *w1_mx, ends, grad_x),
        ),
        "mxfp4 expanded in smem by every warpgroup": (
            lambda: cutlass_gemm.fp8_expert_gemm_mx(dy_q, dy_s, *w2_mx, ends, grad_act, 32),
            lambda: cutlass_gemm.fp8_expert_gemm_mx(dh_q, dh_s, *w1_mx, ends, grad_x, 32),
        ),
    }
    # the expanded kernels' bits against the folded weights' product (pool rows past the last
    # expert's end are not written, so only the routed rows compare)
    rows, folded = int(ends[-1]), paths["mxfp4 folded to e4m3, CUTLASS"]
    same = {
        name: "same bits as folded"
        if same_bits(((paths[name][i], folded[i], dst) for i, dst in enumerate((grad_act, grad_x))), rows)
        else "OTHER BITS than folded"
        for name in ("mxfp4 expanded in smem", "mxfp4 expanded in smem by every warpgroup")
    }
    flops = 2.0 * useful * H * I  # each dgrad: L2's N x K = I x H, L1's = H x 2I (twice)
    fl2, fl1 = flops, 2 * flops
    floor = 0.0
    for f, wbytes, a_bytes, out_bytes in (
        (fl2, G * I * H, useful * H, useful * I * 2),
        (fl1, G * H * 2 * I, useful * 2 * I, useful * H * 2),
    ):
        floor += max(f / (fp8_rate * 1e12), (wbytes + a_bytes + out_bytes) / hbm) * 1e3
    lines = []
    for name, (l2, l1) in paths.items():
        t2, t1 = median_ms(l2, iters=20, warmup=3), median_ms(l1, iters=20, warmup=3)
        lines.append(
            f"| {shape} | {G} | {useful} | {P} | {name} | {t2:.3f} ({fl2 / t2 / 1e9:.0f}) | "
            f"{t1:.3f} ({fl1 / t1 / 1e9:.0f}) | {t1 + t2:.3f} | {floor:.3f} | {same.get(name, '')} |"
        )
        print(lines[-1], flush=True)
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="S1,S4,S2,P,proxy16")
    p.add_argument("--ep", type=int, default=1, help="the rank's pool as at this expert parallelism")
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    p.add_argument(
        "--gemms",
        default="fwd",
        help="comma list: fwd (the forward's expert MLP, every schedule), dgrad (the two dgrads, fp8 and MX)",
    )
    p.add_argument(
        "--once",
        action="store_true",
        help="launch each GEMM once (CUTLASS L1, L2; ours fused L1, plain L1, L2), nothing timed: for "
        "`ncu -k regex:'expert_gemm_kernel|device_kernel'`",
    )
    args = p.parse_args(argv)
    dev = torch.device("cuda", 0)
    if not cutlass_gemm.has_expert_gemm(dev):
        print("needs an sm_90 GPU and megamoe_train._cuda built with the expert GEMMs", file=sys.stderr)
        return 1
    if args.once:
        for shape in args.shapes.split(","):
            run_shape(shape, args.ep, 0.0, 0.0, dev, once=True)
        return 0
    _, fp8_rate, _ = peaks(dev)
    hbm = hbm_bandwidth()  # bytes read + written per second (the copy rate); the floors count both
    head = [
        f"{torch.cuda.get_device_name(dev)}; dense fp8 {fp8_rate:.0f} TFLOP/s, "
        f"HBM {hbm / 1e12:.2f} TB/s (read + write); EP{args.ep} pools; ms (TFLOP/s of routed rows)",
        "",
        "| shape | experts | routed rows | pool rows | path | L1 | SwiGLU | L2 | total | floor | "
        "agreement (rel. to split) |",
        "| --- | ---: | ---: | ---: | --- | --- | ---: | --- | ---: | ---: | --- |",
    ]
    gemms = args.gemms.split(",")
    print("\n".join(head[:2]), flush=True)
    lines = head[:2]
    if "fwd" in gemms:
        print("\n".join(head[2:]), flush=True)
        lines += head[2:]
        for shape in args.shapes.split(","):
            lines += run_shape(shape, args.ep, fp8_rate, hbm, dev)
            torch.cuda.empty_cache()
    if "dgrad" in gemms:
        print("\n".join(DGRAD_HEAD), flush=True)
        lines += DGRAD_HEAD
        for shape in args.shapes.split(","):
            lines += run_dgrad_shape(shape, args.ep, fp8_rate, hbm, dev)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
