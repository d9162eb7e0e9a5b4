"""Cost of preparing expert weights for mega_moe, one GPU. Two modes:

  python benchmarks/bench_weight_prep.py [--mode fp8] [--shapes S1 S4] [--master-dtypes bf16 fp32]
  python benchmarks/bench_weight_prep.py --mode adapter [--experts 128] [--hidden 2048] [--inter 512] [--layers 5]
  python benchmarks/bench_weight_prep.py --mode mxfp4 [--shapes S1 S4] [--master-dtypes bf16 fp32]

fp8 (default): the fp8 recipe's once-per-optimizer-step weight preparation of one MoE layer's
per-rank expert weights, S1 (E_local 128, H 4096, I 2048) and S4 (E_local 128, H 7168, I 2048):
  torch (main)   quant.quantize_weight + gate/up interleave, as before the weight-prep kernel
                 (no FP8 dgrad operands);
  torch          quantize_expert_weights(use_kernel=False): the same plus w1_t / w2_t;
  kernel         quantize_expert_weights on CUDA: the Triton kernel, one pass per weight
                 (also swept over rows_per_step and num_warps);
  copies         compute_copies(bf16), the master-order bf16 weights a bf16 backward reads:
                 torch (dequantize + deinterleave + cast) vs the fused kernel.
Floors: bytes read + written over the HBM bandwidth measured in the same run (a 4 GiB
device-to-device copy). Outputs are checked equal to the torch path's before timing.

mxfp4: the mxfp8_mxfp4 recipe's weight preparation (E2M1, ue8m0 scales in 1 x 32 blocks), same
shapes: the torch ops (use_kernel=False) against the E2M1 kernel as quantize_expert_weights runs it
(the forward's copy and the dgrad's transposed one in one pass), and the kernel without the
transposed copy swept over tiles and num_warps; then what the GPU executor derives from the E2M1
weights (the expert GEMM's shifts of all four copies, the fold to e4m3). Floors as for fp8;
outputs checked equal to the torch path's first.

adapter: the issue-9 comparison: before vs after the
stacked expert parameters, DeepSeek-V3 proxy shapes (256 experts over EP=2, H=2048, I=512,
5 MoE layers), bf16 parameters. before, per layer and forward (the recompute pass runs it again):
  stack   torch.stack of every local expert's fc1 and fc2 (a new tensor each time, so the weight
          cache never hits) and
  fp8     quantization + interleave of the stacked weights (transform_weights, uncached), plus
          what the backward reads: since the fp8 dgrads (issue 12) the transposed e4m3 copies
          w1_t / w2_t, made inside transform_weights, instead of bf16 compute copies;
  bf16    a copy + gate/up interleave of the stacked weights (the old native transform).
after: the stacked parameters are passed as they are; bf16 reads them in place (no work), fp8
quantizes once per optimizer step (the same transform, once instead of per forward).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from timing import hbm_bandwidth, median_ms

from megamoe_train import MegaMoEConfig
from megamoe_train.precision import RECIPES
from megamoe_train.quant import mx_weight_shifts, quantize_weight
from megamoe_train.weights import clear_weight_cache, interleave_gate_up, quantize_expert_weights, transform_weights

SHAPES = {"S1": (128, 4096, 2048), "S4": (128, 7168, 2048)}  # (E_local, H, I)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def bench(fn, iters=10, warmup=2) -> float:
    return median_ms(fn, iters, warmup)


def adapter(args):
    E, H, I = args.experts, args.hidden, args.inter
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    fc1 = [torch.randn(2 * I, H, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(E)]
    fc2 = [torch.randn(H, I, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(E)]
    w1, w2 = torch.stack(fc1), torch.stack(fc2)
    cfg = {
        r: MegaMoEConfig(num_experts=2 * E, hidden=H, intermediate=I, topk=8, num_max_tokens_per_rank=8192, recipe=r)
        for r in ("bf16", "fp8")
    }

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
    print(
        f"{torch.cuda.get_device_name()} | E_local={E} H={H} I={I} layers={args.layers} | "
        f"expert weights {gb:.2f} GB bf16 per layer"
    )
    for k, v in t.items():
        print(f"  {k:20s} {v:8.3f} ms per layer")
    L = args.layers
    for passes, label in ((1, "no recompute"), (2, "with recompute")):
        before_bf16 = L * passes * (t["stack"] + t["bf16_old_transform"])
        before_fp8 = L * passes * (t["stack"] + t["fp8_transform"])
        after_fp8 = L * t["fp8_transform"]
        print(
            f"  per step, 1 micro-batch, {label}: bf16 before {before_bf16:.2f} ms, "
            f"after {L * t['bf16_new_transform']:.3f} ms | "
            f"fp8 before {before_fp8:.2f} ms, after {after_fp8:.2f} ms"
        )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return (
        t.view(torch.uint8)
        if t.element_size() == 1
        else t.view(torch.int16)
        if t.element_size() == 2
        else t.view(torch.int32)
    )


def torch_as_on_main(w1, w2, chunk):
    """The fp8 transform before the kernel: quantize in master order, interleave fc1."""
    recipe = RECIPES["fp8"]
    w1_data, w1_scales = quantize_weight(w1, recipe)
    w2_data, w2_scales = quantize_weight(w2, recipe)
    return interleave_gate_up(w1_data, chunk), interleave_gate_up(w1_scales, chunk // 128), w2_data, w2_scales


def fp8(args):
    from megamoe_train.backends import triton_weight_prep as K

    bw = hbm_bandwidth(4 << 30, iters=10, warmup=2)  # bench()'s counts
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | HBM copy {bw / 1e12:.2f} TB/s (read + write)")
    for shape in args.shapes:
        E, H, I = SHAPES[shape]
        cfg = MegaMoEConfig(num_experts=E, hidden=H, intermediate=I, topk=1, num_max_tokens_per_rank=8192, recipe="fp8")
        chunk = cfg.precision.gate_up_chunk
        n = E * 3 * I * H  # elements of w1 + w2
        c_torch = c_kernel = None
        taken = K.master_dtypes(torch.device("cuda"))
        skipped = [d for d in args.master_dtypes if DTYPES[d] not in taken]
        if skipped:
            print(
                f"\n{shape}: {', '.join(skipped)} masters skipped: on CUDA the kernel takes {taken} only, "
                "the others use the torch ops (fp32 masters gave other bits than quant.py on the GPU)"
            )
        for i, dname in enumerate(d for d in args.master_dtypes if d not in skipped):
            dtype, first_dtype = DTYPES[dname], i == 0
            torch.cuda.empty_cache()
            g = torch.Generator(device="cuda").manual_seed(0)
            w1 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02).to(dtype)
            w2 = (torch.randn(E, H, I, device="cuda", generator=g) * 0.02).to(dtype)
            esz = w1.element_size()
            scale_bytes = 2 * 4 * n // (128 * 128)  # two fp32 scale layouts
            floor_main = (n * esz + n + scale_bytes // 2) / bw * 1e3
            floor_kernel = (n * esz + 2 * n + scale_bytes) / bw * 1e3
            floor_copies = (n + scale_bytes // 2 + 2 * n) / bw * 1e3
            print(
                f"\n{shape} E_local={E} H={H} I={I} | {dname} masters {n * esz / 1e9:.2f} GB | "
                f"per layer, median of {args.iters}"
            )

            ours = quantize_expert_weights(w1, w2, cfg)
            try:
                oracle = quantize_expert_weights(w1, w2, cfg, use_kernel=False)
                for f in ("w1", "w1_scales", "w2", "w2_scales", "w1_t", "w1_t_scales", "w2_t", "w2_t_scales"):
                    a, b = getattr(ours, f), getattr(oracle, f)
                    assert torch.equal(_bits(a), _bits(b)), f"{f}: kernel != torch"
                oracle = None
                if first_dtype:
                    mine = dataclasses.replace(ours).compute_copies(torch.bfloat16)
                    for a, b in zip(mine, dataclasses.replace(ours).compute_copies(torch.bfloat16, use_kernel=False)):
                        assert torch.equal(_bits(a), _bits(b)), "compute copies: kernel != torch"
                print("  outputs: kernel == torch, bit for bit")
            except torch.OutOfMemoryError:
                print("  outputs: not compared here (out of memory; tests/test_weight_prep.py compares them)")
            oracle = mine = a = b = None  # noqa: F841 (frees what a failed comparison left)
            torch.cuda.empty_cache()

            def row(label, fn, floor=None):
                try:
                    ms = bench(fn, iters=args.iters)
                except torch.OutOfMemoryError:
                    print(f"  {label:52s}      OOM")
                    torch.cuda.empty_cache()
                    return None
                extra = f" | floor {floor:7.3f} ms, {ms / floor:5.2f}x floor" if floor else ""
                print(f"  {label:52s} {ms:8.3f} ms{extra}")
                return ms

            t_main = row(
                "transform, torch as on main (no w1_t/w2_t)", lambda: torch_as_on_main(w1, w2, chunk), floor_main
            )
            row(
                "transform, torch with w1_t/w2_t (use_kernel=False)",
                lambda: quantize_expert_weights(w1, w2, cfg, use_kernel=False),
                floor_kernel,
            )
            t_kernel = row("transform, kernel (default)", lambda: quantize_expert_weights(w1, w2, cfg), floor_kernel)
            for rows in args.rows_per_step:
                steps = None if rows == 0 else rows
                for nw in args.num_warps:
                    row(
                        f"  kernel rows_per_step={rows or 'all'} num_warps={nw}",
                        lambda nw=nw, steps=steps: (
                            K.quantize_blocks(w1, chunk=chunk, num_warps=nw, rows_per_step=steps),
                            K.quantize_blocks(w2, num_warps=nw, rows_per_step=steps),
                        ),
                        floor_kernel,
                    )
            if first_dtype:  # the copies read the e4m3 weights: the same work whatever the masters
                c_torch = row(
                    "compute_copies(bf16), torch",
                    lambda: dataclasses.replace(ours).compute_copies(torch.bfloat16, use_kernel=False),
                    floor_copies,
                )
                c_kernel = row(
                    "compute_copies(bf16), kernel (default)",
                    lambda: dataclasses.replace(ours).compute_copies(torch.bfloat16),
                    floor_copies,
                )
                for nw in args.num_warps:
                    row(
                        f"  kernel num_warps={nw}",
                        lambda nw=nw: (
                            K.dequantize_blocks(ours.w1, ours.w1_scales, torch.bfloat16, chunk=chunk, num_warps=nw),
                            K.dequantize_blocks(ours.w2, ours.w2_scales, torch.bfloat16, num_warps=nw),
                        ),
                        floor_copies,
                    )
            if None not in (t_main, c_torch, t_kernel, c_kernel):
                print(
                    f"  per optimizer step and layer, bf16 backward (transform + copies): torch as on main "
                    f"{t_main + c_torch:.2f} ms -> kernel {t_kernel + c_kernel:.2f} ms "
                    f"(floor {floor_kernel + floor_copies:.2f} ms)"
                )
                print(f"  FP8 dgrad backward (transform only): kernel {t_kernel:.2f} ms (floor {floor_kernel:.2f} ms)")
            del w1, w2, ours


def mxfp4(args):
    from megamoe_train.backends import triton_weight_prep as K

    bw = hbm_bandwidth(4 << 30, iters=10, warmup=2)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | HBM copy {bw / 1e12:.2f} TB/s (read + write)")

    def row(label, fn, floor):
        try:
            ms = bench(fn, iters=args.iters)
        except torch.OutOfMemoryError:
            print(f"  {label:52s}      OOM")
            torch.cuda.empty_cache()
            return
        print(f"  {label:52s} {ms:8.3f} ms | floor {floor:7.3f} ms, {ms / floor:5.2f}x floor")

    for shape in args.shapes:
        E, H, I = SHAPES[shape]
        cfg = MegaMoEConfig(
            num_experts=E, hidden=H, intermediate=I, topk=1, num_max_tokens_per_rank=8192, recipe="mxfp8_mxfp4"
        )
        chunk = cfg.precision.gate_up_chunk
        n = E * 3 * I * H  # elements of w1 + w2
        for dname in args.master_dtypes:
            torch.cuda.empty_cache()
            g = torch.Generator(device="cuda").manual_seed(0)
            w1 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02).to(DTYPES[dname])
            w2 = (torch.randn(E, H, I, device="cuda", generator=g) * 0.02).to(DTYPES[dname])
            layout_bytes = n // 2 + n // 32  # packed codes, one scale byte per 32 elements
            floor = (n * w1.element_size() + layout_bytes) / bw * 1e3
            floor_t = floor + layout_bytes / bw * 1e3
            print(f"\n{shape} E_local={E} H={H} I={I} | {dname} masters | per layer, median of {args.iters}")
            try:
                ours = quantize_expert_weights(w1, w2, cfg)
                oracle = quantize_expert_weights(w1, w2, cfg, use_kernel=False)
                for f in ("w1", "w1_scales", "w2", "w2_scales", "w1_t", "w1_t_scales", "w2_t", "w2_t_scales"):
                    assert torch.equal(getattr(ours, f), getattr(oracle, f)), f"{f}: kernel != torch"
                print("  outputs: kernel == torch, bit for bit")
            except torch.OutOfMemoryError:
                print("  outputs: not compared here (out of memory; tests/test_weight_prep_fp4.py compares them)")
            ours = oracle = None
            torch.cuda.empty_cache()
            row(
                "transform, torch (use_kernel=False)",
                lambda: quantize_expert_weights(w1, w2, cfg, use_kernel=False),
                floor_t,
            )
            row(
                "transform, kernel (default, with the transposed copy)",
                lambda: quantize_expert_weights(w1, w2, cfg),
                floor_t,
            )
            for tile in ((32, 128), (64, 128), (128, 128), (64, 64)):
                for nw in args.num_warps:
                    row(
                        f"  kernel without it, tile={tile} num_warps={nw}",
                        lambda tile=tile, nw=nw: (
                            K.quantize_e2m1_blocks(w1, chunk=chunk, transposed=False, tile=tile, num_warps=nw),
                            K.quantize_e2m1_blocks(w2, transposed=False, tile=tile, num_warps=nw),
                        ),
                        floor,
                    )
            # what the GPU executor derives per weight version: the shifts and block scales of the
            # expert GEMM that expands E2M1 (torch ops over the scales) for the forward's copies and
            # the dgrad's, and the fold to e4m3 (only where that GEMM is not built; per copy)
            ew = quantize_expert_weights(w1, w2, cfg)
            scale_bytes = n // 32
            row(
                "shifts + block scales, forward + dgrad copies",
                lambda: [mx_weight_shifts(s) for s in (ew.w1_scales, ew.w2_scales, ew.w1_t_scales, ew.w2_t_scales)],
                4 * scale_bytes / bw * 1e3,
            )
            row(
                "fold to e4m3 (fold_e2m1_blocks), forward copies",
                lambda: (K.fold_e2m1_blocks(ew.w1, ew.w1_scales), K.fold_e2m1_blocks(ew.w2, ew.w2_scales)),
                (layout_bytes + n + n // (128 * 128) * 4) / bw * 1e3,
            )
            del w1, w2, ew


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("fp8", "adapter", "mxfp4"), default="fp8")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["S1", "S4"], help="fp8, mxfp4 modes")
    ap.add_argument("--master-dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16"], help="fp8, mxfp4 modes")
    ap.add_argument("--num-warps", nargs="+", type=int, default=[4, 8, 16, 32], help="fp8, mxfp4: kernel sweep")
    ap.add_argument(
        "--rows-per-step",
        nargs="+",
        type=int,
        default=[64, 32, 0],
        help="fp8 mode: kernel sweep of quantize_blocks' rows_per_step (0 = the whole block at once)",
    )
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--experts", type=int, default=128, help="adapter mode: local experts per GPU")
    ap.add_argument("--hidden", type=int, default=2048, help="adapter mode")
    ap.add_argument("--inter", type=int, default=512, help="adapter mode")
    ap.add_argument("--layers", type=int, default=5, help="adapter mode: MoE layers per GPU")
    args = ap.parse_args()
    {"fp8": fp8, "adapter": adapter, "mxfp4": mxfp4}[args.mode](args)


if __name__ == "__main__":
    main()
