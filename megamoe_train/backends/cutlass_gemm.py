"""Grouped expert GEMMs on CUTLASS (megamoe_train._cuda, built from csrc/cuda/).

The pool's expert groups are contiguous row ranges ending at `group_ends` (device int32).
Forward and dgrad: group g computes out[rows] = a[rows] @ b[g]^T with fp32 accumulation and
stores bf16; rows past group_ends[-1] are left untouched.
- fp8: a e4m3 with 1x128 scales, b e4m3 [G, N, K] with 128x128 scales (DeepSeek-V3's recipe);
- bf16: b as [G, N, K] ("nk", the forward's x @ W^T) or [G, K, N] ("kn", the dgrad's dY @ W).
Weight gradients (`fp8_wgrad_grouped_gemm`): the rows are the K of expert g's product of two
pool-transposed operands, out[g] = a_t[:, rows] @ b_t[:, rows]^T, 1x128 scales on both; and
from the bf16 pool operands as stored, out[g] = a[rows]^T @ b[rows] stored bf16 or fp32
(`bf16_wgrad_grouped_gemm`) or added in fp32 (`bf16_wgrad_grouped_gemm_accumulate`, e.g. into
Megatron's fp32 main_grad).
Group sizes are read on the device, so a call never syncs with the host and is capturable in a
CUDA graph.

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
# bf16: 128x256 tiles in N-paired clusters, swizzle 4. In the layer it beat M-paired clusters (torch's
# choice) at S1 and S4: routed experts get a varying number of 128-row tiles, and an odd count
# leaves one CTA of an M pair idle (bench_layer A/B, docs/kernels.md).
BF16_DEFAULT = (2, 4)
FP8_WGRAD_DEFAULT = (0, 1)  # not yet chosen by a measurement
BF16_WGRAD_DEFAULT = (0, 1)  # accumulating into fp32, where no expert depth is given
# Accumulating into fp32 by experts' mean depth (pool rows per expert): ping-pong with C prefetched a
# tile ahead (5) from 320 rows (bench_gemm wgrad_acc, 1x H200: proxy's 512 rows W2 -14% / W1 -4%,
# S1's 384 -4% / -7% against 0), cooperative 128x128 (0) below (S4's 256 rows: 5 is 9% slower on W1),
# ping-pong with the builder's buffers (2) from 1024 (2026-12-01, 2048 rows: W2 1.016 vs 1.089 ms,
# W1 2.073 vs 2.195; the switch lies between the measured 512 and 2048).
BF16_WGRAD_DEEP_ROWS, BF16_WGRAD_DEEP = 320, (5, 1)
BF16_WGRAD_DEEPER_ROWS, BF16_WGRAD_DEEPER = 1024, (2, 1)
BF16_WGRAD_STORE_DEFAULT = (
    2,
    4,
)  # storing bf16: ping-pong (bench_gemm --gemms wgrad; the executor's with MEGAMOE_BF16_WGRAD=cutlass)
# Writing fp32 over main_grad, by experts' mean depth (bench_gemm wgrad_acc, 1x H200, 2026-12-01):
# cooperative 128x256 (1) at the 1-GPU proxy's 256 rows (W2 0.505 ms vs 0.560 for 5, W1 0.899 vs
# 1.099), ping-pong 5 at the 2-GPU proxy's 2048 (0.978 vs 1.024, 1.914 vs 1.991); the switch lies
# between the two measured depths.
BF16_WGRAD_STORE32_DEEP_ROWS, BF16_WGRAD_STORE32_DEEP, BF16_WGRAD_STORE32_SHALLOW = 1024, (5, 1), (1, 1)
# The stored outputs of the bf16 wgrad (csrc/cuda/grouped_gemm.h, Bf16WgradOutput), by kind.
_BF16_WGRAD_OUTPUT = {"bf16_wgrad_store": 0, "bf16_wgrad_store_fp32": 1, "bf16_wgrad": 2}

# (kind, device index, groups, variant, layout, stream) -> scratch for CUTLASS's per-group
# argument arrays; per stream, so GEMMs queued on two streams never share one.
_WORKSPACES: dict[tuple, torch.Tensor] = {}


def available(device: torch.device) -> bool:
    if _cuda is None or device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _is_sm90(torch.cuda.current_device() if device.index is None else device.index)


def takes(*tensors: torch.Tensor) -> bool:
    """Our CUTLASS GEMMs are built for these tensors' GPU and each starts 16-byte aligned (TMA)."""
    return available(tensors[0].device) and all(t.data_ptr() % 16 == 0 for t in tensors)


