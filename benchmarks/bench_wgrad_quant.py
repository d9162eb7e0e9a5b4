"""The fp8 wgrad's operand quantization (triton_kernels.quantize_tokens_t) on one GPU, per operand
of one rank's pool, against the torch ops of quant.py and the HBM floor, measured in one run.

  python benchmarks/bench_wgrad_quant.py [--shapes S1,S2,S3,S4] [--block-c 32,64,128] [--num-warps 4,8]

Pool: EP 2, uniform routing, so one rank holds T * topk rows, E / 2 experts of equal size padded
to 128 rows. Operands (docs/precision.md): dY [P, H] and dH [P, 2I] from bf16, a [P, I] and
x [P, H] from e4m3 with 1x128 scales along C. Floor: the bytes the kernel must move (source,
its scales, row_slot; e4m3 out and fp32 out scales) at the HBM copy rate measured here.
Every kernel configuration is checked bit for bit against quant.quantize_tokens_t first
(MISMATCH after its time otherwise). Needs CUDA.
"""

from __future__ import annotations

import argparse

import torch
from bench_layer import SHAPES  # (experts, topk, hidden, intermediate, tokens per GPU)
from timing import hbm_bandwidth
from timing import median_ms as bench

from megamoe_train.backends import triton_kernels as K_
from megamoe_train.precision import RECIPES
from megamoe_train.quant import dequantize_act, quantize_act, quantize_tokens_t

FP8 = RECIPES["fp8"]
EP = 2


def pool_operands(shape, dev):
    E, topk, H, I, T = SHAPES[shape]
    E_l = E // EP
    per_expert = -(-T * topk // E_l // 128) * 128  # rows per expert, padded to 128
    P = E_l * per_expert
    row_slot = torch.zeros(P, dtype=torch.int32, device=dev)
    num_rows = torch.tensor([P], dtype=torch.int32, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    ops = {}
    for name, C, source in (("dY", H, "bf16"), ("dH", 2 * I, "bf16"), ("a", I, "e4m3"), ("x", H, "e4m3")):
        values = torch.randn(P, C, generator=g, device=dev)
        if source == "bf16":
            ops[name] = (values.to(torch.bfloat16), None)
        else:
            ops[name] = quantize_act(values, FP8)
    return P, row_slot, num_rows, ops


def torch_path(src, src_scales):
    values = src.float() if src_scales is None else dequantize_act(src, src_scales, FP8)
    return quantize_tokens_t(values, FP8)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="S1,S2,S3,S4")
    p.add_argument("--block-c", default="32,64,128")
    p.add_argument("--num-warps", default="4,8")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_wgrad_quant: needs a CUDA GPU")
    dev = torch.device("cuda")
    configs = [(int(b), int(w)) for b in args.block_c.split(",") for w in args.num_warps.split(",")]
    bw = hbm_bandwidth(2 << 30)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | HBM copy {bw / 1e12:.2f} TB/s (read + write)")
    for shape in args.shapes.split(","):
        P, row_slot, num_rows, ops = pool_operands(shape, dev)
        print(f"\n{shape}: one rank's pool P = {P} rows (EP {EP}, uniform)")
        for name, (src, src_scales) in ops.items():
            C = src.shape[1]
            want_q, want_s = torch_path(src, src_scales)
            out = torch.empty(C, P, dtype=torch.float8_e4m3fn, device=dev)
            out_s = torch.empty(C, P // 128, dtype=torch.float32, device=dev)
            moved = P * C * src.element_size() + 4 * P + P * C + 4 * C * (P // 128)
            if src_scales is not None:
                moved += src_scales.numel() * 4
            floor = moved / bw * 1e3
            t_torch = bench(lambda: torch_path(src, src_scales))
            line = f"  {name} [{P}, {C}] {src.dtype} | floor {floor:.3f} ms | torch (quant.py) {t_torch:.3f} ms"
            for block_c, num_warps in configs:
                run = lambda: K_.quantize_tokens_t(
                    src,
                    src_scales,
                    row_slot,
                    num_rows,
                    out,
                    out_s,  # noqa: E731
                    block_c=block_c,
                    num_warps=num_warps,
                )
                run()
                exact = torch.equal(out.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(out_s, want_s)
                ms = bench(run)
                line += f" | c{block_c}/w{num_warps} {ms:.3f} ms ({ms / floor:.2f}x floor)" + (
                    "" if exact else " MISMATCH"
                )
            print(line, flush=True)


if __name__ == "__main__":
    main()
