"""Grouped expert GEMMs on CUTLASS (megamoe_train._cuda, built from csrc/cuda/).

The pool's expert groups are contiguous row ranges ending at `group_ends` (device int32):
group g computes out[rows] = a[rows] @ b[g]^T with fp32 accumulation and stores bf16.
- fp8: a e4m3 with 1x128 scales, b e4m3 [G, N, K] with 128x128 scales (DeepSeek-V3's recipe);
- bf16: b as [G, N, K] ("nk", the forward's x @ W^T) or [G, K, N] ("kn", the dgrad's dY @ W).
Group sizes are read on the device, so a call never syncs with the host and is capturable in a
CUDA graph. Rows past group_ends[-1] are left untouched.

The extension exists only where setup.py found nvcc and the CUTLASS headers; `available()` says
whether this process can use it (sm_90 only: the kernels use wgmma).
"""

from __future__ import annotations

import functools

import torch

try:
    from .. import _cuda
except ImportError:  # CPU-only build, or built without the CUDA toolchain
    _cuda = None

SCALE_BLOCK = 128
B_LAYOUTS = {"nk": 0, "kn": 1}
# Tile configurations picked by benchmarks/bench_gemm.py (variant index, scheduler swizzle);
# csrc/cuda/*_grouped_gemm.cu lists the variants.
FP8_DEFAULT = (0, 1)
BF16_DEFAULT = (0, 1)

# (kind, device index, groups, variant, layout, stream) -> scratch for CUTLASS's per-group
# argument arrays; per stream, so GEMMs queued on two streams never share one.
_WORKSPACES: dict[tuple, torch.Tensor] = {}


def available(device: torch.device) -> bool:
    if _cuda is None or device.type != "cuda":
        return False
    return _is_sm90(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _is_sm90(index: int) -> bool:  # asked before every GEMM: read the device once
    return torch.cuda.get_device_capability(index) == (9, 0)


def _workspace(kind: str, device: torch.device, groups: int, variant: int, layout: int, stream) -> torch.Tensor:
    key = (kind, device.index, groups, variant, layout, stream.cuda_stream)
    ws = _WORKSPACES.get(key)
    if ws is None:
        if kind == "fp8":
            nbytes = _cuda.fp8_grouped_gemm_workspace_bytes(groups, variant, device.index)
        else:
            nbytes = _cuda.bf16_grouped_gemm_workspace_bytes(groups, variant, layout, device.index)
        ws = _WORKSPACES[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return ws


def _check(fn: str, name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    if t.dtype != dtype or tuple(t.shape) != tuple(shape) or t.device != device or not t.is_contiguous():
        raise ValueError(
            f"{fn}: {name} must be a contiguous {dtype} tensor of shape {list(shape)} on {device}, "
            f"got {t.dtype} {list(t.shape)} on {t.device} (contiguous={t.is_contiguous()})"
        )


def _require_extension(fn: str) -> None:
    if _cuda is None:
        raise RuntimeError(f"{fn}: megamoe_train._cuda was not built (needs nvcc and nvidia-cutlass at install)")


def fp8_grouped_gemm(a, a_scales, b, b_scales, group_ends, out, variant: int | None = None, swizzle: int | None = None):
    """a e4m3 [M, K], a_scales fp32 [M, K/128]; b e4m3 [G, N, K], b_scales fp32 [G, N/128, K/128];
    group_ends int32 [G]; out bf16 [M, N]. Returns out."""
    fn = "fp8_grouped_gemm"
    _require_extension(fn)
    M, K = a.shape
    G, N = b.shape[0], b.shape[1]
    dev = a.device
    if K % SCALE_BLOCK or N % SCALE_BLOCK:
        raise ValueError(f"{fn}: N={N} and K={K} must be multiples of {SCALE_BLOCK}")
    _check(fn, "a", a, torch.float8_e4m3fn, (M, K), dev)
    _check(fn, "a_scales", a_scales, torch.float32, (M, K // SCALE_BLOCK), dev)
    _check(fn, "b", b, torch.float8_e4m3fn, (G, N, K), dev)
    _check(fn, "b_scales", b_scales, torch.float32, (G, N // SCALE_BLOCK, K // SCALE_BLOCK), dev)
    _check(fn, "group_ends", group_ends, torch.int32, (G,), dev)
    _check(fn, "out", out, torch.bfloat16, (M, N), dev)
    variant = FP8_DEFAULT[0] if variant is None else variant
    swizzle = FP8_DEFAULT[1] if swizzle is None else swizzle
    stream = torch.cuda.current_stream(dev)
    ws = _workspace("fp8", dev, G, variant, 0, stream)
    _cuda.fp8_grouped_gemm(
        a.data_ptr(), a_scales.data_ptr(), b.data_ptr(), b_scales.data_ptr(), out.data_ptr(), group_ends.data_ptr(),
        G, N, K, variant, swizzle, ws.data_ptr(), ws.numel(), stream.cuda_stream, dev.index,
    )
    return out


def bf16_grouped_gemm(a, b, group_ends, out, b_layout: str = "nk", variant: int | None = None, swizzle: int | None = None):
    """a bf16 [M, K]; b bf16 [G, N, K] (b_layout "nk") or [G, K, N] ("kn"); group_ends int32 [G];
    out bf16 [M, N]. Returns out."""
    fn = "bf16_grouped_gemm"
    _require_extension(fn)
    if b_layout not in B_LAYOUTS:
        raise ValueError(f"{fn}: b_layout must be one of {sorted(B_LAYOUTS)}, got {b_layout!r}")
    M, K = a.shape
    G = b.shape[0]
    N = b.shape[1] if b_layout == "nk" else b.shape[2]
    dev = a.device
    if K % 8 or N % 8:
        raise ValueError(f"{fn}: N={N} and K={K} must be multiples of 8 (16-byte rows)")
    _check(fn, "a", a, torch.bfloat16, (M, K), dev)
    _check(fn, "b", b, torch.bfloat16, (G, N, K) if b_layout == "nk" else (G, K, N), dev)
    _check(fn, "group_ends", group_ends, torch.int32, (G,), dev)
    _check(fn, "out", out, torch.bfloat16, (M, N), dev)
    variant = BF16_DEFAULT[0] if variant is None else variant
    swizzle = BF16_DEFAULT[1] if swizzle is None else swizzle
    layout = B_LAYOUTS[b_layout]
    stream = torch.cuda.current_stream(dev)
    ws = _workspace("bf16", dev, G, variant, layout, stream)
    _cuda.bf16_grouped_gemm(
        a.data_ptr(), b.data_ptr(), out.data_ptr(), group_ends.data_ptr(), G, N, K, layout, variant, swizzle,
        ws.data_ptr(), ws.numel(), stream.cuda_stream, dev.index,
    )
    return out
