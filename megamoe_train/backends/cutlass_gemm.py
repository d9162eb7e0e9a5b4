"""FP8 block-scaled grouped GEMM on CUTLASS (megamoe_train._cuda, built from csrc/cuda/).

The pool's expert groups are contiguous row ranges ending at `group_ends` (device int32, padded
to the pool's block): group g computes out[rows] = (a[rows] * a_scales) @ (b[g] * b_scales)^T in
fp32 and stores bf16. Group sizes are read on the device, so the call never syncs with the host
and is capturable in a CUDA graph. Rows past group_ends[-1] are left untouched.

The extension exists only where setup.py found nvcc and the CUTLASS headers; `available()` says
whether this process can use it (it runs on sm_90 only: the kernels use wgmma).
"""

from __future__ import annotations

import torch

try:
    from .. import _cuda
except ImportError:  # CPU-only build, or built without the CUDA toolchain
    _cuda = None

SCALE_BLOCK = 128

# (device index, groups, stream) -> scratch for CUTLASS's per-group argument arrays. Per stream,
# so GEMMs queued on two streams never share one.
_WORKSPACES: dict[tuple[int, int, int], torch.Tensor] = {}


def available(device: torch.device) -> bool:
    return _cuda is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def _workspace(device: torch.device, num_groups: int, stream: torch.cuda.Stream) -> torch.Tensor:
    key = (device.index, num_groups, stream.cuda_stream)
    ws = _WORKSPACES.get(key)
    if ws is None:
        nbytes = _cuda.fp8_grouped_gemm_workspace_bytes(num_groups, device.index)
        ws = _WORKSPACES[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return ws


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    if t.dtype != dtype or tuple(t.shape) != tuple(shape) or t.device != device or not t.is_contiguous():
        raise ValueError(
            f"fp8_grouped_gemm: {name} must be a contiguous {dtype} tensor of shape {list(shape)} on {device}, "
            f"got {t.dtype} {list(t.shape)} on {t.device} (contiguous={t.is_contiguous()})"
        )


def fp8_grouped_gemm(a, a_scales, b, b_scales, group_ends, out):
    """a e4m3 [M, K], a_scales fp32 [M, K/128]; b e4m3 [G, N, K], b_scales fp32 [G, N/128, K/128];
    group_ends int32 [G] (each group a multiple of 16 rows); out bf16 [M, N]. Returns out."""
    if _cuda is None:
        raise RuntimeError("fp8_grouped_gemm: megamoe_train._cuda was not built (needs nvcc and nvidia-cutlass at install)")
    M, K = a.shape
    G, N = b.shape[0], b.shape[1]
    dev = a.device
    if K % SCALE_BLOCK or N % SCALE_BLOCK:
        raise ValueError(f"fp8_grouped_gemm: N={N} and K={K} must be multiples of {SCALE_BLOCK}")
    _check("a", a, torch.float8_e4m3fn, (M, K), dev)
    _check("a_scales", a_scales, torch.float32, (M, K // SCALE_BLOCK), dev)
    _check("b", b, torch.float8_e4m3fn, (G, N, K), dev)
    _check("b_scales", b_scales, torch.float32, (G, N // SCALE_BLOCK, K // SCALE_BLOCK), dev)
    _check("group_ends", group_ends, torch.int32, (G,), dev)
    _check("out", out, torch.bfloat16, (M, N), dev)
    stream = torch.cuda.current_stream(dev)
    ws = _workspace(dev, G, stream)
    _cuda.fp8_grouped_gemm(
        a.data_ptr(), a_scales.data_ptr(), b.data_ptr(), b_scales.data_ptr(), out.data_ptr(),
        group_ends.data_ptr(), G, N, K, ws.data_ptr(), ws.numel(), stream.cuda_stream, dev.index,
    )
    return out
