"""Where does the fp8 weight-preparation kernel's time go? A copy of its per-block work with parts
switched off (the stores, the exact division, the amax), timed at the DeepSeek-V3 proxy's
per-layer expert weights on one GPU next to the production kernel. Diagnosis only: the variants
are not bit-exact and nothing else uses them.

  python benchmarks/diagnose_weight_prep.py

Measured 2026-12-01 (1x H200): with div_rn the pass took 2.2x its multiply variant, which led to
triton_kernels.divide_rn.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from timing import hbm_bandwidth, median_ms  # noqa: E402

from megamoe_train.backends import triton_weight_prep as W  # noqa: E402
from megamoe_train.backends.triton_weight_prep import _block_ids  # noqa: E402


@triton.jit
def diag_kernel(
    src,
    stride_e,
    stride_n,
    stride_k,
    data,
    scales,
    data_t,
    scales_t,
    N,
    K,
    STORE: tl.constexpr,
    STORE_T: tl.constexpr,
    EXACT: tl.constexpr,
    AMAX: tl.constexpr,
    TRANS_Y: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e, nb, kb, n_blocks, k_blocks = _block_ids(N, K, BLOCK_N, BLOCK_K)  # the production kernel's blocks
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_K)
    block = src + e * stride_e + (nb * BLOCK_N).to(tl.int64) * stride_n + (kb * BLOCK_K).to(tl.int64) * stride_k
    x = tl.load(block + r[:, None] * stride_n + c[None, :] * stride_k).to(tl.float32)
    if AMAX:
        amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.float32, bitcast=True)
        scale = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
    else:
        scale = 0.01
    if EXACT:
        y = tl.math.div_rn(x, scale)
    else:
        y = x * (1.0 / scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    base = e * N * K
    if STORE:
        out = data + base + (nb * BLOCK_N).to(tl.int64) * K + kb * BLOCK_K
        tl.store(out + r[:, None] * K + c[None, :], q)
    tl.store(scales + (e * n_blocks + nb) * k_blocks + kb, scale)
    if STORE_T:
        out_t = data_t + base + (kb * BLOCK_K).to(tl.int64) * N + nb * BLOCK_N
        if TRANS_Y:
            tl.store(out_t + c[:, None] * N + r[None, :], tl.trans(y).to(tl.float8e4nv).to(tl.uint8, bitcast=True))
        else:
            tl.store(out_t + c[:, None] * N + r[None, :], tl.trans(q))
    tl.store(scales_t + (e * k_blocks + kb) * n_blocks + nb, scale)


def run(w, cfg, nw):
    """ms of one diag_kernel launch over w with the switches cfg."""
    E, N, K = w.shape
    data = torch.empty(E, N, K, dtype=torch.uint8, device=w.device)
    data_t = torch.empty(E, K, N, dtype=torch.uint8, device=w.device)
    scales = torch.empty(E, N // 128, K // 128, device=w.device)
    scales_t = torch.empty(E, K // 128, N // 128, device=w.device)
    grid = (E * (N // 128) * (K // 128),)
    return median_ms(
        lambda: diag_kernel[grid](
            w, *w.stride(), data, scales, data_t, scales_t, N, K, **cfg, BLOCK_N=128, BLOCK_K=128, num_warps=nw
        ),
        20,
        3,
    )


def main():
    dev = torch.device("cuda")
    bw = hbm_bandwidth() / 1e9
    print(f"HBM copy rate {bw:.0f} GB/s")
    for name, shape in (("w1 proxy", (128, 1024, 2048)), ("w2 proxy", (128, 2048, 512))):
        w = torch.randn(*shape, device=dev, dtype=torch.bfloat16)
        n = w.numel()
        floor = n * 4 / (bw * 1e6)
        print(f"\n{name} {shape}: {n / 1e6:.0f} M elements, floor (2 B read + 2 x 1 B write) {floor:.3f} ms")
        t = median_ms(lambda: W.quantize_blocks(w, chunk=None), 20, 3)
        print(f"  quantize_blocks as it runs by default (64 rows at a time, 8 warps): {t:.3f} ms")
        t = median_ms(lambda: W.quantize_blocks(w, chunk=None, num_warps=16, rows_per_step=None), 20, 3)
        print(f"  quantize_blocks whole blocks, nw16 (the cases below switch parts of this one off): {t:.3f} ms")
        cases = {
            "full (STORE, STORE_T, EXACT, AMAX)": dict(STORE=True, STORE_T=True, EXACT=True, AMAX=True, TRANS_Y=False),
            "no transposed store": dict(STORE=True, STORE_T=False, EXACT=True, AMAX=True, TRANS_Y=False),
            "no plain store": dict(STORE=False, STORE_T=True, EXACT=True, AMAX=True, TRANS_Y=False),
            "no stores (read + amax + div)": dict(STORE=False, STORE_T=False, EXACT=True, AMAX=True, TRANS_Y=False),
            "multiply not div_rn": dict(STORE=True, STORE_T=True, EXACT=False, AMAX=True, TRANS_Y=False),
            "no amax": dict(STORE=True, STORE_T=True, EXACT=True, AMAX=False, TRANS_Y=False),
            "no amax, multiply": dict(STORE=True, STORE_T=True, EXACT=False, AMAX=False, TRANS_Y=False),
            "transpose fp32 y": dict(STORE=True, STORE_T=True, EXACT=True, AMAX=True, TRANS_Y=True),
        }
        for label, cfg in cases.items():
            row = []
            for nw in (4, 8, 16):
                try:
                    row.append(f"nw{nw} {run(w, cfg, nw):.3f}")
                except Exception as ex:  # noqa: BLE001 (a variant that does not compile is reported, not fatal)
                    row.append(f"nw{nw} ERR {type(ex).__name__}")
            print(f"  {label:40s} " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