def has_expert_gemm(device: torch.device) -> bool:
    """available(), and the extension has our fused expert GEMMs (an older build may not)."""
    return available(device) and hasattr(_cuda, "expert_gemm_swiglu")


def has_expert_gemm_mx(device: torch.device) -> bool:
    """available(), and the extension has the expert GEMM that reads E2M1 weights."""
    return available(device) and hasattr(_cuda, "expert_gemm_mx")


@functools.cache
def _is_sm90(index: int) -> bool:  # asked before every GEMM: read the device once
    return torch.cuda.get_device_capability(index) == (9, 0)


def _workspace(kind: str, device: torch.device, groups: int, variant: int, layout: int, stream) -> torch.Tensor:
    key = (kind, device.index, groups, variant, layout, stream.cuda_stream)
    ws = _WORKSPACES.get(key)
    if ws is None:
        if kind == "fp8":
            nbytes = _cuda.fp8_grouped_gemm_workspace_bytes(groups, variant, device.index)
        elif kind == "fp8_wgrad":
            nbytes = _cuda.fp8_wgrad_grouped_gemm_workspace_bytes(groups, variant, device.index)
        elif kind in _BF16_WGRAD_OUTPUT:
            nbytes = _cuda.bf16_wgrad_grouped_gemm_workspace_bytes(
                groups, variant, _BF16_WGRAD_OUTPUT[kind], device.index
            )
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


def _tma_operands_on_cuda(fn: str, tma_operands: dict) -> torch.device:
    """After a wrapper's shape checks: every operand the GEMM reads or writes by TMA starts 16-byte
    aligned (a contiguous view can start anywhere; the row strides are checked by the shapes), the
    operands are CUDA tensors and the extension is built. Returns their device."""
    for name, t in tma_operands.items():
        if t.data_ptr() % 16:
            raise ValueError(f"{fn}: {name} must start at a 16-byte aligned address (TMA), got {t.data_ptr():#x}")
    dev = next(iter(tma_operands.values())).device
    if dev.type != "cuda":
        raise ValueError(f"{fn}: the operands must be CUDA tensors, got {dev}")
    _require_extension(fn)
    return dev


def _nonempty_output(fn: str, m: int, n: int) -> None:
    """A depth-grouped GEMM's out [G, M, N] holds expert weight gradients: a weight with an empty
    dimension is a bad config, and the launch would fail with a generic error (no fill blocks)."""
    if m == 0 or n == 0:
        raise ValueError(f"{fn}: M={m} and N={n} must be positive (out [G, M, N]: an expert weight's gradient)")


# the depth-grouped (wgrad) GEMMs: (default variant, swizzle) and the extension's variant count
_DEPTH_GROUPED = {
    "fp8_wgrad": (FP8_WGRAD_DEFAULT, "FP8_WGRAD_VARIANTS"),
    "bf16_wgrad": (BF16_WGRAD_DEFAULT, "BF16_WGRAD_VARIANTS"),
    "bf16_wgrad_store": (BF16_WGRAD_STORE_DEFAULT, "BF16_WGRAD_VARIANTS"),
    "bf16_wgrad_store_fp32": (BF16_WGRAD_STORE32_SHALLOW, "BF16_WGRAD_VARIANTS"),
}


def _depth_grouped_launch(fn: str, kind: str, tma_operands: dict, groups: int, variant, swizzle):
    """After a wgrad wrapper's shape checks: TMA alignment and CUDA placement of its operands, the
    extension, the variant; returns (variant, swizzle, stream, workspace)."""
    dev = _tma_operands_on_cuda(fn, tma_operands)
    (default_variant, default_swizzle), count_attr = _DEPTH_GROUPED[kind]
    variant = default_variant if variant is None else variant
    swizzle = default_swizzle if swizzle is None else swizzle
    count = getattr(_cuda, count_attr)
    if not 0 <= variant < count:
        raise ValueError(f"{fn}: variant must be in [0, {count}), got {variant}")
    stream = torch.cuda.current_stream(dev)
    return variant, swizzle, stream, _workspace(kind, dev, groups, variant, 0, stream)


