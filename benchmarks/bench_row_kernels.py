"""The fp8 recipe's row-wise Triton kernels of one rank, one GPU, against the HBM copy rate measured
in the same run: SwiGLU forward (+ e4m3 requantization) and backward (+ dH quantization) at several
row blocks and warp counts (what picks the launchers' defaults), and dequantize_rows.

  python benchmarks/bench_row_kernels.py [--shape S1]

The pool: the rows one rank receives under uniform routing (T*topk) plus ~14% padding rows, as the
fp8 pool holds them (experts padded to 128 rows); GB/s count the live rows' bytes read and written
once.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_layer import SHAPES  # noqa: E402  (experts, topk, hidden, intermediate, tokens per GPU)
from timing import median_ms  # noqa: E402

from megamoe_train.backends import triton_kernels as K_  # noqa: E402

FORWARD_CONFIGS = ((16, 4), (8, 4), (8, 2), (32, 4), (32, 8))  # (rows per program, warps)
BACKWARD_CONFIGS = ((8, 4), (4, 2), (8, 8), (16, 4), (32, 4))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="S1", choices=sorted(SHAPES))
    a = p.parse_args()
    E, topk, H, I, T = SHAPES[a.shape]
    dev = torch.device("cuda", 0)
    live_rows = T * topk  # one rank's routed rows under uniform routing (EP ranks x T x topk / EP)
    P = live_rows + live_rows // 7
    live = torch.tensor([live_rows], dtype=torch.int32, device=dev)
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    t = median_ms(lambda: big.clone())
    print(
        f"# {torch.cuda.get_device_name(dev)}, {a.shape}: pool {P} rows ({live_rows} live), H={H}, I={I}; "
        f"HBM copy of 1 GiB {t:.3f} ms = {2 * (1 << 30) / t / 1e6:.0f} GB/s (read + write)"
    )
    del big
    h = torch.randn(P, 2 * I, device=dev, dtype=torch.bfloat16)
    w = torch.rand(P, device=dev)
    act = torch.empty(P, I, dtype=torch.float8_e4m3fn, device=dev)
    act_s = torch.empty(P, I // 128, device=dev)
    nbytes = live_rows * (2 * I * 2 + I + I // 128 * 4)
    for block_r, warps in FORWARD_CONFIGS:
        t = median_ms(lambda: K_.swiglu_forward(h, w, act, act_s, live, 128, None, block_r=block_r, num_warps=warps))
        print(
            f"swiglu_forward fp8  rows/program {block_r:3d} warps {warps}: {t * 1e3:7.1f} us, "
            f"{nbytes / t / 1e6:5.0f} GB/s"
        )
    del act, act_s
    grad_act = torch.randn(P, I, device=dev, dtype=torch.bfloat16)
    grad_h = torch.empty(P, 2 * I, device=dev, dtype=torch.bfloat16)
    grad_w = torch.empty(P, device=dev)
    grad_h_q = torch.empty(P, 2 * I, dtype=torch.float8_e4m3fn, device=dev)
    grad_h_s = torch.empty(P, 2 * I // 128, device=dev)
    nbytes = live_rows * (2 * I * 2 + I * 2 + 2 * I * 2 + 2 * I + 2 * I // 128 * 4)
    for block_r, warps in BACKWARD_CONFIGS:
        t = median_ms(
            lambda: K_.swiglu_backward(
                h, w, grad_act, grad_h, grad_w, live, 128, None, grad_h_q, grad_h_s, block_r=block_r, num_warps=warps
            )
        )
        print(
            f"swiglu_backward fp8 rows/program {block_r:3d} warps {warps}: {t * 1e3:7.1f} us, "
            f"{nbytes / t / 1e6:5.0f} GB/s"
        )
    del h, grad_act, grad_h, grad_h_q, grad_h_s
    x = torch.empty(P, H, device=dev, dtype=torch.bfloat16)
    xq = torch.randn(P, H, device=dev).to(torch.float8_e4m3fn)
    xs = torch.rand(P, H // 128, device=dev)
    t = median_ms(lambda: K_.dequantize_rows(xq, xs, x, live))
    print(f"dequantize_rows [P, H]: {t * 1e3:7.1f} us, {live_rows * H * 3 / t / 1e6:5.0f} GB/s")


if __name__ == "__main__":
    main()