def fp8_grouped_gemm(a, a_scales, b, b_scales, group_ends, out, variant: int | None = None, swizzle: int | None = None):
    """a e4m3 [M, K], a_scales fp32 [M, K/128]; b e4m3 [G, N, K], b_scales fp32 [G, N/128, K/128];
    group_ends int32 [G]; out bf16 [M, N]. Returns out."""
    fn = "fp8_grouped_gemm"
    # shapes, dtypes and layout first (testable without a GPU), then alignment, device, extension
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(f"{fn}: a [M, K] and b [G, N, K] expected, got shapes {list(a.shape)} and {list(b.shape)}")
    M, K = a.shape
    G, N = b.shape[0], b.shape[1]
    dev = a.device
    if K % SCALE_BLOCK or N % SCALE_BLOCK:
        raise ValueError(f"{fn}: N={N} and K={K} must be multiples of {SCALE_BLOCK}")
    if K == 0:  # the main loop cannot run zero K steps (its accumulators would never be cleared)
        raise ValueError(f"{fn}: K must be positive")
    _check(fn, "a", a, torch.float8_e4m3fn, (M, K), dev)
    _check(fn, "a_scales", a_scales, torch.float32, (M, K // SCALE_BLOCK), dev)
    _check(fn, "b", b, torch.float8_e4m3fn, (G, N, K), dev)
    _check(fn, "b_scales", b_scales, torch.float32, (G, N // SCALE_BLOCK, K // SCALE_BLOCK), dev)
    _check(fn, "group_ends", group_ends, torch.int32, (G,), dev)
    _check(fn, "out", out, torch.bfloat16, (M, N), dev)
    _tma_operands_on_cuda(fn, dict(a=a, b=b, out=out))
    variant = FP8_DEFAULT[0] if variant is None else variant
    swizzle = FP8_DEFAULT[1] if swizzle is None else swizzle
    stream = torch.cuda.current_stream(dev)
    ws = _workspace("fp8", dev, G, variant, 0, stream)
    _cuda.fp8_grouped_gemm(
        a.data_ptr(),
        a_scales.data_ptr(),
        b.data_ptr(),
        b_scales.data_ptr(),
        out.data_ptr(),
        group_ends.data_ptr(),
        G,
        N,
        K,
        variant,
        swizzle,
        ws.data_ptr(),
        ws.numel(),
        stream.cuda_stream,
        dev.index,
    )
    return out


def bf16_grouped_gemm(
    a, b, group_ends, out, b_layout: str = "nk", variant: int | None = None, swizzle: int | None = None
):
    """a bf16 [M, K]; b bf16 [G, N, K] (b_layout "nk") or [G, K, N] ("kn"); group_ends int32 [G];
    out bf16 [M, N]. Returns out."""
    fn = "bf16_grouped_gemm"
    if b_layout not in B_LAYOUTS:
        raise ValueError(f"{fn}: b_layout must be one of {sorted(B_LAYOUTS)}, got {b_layout!r}")
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(
            f"{fn}: a [M, K] and b [G, N, K] or [G, K, N] expected, got shapes {list(a.shape)} and {list(b.shape)}"
        )
    M, K = a.shape
    G = b.shape[0]
    N = b.shape[1] if b_layout == "nk" else b.shape[2]
    dev = a.device
    if K % 8 or N % 8:
        raise ValueError(f"{fn}: N={N} and K={K} must be multiples of 8 (16-byte rows)")
    if K == 0:  # the main loop cannot run zero K steps (its accumulators would never be cleared)
        raise ValueError(f"{fn}: K must be positive")
    _check(fn, "a", a, torch.bfloat16, (M, K), dev)
    _check(fn, "b", b, torch.bfloat16, (G, N, K) if b_layout == "nk" else (G, K, N), dev)
    _check(fn, "group_ends", group_ends, torch.int32, (G,), dev)
    _check(fn, "out", out, torch.bfloat16, (M, N), dev)
    _tma_operands_on_cuda(fn, dict(a=a, b=b, out=out))
    variant = BF16_DEFAULT[0] if variant is None else variant
    swizzle = BF16_DEFAULT[1] if swizzle is None else swizzle
    layout = B_LAYOUTS[b_layout]
    stream = torch.cuda.current_stream(dev)
    ws = _workspace("bf16", dev, G, variant, layout, stream)
    _cuda.bf16_grouped_gemm(
        a.data_ptr(),
        b.data_ptr(),
        out.data_ptr(),
        group_ends.data_ptr(),
        G,
        N,
        K,
        layout,
        variant,
        swizzle,
        ws.data_ptr(),
        ws.numel(),
        stream.cuda_stream,
        dev.index,
    )
    return out


def fp8_wgrad_grouped_gemm(
    a_t, a_t_scales, b_t, b_t_scales, group_ends, out, variant: int | None = None, swizzle: int | None = None
):
    """The fp8 recipe's expert weight gradients, one K-grouped GEMM: for each expert g with pool
    rows [s, e) (s = group_ends[g-1] or 0, e = group_ends[g]),
        out[g] = sum over k in [s, e) of (a_t[:, k] * a_t_scales[:, k // 128]) outer
                                         (b_t[:, k] * b_t_scales[:, k // 128])
    with fp32 accumulation (the scales applied per 128-deep K step), stored bf16.

    a_t e4m3 [M, P] and b_t e4m3 [N, P]: the pool's operands transposed, pool rows contiguous
    (P, M and N multiples of 128, M and N positive); a_t_scales fp32 [M, P/128], b_t_scales fp32
    [N, P/128]; group_ends int32 [G]: multiples of 128, nondecreasing, at most P; out bf16 [G, M, N].
    An expert with no rows gets zeros; pool rows past group_ends[-1] are not read. group_ends is
    read on the device only, so it is not checked here: a group whose range breaks those rules
    is not computed and its out[g] is NaN. Returns out."""
    fn = "fp8_wgrad_grouped_gemm"
    # shapes, dtypes and layout first (testable without a GPU), then the device and the extension
    if a_t.dim() != 2 or b_t.dim() != 2 or group_ends.dim() != 1:
        raise ValueError(
            f"{fn}: a_t [M, P], b_t [N, P] and group_ends [G] expected, got shapes "
            f"{list(a_t.shape)}, {list(b_t.shape)} and {list(group_ends.shape)}"
        )
    (M, P), N, G = a_t.shape, b_t.shape[0], group_ends.shape[0]
    if G == 0:
        raise ValueError(f"{fn}: group_ends is empty (no experts)")
    _nonempty_output(fn, M, N)
    if M % SCALE_BLOCK or N % SCALE_BLOCK or P % SCALE_BLOCK:
        raise ValueError(f"{fn}: M={M}, N={N} and P={P} (pool rows) must be multiples of {SCALE_BLOCK}")
    dev = a_t.device
    _check(fn, "a_t", a_t, torch.float8_e4m3fn, (M, P), dev)
    _check(fn, "a_t_scales", a_t_scales, torch.float32, (M, P // SCALE_BLOCK), dev)
    _check(fn, "b_t", b_t, torch.float8_e4m3fn, (N, P), dev)
    _check(fn, "b_t_scales", b_t_scales, torch.float32, (N, P // SCALE_BLOCK), dev)
    _check(fn, "group_ends", group_ends, torch.int32, (G,), dev)
    _check(fn, "out", out, torch.bfloat16, (G, M, N), dev)
    variant, swizzle, stream, ws = _depth_grouped_launch(
        fn, "fp8_wgrad", dict(a_t=a_t, b_t=b_t, out=out), G, variant, swizzle
    )
    _cuda.fp8_wgrad_grouped_gemm(
        a_t.data_ptr(),
        a_t_scales.data_ptr(),
        b_t.data_ptr(),
        b_t_scales.data_ptr(),
        out.data_ptr(),
        group_ends.data_ptr(),
        G,
        M,
        N,
        P,
        variant,
        swizzle,
        ws.data_ptr(),
        ws.numel(),
        stream.cuda_stream,
        dev.index,
    )
    return out


def bf16_wgrad_grouped_gemm(a, b, group_ends, out, variant: int | None = None, swizzle: int | None = None):
    """Expert weight gradients from the bf16 pool operands, one K-grouped GEMM: for each expert g
    with pool rows [s, e) (s = group_ends[g-1] or 0, e = group_ends[g]),
        out[g] = a[s:e]^T @ b[s:e]        (fp32 accumulation, stored in out's dtype)

    a bf16 [P, M] (the output gradients' pool rows), b bf16 [P, N] (the inputs' pool rows), both
    as stored (P, M and N multiples of 8, M and N positive); group_ends int32 [G], nondecreasing,
    at most P; out bf16 or fp32 [G, M, N], never read (fp32: e.g. a main_grad whose contents are
    stale, written over instead of zeroed and added to). An expert with no rows gets zeros;
    group_ends is read on the device only, and a group whose range is not inside [0, P] is not
    computed and gets NaN. Returns out."""
    return _bf16_wgrad("bf16_wgrad_grouped_gemm", a, b, group_ends, out, variant, swizzle, accumulate=False)


def bf16_wgrad_accumulate_config(mean_rows_per_group: float) -> tuple[int, int]:
    """(variant, swizzle) of bf16_wgrad_grouped_gemm_accumulate for experts of this mean depth."""
    if mean_rows_per_group >= BF16_WGRAD_DEEPER_ROWS:
        return BF16_WGRAD_DEEPER
    return BF16_WGRAD_DEEP if mean_rows_per_group >= BF16_WGRAD_DEEP_ROWS else BF16_WGRAD_DEFAULT


def bf16_wgrad_store32_config(mean_rows_per_group: float) -> tuple[int, int]:
    """(variant, swizzle) of bf16_wgrad_grouped_gemm into fp32 for experts of this mean depth."""
    return (
        BF16_WGRAD_STORE32_DEEP if mean_rows_per_group >= BF16_WGRAD_STORE32_DEEP_ROWS else BF16_WGRAD_STORE32_SHALLOW
    )


def bf16_wgrad_grouped_gemm_accumulate(a, b, group_ends, out, variant: int | None = None, swizzle: int | None = None):
    """Expert weight gradients accumulated in fp32, one K-grouped GEMM: for each expert g with pool
    rows [s, e) (s = group_ends[g-1] or 0, e = group_ends[g]),
        out[g] += a[s:e]^T @ b[s:e]        (fp32 accumulation, added unrounded to out[g])

    a bf16 [P, M] (the output gradients' pool rows), b bf16 [P, N] (the inputs' pool rows), both
    as stored (P, M and N multiples of 8, M and N positive); group_ends int32 [G], nondecreasing,
    at most P; out fp32 [G, M, N] (e.g. a stacked expert weight's main_grad). An expert with no
    rows adds nothing; group_ends is read on the device only, and a group whose range is not
    inside [0, P] is skipped. Returns out."""
    return _bf16_wgrad("bf16_wgrad_grouped_gemm_accumulate", a, b, group_ends, out, variant, swizzle, accumulate=True)


def _bf16_wgrad(fn, a, b, group_ends, out, variant, swizzle, accumulate: bool):
    if a.dim() != 2 or b.dim() != 2 or group_ends.dim() != 1 or out.dim() != 3:
        raise ValueError(
            f"{fn}: a [P, M], b [P, N], group_ends [G] and out [G, M, N] expected, got shapes "
            f"{list(a.shape)}, {list(b.shape)}, {list(group_ends.shape)} and {list(out.shape)}"
        )
    (P, M), N, G = a.shape, b.shape[1], group_ends.shape[0]
    if G == 0:
        raise ValueError(f"{fn}: group_ends is empty (no experts)")
    _nonempty_output(fn, M, N)
    if M % 8 or N % 8:
        raise ValueError(f"{fn}: M={M} and N={N} must be multiples of 8 (16-byte rows)")
    # The TMA steps the pool's rows M and N elements apart and needs nothing of P, but the
    # extension's launch check holds every grouped GEMM's K to 16 bytes, and here K is P: without
    # this check it answers "N and K must be multiples of 16 bytes".
    if P % 8:
        raise ValueError(
            f"{fn}: P={P} (the pool rows of a [P, M] and b [P, N], the GEMM's depth) must be a multiple of 8 "
            "(the extension's K rule: 16 bytes); pad the pool (rows past group_ends[-1] are not read)"
        )
    dev = a.device
    _check(fn, "a", a, torch.bfloat16, (P, M), dev)
    _check(fn, "b", b, torch.bfloat16, (P, N), dev)
    _check(fn, "group_ends", group_ends, torch.int32, (G,), dev)
    if accumulate:
        kind = "bf16_wgrad"
    else:
        kind = "bf16_wgrad_store_fp32" if out.dtype == torch.float32 else "bf16_wgrad_store"
    _check(fn, "out", out, torch.bfloat16 if kind == "bf16_wgrad_store" else torch.float32, (G, M, N), dev)
    variant, swizzle, stream, ws = _depth_grouped_launch(fn, kind, dict(a=a, b=b, out=out), G, variant, swizzle)
    _cuda.bf16_wgrad_grouped_gemm(
        a.data_ptr(),
        b.data_ptr(),
        out.data_ptr(),
        group_ends.data_ptr(),
        G,
        M,
        N,
        P,
        _BF16_WGRAD_OUTPUT[kind],
        variant,
        swizzle,
        ws.data_ptr(),
        ws.numel(),
        stream.cuda_stream,
        dev.index,
    )
    return out


# ----------------------------------------------------------------------------- our fp8 expert GEMMs
# (csrc/cuda/expert_gemm.h): one persistent launch over the pool with two TMA descriptors for the
# whole call; the L1 one with clamp + SwiGLU + topk weight + e4m3 requantization in its epilogue.


def _fp8_expert_operands(fn: str, a, a_scales, b, b_scales, group_ends, out, n_out: int, packed: bool = False):
    """The shared checks of our expert GEMMs' operands; packed: b is E2M1, uint8 [G, N, K/2]."""
    b_k = "K/2" if packed else "K"
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(f"{fn}: a [P, K] and b [G, N, {b_k}] expected, got shapes {list(a.shape)} and {list(b.shape)}")
    P, K = a.shape
    G, N = b.shape[0], b.shape[1]
    dev = a.device
    if K % SCALE_BLOCK or N % SCALE_BLOCK or K == 0:
        raise ValueError(f"{fn}: N={N} and K={K} must be multiples of {SCALE_BLOCK} (K > 0)")
    if not 0 < G <= 1024:
        raise ValueError(f"{fn}: 1 to 1024 groups, got {G}")
    _check(fn, "a", a, torch.float8_e4m3fn, (P, K), dev)
    _check(fn, "a_scales", a_scales, torch.float32, (P, K // SCALE_BLOCK), dev)
    if packed:
        _check(fn, "b", b, torch.uint8, (G, N, K // 2), dev)
    else:
        _check(fn, "b", b, torch.float8_e4m3fn, (G, N, K), dev)
    _check(fn, "b_scales", b_scales, torch.float32, (G, N // SCALE_BLOCK, K // SCALE_BLOCK), dev)
    _check(fn, "group_ends", group_ends, torch.int32, (G,), dev)
    _check(fn, "out", out, torch.bfloat16, (P, n_out), dev)
    _tma_operands_on_cuda(fn, dict(a=a, b=b))
    return P, K, G, N, dev


def fp8_expert_gemm(a, a_scales, b, b_scales, group_ends, out, variant: int = 0):
    """out[rows of g] = (a * a_scales)[rows] @ (b[g] * b_scales[g])^T, as fp8_grouped_gemm, on our
    persistent kernel. a e4m3 [P, K] + fp32 [P, K/128]; b e4m3 [G, N, K] + fp32 [G, N/128, K/128];
    out bf16 [P, N]. variant (csrc/cuda/expert_gemm.h; all give the same bits): 0, the default,
    CTA pairs share each A tile by multicast where a tile has an even number of 128-column blocks,
    and each block's epilogue runs under the next block's wgmmas, staged in shared memory, with the
    two math warpgroups a K block apart; 1 the same without pairs; 4 and 5 those two without the
    stagger; 2 and 3 the first schedule (epilogue stored from the fragments, no wgmma in flight)
    with and without pairs, kept for comparisons; + 16 (16-21) each of them with a tile's 64-row
    halves that lie wholly past their group's end neither loaded nor (staged) multiplied. out must
    be 16-byte aligned. Returns out."""
    fn = "fp8_expert_gemm"
    P, K, G, N, dev = _fp8_expert_operands(
        fn, a, a_scales, b, b_scales, group_ends, out, b.shape[1] if b.dim() == 3 else 0
    )
    _cuda.expert_gemm(
        a.data_ptr(),
        a_scales.data_ptr(),
        b.data_ptr(),
        b_scales.data_ptr(),
        group_ends.data_ptr(),
        out.data_ptr(),
        G,
        P,
        N,
        K,
        variant,
        torch.cuda.current_stream(dev).cuda_stream,
        dev.index,
    )
    return out


def fp8_expert_gemm_mx(a, a_scales, b, b_shifts, b_scales, group_ends, out, variant: int = 0):
    """fp8_expert_gemm with b the MX recipe's E2M1 weights as stored: packed uint8 [G, N, K/2]
    (quant.pack_fp4's order), expanded to e4m3 in shared memory with b_shifts uint8
    [G, N/128, K/128, 128, 4] and b_scales fp32 [G, N/128, K/128] (quant.mx_weight_shifts of the
    weights' ue8m0 scales): out equals fp8_expert_gemm's on quant.fold_mx_weight's e4m3 weights,
    bit for bit. a e4m3 [P, K] + fp32 [P, K/128] (quant.fold_mx_act's operand); out bf16 [P, N].
    variant as fp8_expert_gemm's, on the staged schedule only (0, 1, 4, 5, + 16), and + 32: the math
    warpgroups share the expansion with the producer's converter warps, each expanding its part of
    the stage two ahead under its own wgmmas (same bits). Returns out."""
    fn = "fp8_expert_gemm_mx"
    n_out = b.shape[1] if b.dim() == 3 else 0
    P, K, G, N, dev = _fp8_expert_operands(fn, a, a_scales, b, b_scales, group_ends, out, n_out, packed=True)
    _check(fn, "b_shifts", b_shifts, torch.uint8, (G, N // SCALE_BLOCK, K // SCALE_BLOCK, SCALE_BLOCK, 4), dev)
    _tma_operands_on_cuda(fn, dict(b_shifts=b_shifts))
    _cuda.expert_gemm_mx(
        a.data_ptr(),
        a_scales.data_ptr(),
        b.data_ptr(),
        b_shifts.data_ptr(),
        b_scales.data_ptr(),
        group_ends.data_ptr(),
        out.data_ptr(),
        G,
        P,
        N,
        K,
        variant,
        torch.cuda.current_stream(dev).cuda_stream,
        dev.index,
    )
    return out


def fp8_expert_gemm_swiglu(
    a, a_scales, b, b_scales, group_ends, row_weights, chunk: int, clamp, pre_act, act, act_scales, variant: int = 0
):
    """The L1 GEMM with SwiGLU fused: pre_act = the product (bf16 [P, 2I], gate/up interleaved in
    chunks of `chunk` as b's rows are), act = e4m3(silu(min(g, c)) * clamp(u, -c, c) * row_weights)
    [P, I] with act_scales fp32 [P, I/128] (one per 1x128 block), for every row of every group.
    variant as fp8_expert_gemm's, where on the staged schedule (0, 1, 4, 5) the SwiGLU epilogue
    runs from the unit's staged gate and up blocks in passes under the next unit's wgmmas; + 8
    (8, 9, 12, 13) runs it in place at the up block's end instead, kept for comparisons; + 16 skips
    dead halves as in fp8_expert_gemm; all give the same bits. Returns (pre_act,
    act, act_scales)."""
    fn = "fp8_expert_gemm_swiglu"
    N2 = b.shape[1] if b.dim() == 3 else 0
    P, K, G, N, dev = _fp8_expert_operands(fn, a, a_scales, b, b_scales, group_ends, pre_act, N2)
    I = N // 2
    if N % 256 or not isinstance(chunk, int) or chunk <= 0 or chunk % SCALE_BLOCK or I % chunk:
        raise ValueError(f"{fn}: N={N} must be a multiple of 256 and chunk={chunk} a multiple of 128 dividing N/2")
    _check(fn, "row_weights", row_weights, torch.float32, (P,), dev)
    _check(fn, "act", act, torch.float8_e4m3fn, (P, I), dev)
    _check(fn, "act_scales", act_scales, torch.float32, (P, I // SCALE_BLOCK), dev)
    _cuda.expert_gemm_swiglu(
        a.data_ptr(),
        a_scales.data_ptr(),
        b.data_ptr(),
        b_scales.data_ptr(),
        group_ends.data_ptr(),
        pre_act.data_ptr(),
        row_weights.data_ptr(),
        act.data_ptr(),
        act_scales.data_ptr(),
        G,
        P,
        N,
        K,
        chunk,
        float(clamp or 0.0),
        clamp is not None,
        variant,
        torch.cuda.current_stream(dev).cuda_stream,
        dev.index,
    )
    return pre_act, act, act_scales
