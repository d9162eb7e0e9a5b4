"""Triton kernels of the GPU backend, each with a small launcher.

Peer memory is addressed through a table of every rank's buffer base address (int64 [R],
from torch symmetric memory): a row of region `r` on rank `s` lives at
table[s] + r.offset + row * row_bytes. Rows move with plain SM loads and stores over NVLink.

Kernels never read the host: how many pool rows are live comes from device tensors, grids are
sized for the worst case and idle programs exit at once. That keeps the whole layer free of
host synchronization and capturable in a CUDA graph.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_TL_DTYPES = {
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
    torch.float32: tl.float32,
    torch.float8_e4m3fn: tl.float8e4nv,
    torch.uint8: tl.uint8,
}


# ----------------------------------------------------------------------------- publish


@triton.jit
def _store_routing_kernel(
    ids, weights, ids_out, weights_out, verdict, live, total, num_experts, STATUS_BAD: tl.constexpr, BLOCK: tl.constexpr
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # flat (token, slot) index
    m = i < live
    g = tl.load(ids + i, mask=m, other=-1)
    bad = m & ((g < -1) | (g >= num_experts))
    tl.store(ids_out + i, tl.where(bad, -1, g).to(tl.int32), mask=i < total)  # tokens past n: -1
    tl.store(weights_out + i, tl.load(weights + i, mask=m), mask=m)
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        tl.atomic_max(verdict, STATUS_BAD)


def store_routing(
    topk_idx, topk_weights, ids_out, weights_out, verdict, status_bad: int, num_experts: int, block: int = 1024
):
    """ids_out[:n] = topk_idx with ids outside [-1, num_experts) as -1, ids_out[n:] = -1,
    weights_out[:n] = topk_weights, and verdict (int32 scalar, set by the caller) raised to
    status_bad if any id was out of range; n = topk_idx.shape[0]. One launch."""
    live, total = topk_idx.numel(), ids_out.numel()
    _store_routing_kernel[(triton.cdiv(total, block),)](
        topk_idx.contiguous(),
        topk_weights.contiguous(),
        ids_out,
        weights_out,
        verdict,
        live,
        total,
        num_experts,
        STATUS_BAD=status_bad,
        BLOCK=block,
        num_warps=4,
    )


# ----------------------------------------------------------------------------- row movement


@triton.jit
def _pull_expand_kernel(
    peer_bases,
    region_offset,
    row_bytes,
    pool,
    pool_stride,
    recv_src,
    recv_token,
    recv_rows,
    num_recv_ptr,
    row_recv,
    num_rows_ptr,
    width,
    recv_per_prog,
    rows_per_prog,
    num_pull_progs,
    scales_offset,
    scales_row_bytes,
    scales_pool,
    num_scales,
    weights_offset,
    row_weights,
    quant_pool,
    quant_scales,
    TOPK: tl.constexpr,
    ELEM: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALES: tl.constexpr,
    SELEM: tl.constexpr,
    SBLOCK: tl.constexpr,
    WEIGHTS: tl.constexpr,
    QUANT: tl.constexpr,
    QUANT_MX: tl.constexpr,
    BF16_BITS: tl.constexpr,
    SOFT_CAST: tl.constexpr,
):
    """Programs [0, num_pull_progs): each received row u is read once from rank recv_src[u]
    (row recv_token[u] of the region) and stored into pool row recv_rows[u, k] of every slot k
    it has here; with SCALES its scale row the same way (fp8 inputs), with WEIGHTS slot k's topk
    weight into row_weights[recv_rows[u, k]], with QUANT the row also quantized once (e4m3 bytes
    + one fp32 scale per 1x128 block, quantize_rows' bits; with QUANT_MX mxfp8_mxfp4's MXFP8 folded
    to 1x128, _mx_quantize_fold's bits) into quant_pool / quant_scales. The other programs zero
    the padding rows (row_recv < 0) of the live pool (and their scales, weights and quantized
    rows: the quantizer's bits for a zero row). BF16_BITS: bf16 rows widened to fp32 by a shift
    for the MX quantizer (exact for subnormals too, which the interpreter's cast gets wrong)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    QB: tl.constexpr = BLOCK // 128  # 1x128 quantization blocks per BLOCK columns (QUANT)
    qcols = tl.arange(0, QB)[:, None] * 128 + tl.arange(0, 128)[None, :]
    if pid < num_pull_progs:
        num_recv = tl.load(num_recv_ptr)
        start = pid * recv_per_prog
        for u in range(start, tl.minimum(start + recv_per_prog, num_recv)):
            src = tl.load(recv_src + u)
            tok = tl.load(recv_token + u).to(tl.int64)
            base = tl.load(peer_bases + src)
            row = (base + region_offset + tok * row_bytes).to(tl.pointer_type(ELEM))
            for c in range(0, width, BLOCK):
                if QUANT:  # the row as [QB, 128] blocks: one read for the copy and its quantization
                    qm = (c + qcols) < width
                    v2 = tl.load(row + c + qcols, mask=qm, other=0.0)
                    if QUANT_MX:
                        if BF16_BITS:
                            v32 = (v2.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
                        else:
                            v32 = v2.to(tl.float32)
                        q, qs = _mx_quantize_fold(v32, SOFT_CAST)
                    else:
                        q, qs = _e4m3_blocks(v2.to(tl.float32))
                        q = q.to(tl.uint8, bitcast=True)
                    sidx = c // 128 + tl.arange(0, QB)
                    for k in tl.static_range(TOPK):
                        dest = tl.load(recv_rows + tl.cast(u, tl.int64) * TOPK + k).to(tl.int64)
                        ok = dest >= 0
                        tl.store(pool + tl.maximum(dest, 0) * pool_stride + c + qcols, v2, mask=qm & ok)
                        tl.store(quant_pool + tl.maximum(dest, 0) * width + c + qcols, q, mask=qm & ok)
                        tl.store(
                            quant_scales + tl.maximum(dest, 0) * (width // 128) + sidx,
                            qs,
                            mask=(sidx < width // 128) & ok,
                        )
                else:
                    m = (c + cols) < width
                    v = tl.load(row + c + cols, mask=m)
                    for k in tl.static_range(TOPK):
                        dest = tl.load(recv_rows + tl.cast(u, tl.int64) * TOPK + k).to(tl.int64)
                        tl.store(pool + tl.maximum(dest, 0) * pool_stride + c + cols, v, mask=m & (dest >= 0))
            if SCALES:
                scols = tl.arange(0, SBLOCK)
                sm = scols < num_scales
                srow = (base + scales_offset + tok * scales_row_bytes).to(tl.pointer_type(SELEM))
                sv = tl.load(srow + scols, mask=sm)
                for k in tl.static_range(TOPK):
                    dest = tl.load(recv_rows + tl.cast(u, tl.int64) * TOPK + k).to(tl.int64)
                    tl.store(scales_pool + tl.maximum(dest, 0) * num_scales + scols, sv, mask=sm & (dest >= 0))
            if WEIGHTS:
                wrow = (base + weights_offset + tok * (TOPK * 4)).to(tl.pointer_type(tl.float32))
                for k in tl.static_range(TOPK):
                    dest = tl.load(recv_rows + tl.cast(u, tl.int64) * TOPK + k)
                    if dest >= 0:
                        tl.store(row_weights + dest, tl.load(wrow + k))
    else:
        num_rows = tl.load(num_rows_ptr)
        start = (pid - num_pull_progs) * rows_per_prog
        zeros = tl.zeros([BLOCK], dtype=ELEM)
        for p in range(start, tl.minimum(start + rows_per_prog, num_rows)):
            if tl.load(row_recv + p) < 0:
                for c in range(0, width, BLOCK):
                    m = (c + cols) < width
                    tl.store(pool + tl.cast(p, tl.int64) * pool_stride + c + cols, zeros, mask=m)
                if SCALES:
                    scols = tl.arange(0, SBLOCK)
                    tl.store(
                        scales_pool + tl.cast(p, tl.int64) * num_scales + scols,
                        tl.zeros([SBLOCK], dtype=SELEM),
                        mask=scols < num_scales,
                    )
                if WEIGHTS:
                    tl.store(row_weights + p, 0.0)
                if QUANT:
                    if QUANT_MX:
                        zq, zs = _mx_quantize_fold(tl.zeros([QB, 128], dtype=tl.float32), SOFT_CAST)
                    else:
                        zq, zs = _e4m3_blocks(tl.zeros([QB, 128], dtype=tl.float32))
                        zq = zq.to(tl.uint8, bitcast=True)
                    for c in range(0, width, BLOCK):
                        sidx = c // 128 + tl.arange(0, QB)
                        tl.store(
                            quant_pool + tl.cast(p, tl.int64) * width + c + qcols,
                            zq,
                            mask=(c + qcols) < width,
                        )
                        tl.store(
                            quant_scales + tl.cast(p, tl.int64) * (width // 128) + sidx, zs, mask=sidx < width // 128
                        )


def _movable(t: torch.Tensor) -> torch.Tensor:
    """fp8 rows move as bytes (Triton cannot fill masked fp8 lanes with a literal)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def pull_expand(
    peer_bases,
    region,
    pool,
    plan,
    scales_region=None,
    scales_pool=None,
    weights_region=None,
    row_weights=None,
    quant_pool=None,
    quant_scales=None,
    quant_mx: bool = False,
    recv_per_prog: int = 4,
    rows_per_prog: int = 16,
):
    """Pull every received (source, token) row of a symmetric region once and write it into all
    of its pool rows; zero the live pool's padding rows. pool: local [P, width]. Optionally in
    the same pass: the rows' scales (scales_region -> scales_pool [P, width/128], fp8 inputs),
    each pool row's topk weight (weights_region, the sources' [T, K] -> row_weights [P]), and
    (16-bit rows) the rows quantized as quantize_rows does, e4m3 quant_pool [P, width] + fp32
    quant_scales [P, width/128] (the fp8 dgrad's dY), once per received row; with quant_mx as
    mxfp8_mxfp4 quantizes them and folded for the fp8 GEMMs instead (the MX dgrad's dY:
    quant.fold_mx_act(*quant.quantize_grad(rows)), the same layout)."""
    pool = _movable(pool)
    width = pool.shape[1]
    block = min(triton.next_power_of_2(width), 2048)
    quant = quant_pool is not None
    if quant:
        assert width % 128 == 0 and block >= 128 and pool.element_size() == 2, (
            "quantized pull: 16-bit rows, width % 128 == 0"
        )
        assert quant_pool.shape == pool.shape and quant_pool.is_contiguous() and quant_scales.is_contiguous()
        assert quant_scales.shape == (pool.shape[0], width // 128)
    U, topk = plan.recv_rows.shape
    pull_progs = triton.cdiv(U, recv_per_prog)
    grid = (pull_progs + triton.cdiv(pool.shape[0], rows_per_prog),)
    scales, weights = scales_region is not None, weights_region is not None
    num_scales = scales_pool.shape[1] if scales else 1
    _pull_expand_kernel[grid](
        peer_bases,
        region.offset,
        region.row_bytes,
        pool,
        pool.stride(0),
        plan.recv_src,
        plan.recv_token,
        plan.recv_rows,
        plan.num_recv,
        plan.row_recv,
        plan.num_rows,
        width,
        recv_per_prog,
        rows_per_prog,
        pull_progs,
        scales_region.offset if scales else 0,
        scales_region.row_bytes if scales else 0,
        scales_pool if scales else pool,
        num_scales,
        weights_region.offset if weights else 0,
        row_weights if weights else pool,
        quant_pool.view(torch.uint8) if quant else pool,
        quant_scales if quant else pool,
        TOPK=topk,
        ELEM=_TL_DTYPES[pool.dtype],
        BLOCK=block,
        SCALES=scales,
        SELEM=_TL_DTYPES[scales_pool.dtype] if scales else tl.float32,
        SBLOCK=triton.next_power_of_2(num_scales),
        WEIGHTS=weights,
        QUANT=quant,
        QUANT_MX=quant and quant_mx,
        BF16_BITS=pool.dtype == torch.bfloat16,
        SOFT_CAST=pool.device.type == "cpu",
        num_warps=4,
    )


@triton.jit
def _push_partials_kernel(
    peer_bases,
    region_offset,
    row_bytes,
    max_tokens,
    me,
    rows,
    rows_stride,
    recv_src,
    recv_token,
    recv_rows,
    num_recv_ptr,
    width,
    recv_per_prog,
    scalar_region_offset,
    scalars,
    TOPK: tl.constexpr,
    OUT: tl.constexpr,
    BLOCK: tl.constexpr,
    WITH_SCALAR: tl.constexpr,
):
    """For each received row u: sum over k = 0..K-1 of rows[recv_rows[u, k]] (present slots) in
    fp32, in that order, stored as partials[me, recv_token[u]] on rank recv_src[u]; with
    WITH_SCALAR also scalars[recv_rows[u, k]] into that rank's [T, K] region at (token, k)."""
    num_recv = tl.load(num_recv_ptr)
    start = tl.program_id(0) * recv_per_prog
    if start >= num_recv:
        return
    cols = tl.arange(0, BLOCK)
    for u in range(start, tl.minimum(start + recv_per_prog, num_recv)):
        src = tl.load(recv_src + u)
        tok = tl.load(recv_token + u).to(tl.int64)
        base = tl.load(peer_bases + src)
        dst = (base + region_offset + (me * max_tokens + tok) * row_bytes).to(tl.pointer_type(OUT))
        for c in range(0, width, BLOCK):
            m = (c + cols) < width
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for k in tl.static_range(TOPK):
                d = tl.load(recv_rows + tl.cast(u, tl.int64) * TOPK + k).to(tl.int64)
                v = tl.load(rows + tl.maximum(d, 0) * rows_stride + c + cols, mask=m & (d >= 0), other=0.0)
                acc += v.to(tl.float32)
            tl.store(dst + c + cols, acc.to(OUT), mask=m)
        if WITH_SCALAR:
            for k in tl.static_range(TOPK):
                d = tl.load(recv_rows + tl.cast(u, tl.int64) * TOPK + k)
                if d >= 0:
                    sp = (base + scalar_region_offset + (tok * TOPK + k) * 4).to(tl.pointer_type(tl.float32))
                    tl.store(sp, tl.load(scalars + d))


def push_partials(peer_bases, region, rows, plan, me: int, scalar_region=None, scalars=None, recv_per_prog: int = 4):
    """One partial row per received (source, token) into the [S, T, width] symmetric region of
    its home rank at [me, token] (the owner's sum of its slots); optionally d(topk weight)."""
    width = rows.shape[1]
    block = min(triton.next_power_of_2(width), 2048)
    U, topk = plan.recv_rows.shape
    with_scalar = scalar_region is not None
    _push_partials_kernel[(triton.cdiv(U, recv_per_prog),)](
        peer_bases,
        region.offset,
        region.row_bytes,
        region.shape[1],
        me,
        rows,
        rows.stride(0),
        plan.recv_src,
        plan.recv_token,
        plan.recv_rows,
        plan.num_recv,
        width,
        recv_per_prog,
        scalar_region.offset if with_scalar else 0,
        scalars if with_scalar else rows,
        TOPK=topk,
        OUT=_TL_DTYPES[region.dtype],
        BLOCK=block,
        WITH_SCALAR=with_scalar,
        num_warps=4,
    )


# ----------------------------------------------------------------------------- e4m3 as bits


# Triton's interpreter (the CPU tests) converts float32 to e4m3 rounding ties up and e4m3 to float32
# with no NaN, so with SOFT_CAST (CPU tensors) these convert with integer ops that round to nearest
# even; on the GPU the hardware conversions do it. Shared with triton_weight_prep.
_E4M3_MIN_NORMAL_BITS = tl.constexpr(121 << 23)  # float32 bits of 2**-6, e4m3's smallest normal number


@triton.jit
def _e4m3_bits(v, SOFT_CAST: tl.constexpr):
    """float32 in [-448, 448] (or NaN) -> e4m3 (fn) bits as uint8, round to nearest even."""
    if SOFT_CAST:
        bits = v.to(tl.int32, bitcast=True)
        sign = ((bits >> 31) & 1) << 7
        mag = tl.minimum(bits & 0x7FFFFFFF, 0x7F800000)
        # Normal range: keep 3 mantissa bits rounding to nearest even (a carry moves into the
        # exponent), then rebias the exponent from 127 to 7.
        normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
        # Below 2**-6: multiples of 2**-9, codes 0..8 (8 is the smallest normal); the float add
        # of 2**23 rounds |v| * 512 to an integer, to nearest even.
        sub = ((tl.abs(v) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
        code = tl.where(mag < _E4M3_MIN_NORMAL_BITS, sub, normal)
        code = tl.where(v != v, 0x7F, code)
        return (code | sign).to(tl.uint8)
    else:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _e4m3_value(b, SOFT_CAST: tl.constexpr):
    """e4m3 (fn) bits (uint8) -> exact float32."""
    if SOFT_CAST:
        b = b.to(tl.int32)
        exponent = (b >> 3) & 15
        mantissa = b & 7
        normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
        magnitude = tl.where((b & 0x7F) == 0x7F, float("nan"), magnitude)
        # The sign as a bit: negation can be 0 - x, which loses -0.0 (triton 3.6's interpreter).
        return (magnitude.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)
    else:
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)


# ----------------------------------------------------------------------------- fp8 rows


# The quantizers divide every element by its block's scale, correctly rounded as torch's x / scale
# is. Triton's div_rn is CUDA's div.rn: a slow-path check and branch per element that, in the
# weight-prep kernel, made the pass 2.2x slower than a multiply (measured on an H200). On the GPU
# divide_rn takes the same route as div.rn's fast path without the check: the quotient by the
# correctly rounded reciprocal, then two FMA corrections (x - q * s is exact, and each step
# moves q to the rounding of q + r * (x - q * s)); the check guards exponent ranges these operands
# never reach (scales are at least 1e-4 / 448). Under the interpreter (the CPU tests) fma is a
# multiply and an add rounded twice, so there div_rn it is: the GPU tests compare the two (and
# every bf16 value over every scale a bf16 block can have) bit for bit.
_FMA_DIVISION = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def divide_rn(x, scale, recip):
    """x / scale rounded to nearest even, given recip = div_rn(1, scale) (one per block, so its
    correctly rounded division is paid per block, not per element). For the quantizers' operands:
    |x| at most the block's amax, so |x / scale| <= 448 (a quotient near fp32's overflow would
    overflow the corrections)."""
    if _FMA_DIVISION:
        q0 = x * recip
        q = tl.fma(tl.fma(-q0, scale, x), recip, q0)
        q = tl.fma(tl.fma(-q, scale, x), recip, q)
        # x = +-0 (and any x over an infinite scale, recip 0): the product has the quotient's sign,
        # which the corrections (+0 remainders) would drop
        return tl.where(q0 == 0, q0, q)
    else:
        return tl.math.div_rn(x, scale)


@triton.jit
def _e4m3_blocks(v):
    """quant.py's fp8 rounding of fp32 rows v [R, 128], one 1x128 block per row -> (e4m3 [R, 128],
    fp32 scale [R]): scale = max(amax, 1e-4) / 448, then v / scale clamped to +-448 and cast
    (round to nearest even). Both divisions are correctly rounded like torch's (div_rn, divide_rn):
    Triton's plain fp32 `/` is an approximate division and would change bits.
    NaN propagates as in torch: Triton's float max / maximum / minimum skip a NaN operand (PTX
    max.f32), which made a block's NaN element -448 times the other elements' scale, a finite
    value. So amax is the integer max of |v|'s bits (NaN's exceed inf's, as in the weight
    preparation) and the clamps propagate NaN: a NaN anywhere gives the block a NaN scale."""
    amax = tl.max(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1).to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-4, propagate_nan=tl.PropagateNan.ALL), tl.zeros_like(amax) + 448.0)
    recip = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
    q = divide_rn(v, tl.broadcast_to(scale[:, None], v.shape), tl.broadcast_to(recip[:, None], v.shape))
    q = tl.minimum(tl.maximum(q, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0, propagate_nan=tl.PropagateNan.ALL)
    return q.to(tl.float8e4nv), scale


@triton.jit
def _quantize_rows_kernel(
    data,
    data_stride,
    out,
    out_stride,
    scales,
    scales_stride,
    num_rows_ptr,
    BLOCK_R: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out, scales = e4m3 + one fp32 scale per 1xBLOCK (=128) block of the live rows of data."""
    num_rows = tl.load(num_rows_ptr)
    r0 = tl.program_id(0) * BLOCK_R
    if r0 >= num_rows:
        return
    rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = rows < num_rows
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(data + rows[:, None] * data_stride + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    q, scale = _e4m3_blocks(v)
    tl.store(out + rows[:, None] * out_stride + cols[None, :], q, mask=rmask[:, None])
    tl.store(scales + rows * scales_stride + tl.program_id(1), scale, mask=rmask)


def quantize_rows(data, out, scales, num_rows):
    """The live rows (num_rows: int32 device scalar) of data [P, W] as the fp8 recipe stores an
    activation or a dgrad gradient (quant.quantize_act / quantize_grad, bit for bit): e4m3 out
    [P, W], fp32 scales [P, W/128]. Rows past num_rows are not written."""
    rows, width = data.shape
    assert width % 128 == 0 and out.shape == data.shape and scales.shape == (rows, width // 128)
    assert data.stride(1) == 1 and out.stride(1) == 1 and scales.stride(1) == 1
    grid = (triton.cdiv(rows, 32), width // 128)
    _quantize_rows_kernel[grid](
        data,
        data.stride(0),
        out,
        out.stride(0),
        scales,
        scales.stride(0),
        num_rows,
        BLOCK_R=32,
        BLOCK=128,
        num_warps=4,
    )


@triton.jit
def _quantize_tokens_t_kernel(
    src,
    src_stride,
    src_scales,
    src_scales_stride,
    row_slot,
    num_rows_ptr,
    out,
    out_stride,
    out_scales,
    out_scales_stride,
    SCALED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One (BLOCK_T = 128-row block, BLOCK_C-column tile): src rows (dequantized with their 1x128
    scales along C if SCALED; padding rows, row_slot < 0, read as zero) -> e4m3 out[c, rows] and
    one fp32 scale per column of the block. Loads run along C and stores along P, both
    contiguous; tl.trans turns the tile between them so _e4m3_blocks sees one block per row."""
    num_rows = tl.load(num_rows_ptr)
    t0 = tl.program_id(0) * BLOCK_T
    if t0 >= num_rows:
        return
    rows = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    real = (tl.load(row_slot + rows) >= 0)[:, None]
    v = tl.load(src + rows[:, None] * src_stride + cols[None, :], mask=real, other=0.0).to(tl.float32)
    if SCALED:
        s = tl.load(src_scales + rows[:, None] * src_scales_stride + (cols // 128)[None, :], mask=real, other=0.0)
        v = v * s
    q, scale = _e4m3_blocks(tl.trans(v))  # [BLOCK_C, BLOCK_T]: one block per column
    tl.store(out + cols[:, None].to(tl.int64) * out_stride + rows[None, :], q)
    tl.store(out_scales + cols.to(tl.int64) * out_scales_stride + tl.program_id(0), scale)


def quantize_tokens_t(src, src_scales, row_slot, num_rows, out, out_scales, block_c: int = 64, num_warps: int = 4):
    """A pool matrix src [P, C] as the fp8 wgrad reads it (quant.quantize_tokens_t, bit for bit):
    e4m3 out [C, P] and fp32 out_scales [C, P/128], per column in 128-row blocks. src is bf16
    (dY, dH) or e4m3 with src_scales [P, C/128] (x, a: dequantized in fp32 first). Rows with
    row_slot < 0 (padding) read as zero; 128-row blocks at or past num_rows (int32 device [1])
    are not written (the GEMM never reads them). block_c: the column tile (a power of two
    dividing C)."""
    rows, width = src.shape
    assert rows % 128 == 0 and width % block_c == 0, (rows, width, block_c)
    assert out.shape == (width, rows) and out_scales.shape == (width, rows // 128) and row_slot.shape == (rows,)
    assert src.stride(1) == 1 and out.stride(1) == 1 and out_scales.stride(1) == 1
    scaled = src_scales is not None
    if scaled:
        assert src_scales.shape == (rows, width // 128) and src_scales.stride(1) == 1
    grid = (rows // 128, width // block_c)
    _quantize_tokens_t_kernel[grid](
        src,
        src.stride(0),
        src_scales if scaled else src,
        src_scales.stride(0) if scaled else 0,
        row_slot,
        num_rows,
        out,
        out.stride(0),
        out_scales,
        out_scales.stride(0),
        SCALED=scaled,
        BLOCK_T=128,
        BLOCK_C=block_c,
        num_warps=num_warps,
    )


# ----------------------------------------------------------------------------- MX rows (mxfp8_mxfp4)


# The mxfp8_mxfp4 recipe's activations (quant.quantize_act: e4m3, one ue8m0 power-of-two scale per
# 1x32 block) and their fold into the operand of Hopper's fp8 MMA (quant.fold_mx_act: each 1x128
# block re-expressed against its largest 1x32 scale). Integer ops and multiplies by exact powers of
# two only: no division, no libdevice (which flushes subnormals), so with SOFT_CAST on CPU tensors
# the bits are quant.py's in the interpreter as on the GPU.
_MX_FOLD_MIN_SHIFT = tl.constexpr(-30)  # quant._fold's clamp: below it every element rounds to 0


@triton.jit
def _mx_scale_codes(amax_bits):
    """1x32 block maxima as float32 bits (non-negative, so ordered like the values; NaN's above
    inf's) -> (ue8m0 code, int32; 1 / scale, float32). quant._block_scales for e4m3 in integers:
    with amax = 1.f * 2**(b - 127) and 448 = 1.75 * 2**8, ceil(log2(amax / 448)) is b - 135, plus
    one when 1.f > 1.75 (mantissa field above 0x600000); the code is that plus 127, at least 0 (at
    most 247 for a finite amax). quant.py's floor on amax (2**-126) needs no counterpart: every
    amax up to 448 * 2**-127, subnormal or zero too, gets code 0 either way. NaN or inf: 255 and a NaN
    reciprocal, so the block's elements come out NaN."""
    code = tl.maximum((amax_bits >> 23) - 8 + ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32), 0)
    finite = amax_bits < 0x7F800000
    # 2**(127 - code), biased exponent 254 - code: at least 7, a normal number.
    recip = tl.where(finite, (254 - code) << 23, 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where(finite, code, 255), recip


@triton.jit
def _mx_quantize(v, SOFT_CAST: tl.constexpr):
    """fp32 rows v [R, C] (C a multiple of 32) -> (e4m3 bits, uint8 [R, C/32, 32]; ue8m0 codes,
    int32 [R, C/32]), quant.quantize_act for mxfp8_mxfp4. v times the reciprocal power of two is
    torch's correctly rounded v / scale (the same real number, rounded once) and never above 448
    (the scale rounds up), so there is nothing to clamp. amax is the integer max of |v|'s bits: a
    NaN or inf wins, as in _e4m3_blocks (float max skips NaN)."""
    R: tl.constexpr = v.shape[0]
    C: tl.constexpr = v.shape[1]
    v3 = tl.reshape(v, [R, C // 32, 32])
    amax = tl.max(v3.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)
    code, recip = _mx_scale_codes(amax)
    return _e4m3_bits(v3 * recip[:, :, None], SOFT_CAST), code


@triton.jit
def _mx_fold(x, codes, block_code, SOFT_CAST: tl.constexpr):
    """quant._fold: x [A, B, 32], the exact float32 values of 1x32 blocks (e4m3 or e2m1, or NaN)
    with their own scales divided out, codes int32 [A, B] their ue8m0 codes and block_code (int32,
    broadcast to [A, B]) their fold block's largest -> e4m3 bits uint8 [A, B, 32] of
    x * 2**(code - block_code). The shift is clamped at -30 so the factor is a normal float32 built
    from its bits, and the product is exact (x is 0 or at least 2**-9): one rounding, to e4m3. A
    NaN block (block_code 255): all 0x7F, the positive NaN quant.py fills in."""
    shift = tl.maximum(codes - block_code, _MX_FOLD_MIN_SHIFT)
    factor = ((shift + 127) << 23).to(tl.float32, bitcast=True)
    bits = _e4m3_bits(x * factor[:, :, None], SOFT_CAST)
    nan = tl.broadcast_to(block_code == 255, codes.shape)
    return tl.where(nan[:, :, None], 0x7F, bits).to(tl.uint8)


@triton.jit
def _mx_fold_scale(block_code):
    """quant._fold_scales: a fold block's largest ue8m0 code -> its fp32 scale from the bits
    (ue8m0_to_float: 0 is the subnormal 2**-127, 255 the NaN 0x7FC00000)."""
    bits = tl.where(block_code == 0, 1 << 22, block_code << 23)
    return tl.where(block_code == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _mx_fold_rows(x, codes, SOFT_CAST: tl.constexpr):
    """One 1x128 fold block per row: x [R, 4, 32] (exact values), codes int32 [R, 4] -> (e4m3 bits
    uint8 [R, 4, 32], fp32 scale [R]), quant.fold_mx_act."""
    block_code = tl.max(codes, axis=1)
    return _mx_fold(x, codes, block_code[:, None], SOFT_CAST), _mx_fold_scale(block_code)


@triton.jit
def _mx_quantize_fold(v, SOFT_CAST: tl.constexpr):
    """fp32 rows v [R, 128] -> (e4m3 bits uint8 [R, 128], fp32 scale [R]):
    quant.fold_mx_act(*quant.quantize_act(v, mxfp8_mxfp4)), the 1x32 e4m3 rounding and then the
    fold's (two roundings, as quant.py does them)."""
    R: tl.constexpr = v.shape[0]
    q, codes = _mx_quantize(v, SOFT_CAST)
    folded, scale = _mx_fold_rows(_e4m3_value(q, SOFT_CAST), codes, SOFT_CAST)
    return tl.reshape(folded, [R, 128]), scale


@triton.jit
def _quantize_rows_mx_kernel(
    data,
    data_stride,
    out,
    out_stride,
    scales,
    scales_stride,
    num_rows_ptr,
    BF16_BITS: tl.constexpr,
    SOFT_CAST: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Reads BLOCK_R live rows x BLOCK columns of data, writes their e4m3 bytes to out and their
    BLOCK / 32 ue8m0 codes to scales. BF16_BITS: data holds bf16 as int16 bits, widened by a shift
    (exact for subnormals too, which the interpreter's bf16 cast gets wrong; an all-subnormal block
    keeps its elements here: its scale is 2**-127)."""
    num_rows = tl.load(num_rows_ptr)
    r0 = tl.program_id(0) * BLOCK_R
    if r0 >= num_rows:
        return
    rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = rows < num_rows
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(data + rows[:, None] * data_stride + cols[None, :], mask=rmask[:, None], other=0)
    if BF16_BITS:
        v = (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    q, codes = _mx_quantize(v.to(tl.float32), SOFT_CAST)
    tl.store(out + rows[:, None] * out_stride + cols[None, :], tl.reshape(q, [BLOCK_R, BLOCK]), mask=rmask[:, None])
    scols = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    tl.store(scales + rows[:, None] * scales_stride + scols[None, :], codes.to(tl.uint8), mask=rmask[:, None])


def quantize_rows_mx(data, out, scales, num_rows, block_r: int = 32, num_warps: int = 4):
    """The live rows (num_rows: int32 device tensor [1]) of data [P, W] (bf16 or fp32, W % 128 == 0)
    as the mxfp8_mxfp4 recipe stores an activation, quant.quantize_act bit for bit: e4m3 out [P, W]
    and ue8m0 scales uint8 [P, W/32]. Rows past num_rows are not written. block_r: rows per program
    (a power of two)."""
    rows, width = data.shape
    assert data.dtype in (torch.bfloat16, torch.float32), data.dtype
    assert width % 128 == 0 and out.shape == data.shape and scales.shape == (rows, width // 32)
    assert out.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8
    assert data.stride(1) == 1 and out.stride(1) == 1 and scales.stride(1) == 1
    bf16 = data.dtype == torch.bfloat16
    _quantize_rows_mx_kernel[(triton.cdiv(rows, block_r), width // 128)](
        data.view(torch.int16) if bf16 else data,
        data.stride(0),
        out.view(torch.uint8),
        out.stride(0),
        scales,
        scales.stride(0),
        num_rows,
        BF16_BITS=bf16,
        SOFT_CAST=data.device.type == "cpu",
        BLOCK_R=block_r,
        BLOCK=128,
        num_warps=num_warps,
    )


@triton.jit
def _fold_mx_rows_kernel(
    data,
    data_stride,
    scales,
    scales_stride,
    out_scales,
    out_scales_stride,
    num_rows_ptr,
    SOFT_CAST: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Reads one 1x128 fold block of BLOCK_R live rows (e4m3 bytes and their four ue8m0 codes),
    writes the folded bytes over them and the block's fp32 scale to out_scales."""
    num_rows = tl.load(num_rows_ptr)
    r0 = tl.program_id(0) * BLOCK_R
    if r0 >= num_rows:
        return
    rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = rows < num_rows
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    ptrs = data + rows[:, None] * data_stride + cols[None, :]
    b = tl.load(ptrs, mask=rmask[:, None], other=0)
    scols = tl.program_id(1) * 4 + tl.arange(0, 4)
    codes = tl.load(scales + rows[:, None] * scales_stride + scols[None, :], mask=rmask[:, None], other=0)
    x = tl.reshape(_e4m3_value(b, SOFT_CAST), [BLOCK_R, 4, 32])
    folded, scale = _mx_fold_rows(x, codes.to(tl.int32), SOFT_CAST)
    tl.store(ptrs, tl.reshape(folded, [BLOCK_R, 128]), mask=rmask[:, None])
    tl.store(out_scales + rows * out_scales_stride + tl.program_id(1), scale, mask=rmask)


def fold_mx_rows(data, scales, out_scales, num_rows, block_r: int = 32, num_warps: int = 4):
    """Fold the live rows (num_rows: int32 device tensor [1]) of MXFP8 rows in place for the fp8
    GEMMs, quant.fold_mx_act bit for bit: data e4m3 [P, W] (W % 128 == 0) is overwritten with the
    folded elements, scales uint8 [P, W/32] (its 1x32 ue8m0 codes) is read, out_scales fp32
    [P, W/128] gets one power-of-two scale per 1x128 block. Rows past num_rows are not touched.
    block_r: rows per program (a power of two)."""
    rows, width = data.shape
    assert width % 128 == 0 and scales.shape == (rows, width // 32) and out_scales.shape == (rows, width // 128)
    assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8 and out_scales.dtype == torch.float32
    assert data.stride(1) == 1 and scales.stride(1) == 1 and out_scales.stride(1) == 1
    _fold_mx_rows_kernel[(triton.cdiv(rows, block_r), width // 128)](
        data.view(torch.uint8),
        data.stride(0),
        scales,
        scales.stride(0),
        out_scales,
        out_scales.stride(0),
        num_rows,
        SOFT_CAST=data.device.type == "cpu",
        BLOCK_R=block_r,
        num_warps=num_warps,
    )


# ----------------------------------------------------------------------------- SwiGLU


@triton.jit
def _clamp_max(x, c):
    """torch.clamp(x, max=c): a NaN stays NaN (Triton's minimum would return c)."""
    return tl.minimum(x, c, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _clamp_min(x, c):
    return tl.maximum(x, c, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _gate_up_cols(j, CHUNK: tl.constexpr):
    """Columns of the interleaved fc1 output holding gate and up of activation column j."""
    gate = (j // CHUNK) * (2 * CHUNK) + j % CHUNK
    return gate, gate + CHUNK


@triton.jit
def _swiglu_forward_kernel(
    h,
    h_stride,
    row_weight,
    act,
    act_stride,
    act_scales,
    scales_stride,
    num_rows_ptr,
    inter,
    clamp,
    CHUNK: tl.constexpr,
    HAS_CLAMP: tl.constexpr,
    QUANT: tl.constexpr,
    MX: tl.constexpr,
    SOFT_CAST: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """act = silu(min(g, c)) * clamp(u, -c, c) * w_row; with QUANT, e4m3 + one fp32 scale per
    BLOCK_C (=128) columns of a row, as quant.quantize_act; with MX as well, the fp8 recipe's
    rounding replaced by mxfp8_mxfp4's then folded (_mx_quantize_fold; act as uint8 bytes)."""
    num_rows = tl.load(num_rows_ptr)
    r0 = tl.program_id(0) * BLOCK_R
    if r0 >= num_rows:
        return
    rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = rows < num_rows
    j = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    gc, uc = _gate_up_cols(j, CHUNK)
    g = tl.load(h + rows[:, None] * h_stride + gc[None, :], mask=rmask[:, None], other=0).to(tl.float32)
    u = tl.load(h + rows[:, None] * h_stride + uc[None, :], mask=rmask[:, None], other=0).to(tl.float32)
    if HAS_CLAMP:
        g = _clamp_max(g, clamp)
        u = _clamp_max(_clamp_min(u, -clamp), clamp)
    w = tl.load(row_weight + rows, mask=rmask, other=0)
    a = g / (1.0 + tl.exp(-g)) * u * w[:, None]
    if QUANT:
        if MX:
            q, scale = _mx_quantize_fold(a, SOFT_CAST)
        else:
            q, scale = _e4m3_blocks(a)
        tl.store(act + rows[:, None] * act_stride + j[None, :], q, mask=rmask[:, None])
        tl.store(act_scales + rows * scales_stride + tl.program_id(1), scale, mask=rmask)
    else:
        tl.store(act + rows[:, None] * act_stride + j[None, :], a.to(act.dtype.element_ty), mask=rmask[:, None])


def swiglu_forward(
    h,
    row_weight,
    act,
    act_scales,
    num_rows,
    chunk: int,
    clamp: float | None,
    block_r: int = 32,
    num_warps: int = 4,
    mx: bool = False,
):
    """Fused clamp + SwiGLU + topk weight (+ e4m3 requantization) over the live pool rows.
    block_r / num_warps: rows per program and its warps (8-32 rows, 4-8 warps measure within noise
    of each other at S1: benchmarks/bench_row_kernels.py). mx (with act_scales fp32 [P, I/128]):
    act, act_scales = quant.fold_mx_act(*quant.quantize_act(a, mxfp8_mxfp4)) of the fp32 SwiGLU
    value a, the MX activation as the fp8 GEMMs read it."""
    rows, inter = act.shape
    block_c = 128
    assert inter % block_c == 0, "intermediate size must be a multiple of 128"
    if mx:
        assert act_scales is not None and act.dtype == torch.float8_e4m3fn, "mx: e4m3 act and fp32 act_scales"
        assert act_scales.dtype == torch.float32 and act_scales.shape == (rows, inter // block_c)
    grid = (triton.cdiv(rows, block_r), inter // block_c)
    _swiglu_forward_kernel[grid](
        h,
        h.stride(0),
        row_weight,
        act.view(torch.uint8) if mx else act,
        act.stride(0),
        act_scales if act_scales is not None else row_weight,
        act_scales.stride(0) if act_scales is not None else 0,
        num_rows,
        inter,
        float(clamp or 0.0),
        CHUNK=chunk,
        HAS_CLAMP=clamp is not None,
        QUANT=act_scales is not None,
        MX=mx,
        SOFT_CAST=mx and h.device.type == "cpu",
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=num_warps,
    )


@triton.jit
def _swiglu_backward_kernel(
    h,
    h_stride,
    row_weight,
    grad_act,
    ga_stride,
    grad_h,
    gh_stride,
    grad_weight,
    num_rows_ptr,
    grad_h_q,
    ghq_stride,
    grad_h_scales,
    ghs_stride,
    inter,
    clamp,
    CHUNK: tl.constexpr,
    HAS_CLAMP: tl.constexpr,
    QUANT: tl.constexpr,
    MX: tl.constexpr,
    SOFT_CAST: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """From dL/d(act) with act = s * w, s = silu(g') * u': dL/dh and dL/dw per row. h is read
    interleaved (forward's layout); dL/dh is written in master order [gate | up], so the weight
    gradient of fc1 comes out in Megatron's layout with no reordering pass. With QUANT, dL/dh
    also as the fp8 dgrad reads it: e4m3 + one fp32 scale per 1x128 block, quantized from the
    fp32 values (each BLOCK_C = 128 columns of gate or up are one block); with MX as well,
    mxfp8_mxfp4's 1x32 rounding then folded to 1x128 (_mx_quantize_fold; grad_h_q as uint8).
    One program owns whole rows, so the dL/dw sum has a fixed order (bitwise repeatable)."""
    num_rows = tl.load(num_rows_ptr)
    r0 = tl.program_id(0) * BLOCK_R
    if r0 >= num_rows:
        return
    rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = rows < num_rows
    w = tl.load(row_weight + rows, mask=rmask, other=0)
    dw = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c in range(0, inter, BLOCK_C):
        j = c + tl.arange(0, BLOCK_C)
        gc, uc = _gate_up_cols(j, CHUNK)
        g = tl.load(h + rows[:, None] * h_stride + gc[None, :], mask=rmask[:, None], other=0).to(tl.float32)
        u = tl.load(h + rows[:, None] * h_stride + uc[None, :], mask=rmask[:, None], other=0).to(tl.float32)
        da = tl.load(grad_act + rows[:, None] * ga_stride + j[None, :], mask=rmask[:, None], other=0).to(tl.float32)
        if HAS_CLAMP:
            g_pass = g <= clamp
            u_pass = (u >= -clamp) & (u <= clamp)
            g = _clamp_max(g, clamp)
            u = _clamp_max(_clamp_min(u, -clamp), clamp)
        sig = 1.0 / (1.0 + tl.exp(-g))
        silu = g * sig
        dw += tl.sum(da * silu * u, axis=1)
        ds = da * w[:, None]
        dg = ds * u * sig * (1.0 + g * (1.0 - sig))
        du = ds * silu
        if HAS_CLAMP:  # multiplied by the masks, as expert_math does (a NaN stays NaN)
            dg = dg * g_pass.to(tl.float32)
            du = du * u_pass.to(tl.float32)
        out_ty = grad_h.dtype.element_ty
        tl.store(grad_h + rows[:, None] * gh_stride + j[None, :], dg.to(out_ty), mask=rmask[:, None])
        tl.store(grad_h + rows[:, None] * gh_stride + inter + j[None, :], du.to(out_ty), mask=rmask[:, None])
        if QUANT:
            if MX:
                qg, sg = _mx_quantize_fold(dg, SOFT_CAST)
                qu, su = _mx_quantize_fold(du, SOFT_CAST)
            else:
                qg, sg = _e4m3_blocks(dg)
                qu, su = _e4m3_blocks(du)
            tl.store(grad_h_q + rows[:, None] * ghq_stride + j[None, :], qg, mask=rmask[:, None])
            tl.store(grad_h_q + rows[:, None] * ghq_stride + inter + j[None, :], qu, mask=rmask[:, None])
            tl.store(grad_h_scales + rows * ghs_stride + c // BLOCK_C, sg, mask=rmask)
            tl.store(grad_h_scales + rows * ghs_stride + (inter + c) // BLOCK_C, su, mask=rmask)
    tl.store(grad_weight + rows, dw, mask=rmask)


def swiglu_backward(
    h,
    row_weight,
    grad_act,
    grad_h,
    grad_weight,
    num_rows,
    chunk: int,
    clamp: float | None,
    grad_h_q=None,
    grad_h_scales=None,
    block_r: int = 8,
    num_warps: int = 4,
    mx: bool = False,
):
    """SwiGLU + topk weight backward over the live rows: grad_h [P, 2I] master order (compute dtype),
    d(topk weight) per row fp32; with grad_h_q / grad_h_scales also the e4m3 dH [P, 2I] and its
    fp32 1x128 scales [P, 2I/128] for the fp8 L1 dgrad (mx: quant.fold_mx_act(*quant.quantize_grad(
    dH, mxfp8_mxfp4)) of the fp32 dH, the MX L1 dgrad's operand). block_r / num_warps: rows per
    program and its warps (8 / 4 measured best at S1, 9-17% under 16 / 4:
    benchmarks/bench_row_kernels.py)."""
    rows, inter = grad_act.shape
    assert inter % 128 == 0, "intermediate size must be a multiple of 128"
    quant = grad_h_q is not None
    assert quant or not mx, "mx: needs grad_h_q and grad_h_scales"
    if quant:
        assert grad_h_q.shape == grad_h.shape and grad_h_scales.shape == (rows, 2 * inter // 128)
        assert grad_h_q.stride(1) == 1 and grad_h_scales.stride(1) == 1
        assert grad_h_q.dtype == torch.float8_e4m3fn and grad_h_scales.dtype == torch.float32
    grid = (triton.cdiv(rows, block_r),)
    _swiglu_backward_kernel[grid](
        h,
        h.stride(0),
        row_weight,
        grad_act,
        grad_act.stride(0),
        grad_h,
        grad_h.stride(0),
        grad_weight,
        num_rows,
        (grad_h_q.view(torch.uint8) if mx else grad_h_q) if quant else grad_h,
        grad_h_q.stride(0) if quant else 0,
        grad_h_scales if quant else grad_weight,
        grad_h_scales.stride(0) if quant else 0,
        inter,
        float(clamp or 0.0),
        CHUNK=chunk,
        HAS_CLAMP=clamp is not None,
        QUANT=quant,
        MX=mx,
        SOFT_CAST=mx and h.device.type == "cpu",
        BLOCK_R=block_r,
        BLOCK_C=128,
        num_warps=num_warps,
    )


@triton.jit
def _dequantize_rows_kernel(data, scales, out, num_rows_ptr, width, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    """out = e4m3 data * its 1x128 fp32 block scale, for the live rows."""
    num_rows = tl.load(num_rows_ptr)
    r0 = tl.program_id(0) * BLOCK_R
    if r0 >= num_rows:
        return
    rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = rows < num_rows
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(data + rows[:, None] * width + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    sc = tl.load(scales + rows * (width // BLOCK) + tl.program_id(1), mask=rmask, other=0.0)
    tl.store(
        out + rows[:, None] * width + cols[None, :], (v * sc[:, None]).to(out.dtype.element_ty), mask=rmask[:, None]
    )


def dequantize_rows(data, scales, out, num_rows):
    rows, width = data.shape
    assert width % 128 == 0 and data.is_contiguous() and out.is_contiguous()
    grid = (triton.cdiv(rows, 32), width // 128)
    _dequantize_rows_kernel[grid](data, scales, out, num_rows, width, BLOCK_R=32, BLOCK=128, num_warps=4)


# ----------------------------------------------------------------------------- combine


@triton.jit
def _routing_masks_kernel(
    ids,
    ok,
    own,
    partial,
    T,
    experts_per_rank,
    num_ranks,
    K: tl.constexpr,
    KP: tl.constexpr,
    RP: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """own[t, k] = ids[t, k] >= 0 and the call's ok flag; partial[t, r] = some slot of t carried
    a row to an expert of rank r (the owners that pushed a partial row). ids are as published
    (out-of-range ones already -1)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ks = tl.arange(0, KP)
    live = rows < T
    m = live[:, None] & (ks[None, :] < K)
    g = tl.load(ids + rows[:, None].to(tl.int64) * K + ks[None, :], mask=m, other=-1)
    carried = (g >= 0) & (tl.load(ok).to(tl.int32) != 0)
    tl.store(own + rows[:, None].to(tl.int64) * K + ks[None, :], carried.to(tl.uint8), mask=m)
    ranks = tl.arange(0, RP)
    to_rank = carried[:, :, None] & ((g // experts_per_rank)[:, :, None] == ranks[None, None, :])
    pushed = tl.max(to_rank.to(tl.int32), axis=1)
    tl.store(
        partial + rows[:, None].to(tl.int64) * num_ranks + ranks[None, :],
        pushed.to(tl.uint8),
        mask=live[:, None] & (ranks[None, :] < num_ranks),
    )


def routing_masks(ids, ok, num_ranks: int, experts_per_rank: int):
    """(own bool [T, K], partial bool [T, R]) of this rank's published ids in one launch (the
    reference executor's routing_masks, bit for bit)."""
    T, K = ids.shape
    own = torch.empty(T, K, dtype=torch.bool, device=ids.device)
    partial = torch.empty(T, num_ranks, dtype=torch.bool, device=ids.device)
    if T:
        _routing_masks_kernel[(triton.cdiv(T, 64),)](
            ids,
            ok,
            own.view(torch.uint8),
            partial.view(torch.uint8),
            T,
            experts_per_rank,
            num_ranks,
            K=K,
            KP=triton.next_power_of_2(K),
            RP=triton.next_power_of_2(num_ranks),
            BLOCK_T=64,
            num_warps=4,
        )
    return own, partial


@triton.jit
def _reduce_partials_kernel(
    partials,
    part_stride,
    mask,
    out,
    T,
    H,
    num_ranks,
    HAS_SHARED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[t] = sum over owners r = 0..R-1 of partials[r, t] where mask[t, r] (+ partials[R, t]),
    in fp32, in this fixed order. Unset rows are never read, so stale or poisoned rows cannot leak."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rmask = rows < T
    offs = rows[:, None].to(tl.int64) * H + cols[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for r in range(0, num_ranks):
        m = tl.load(mask + rows * num_ranks + r, mask=rmask, other=0) != 0
        # int64 offsets: R * T * H passes 2^31 at T = 32768, H = 8192, R = 8
        acc += tl.load(partials + tl.cast(r, tl.int64) * part_stride + offs, mask=m[:, None], other=0.0).to(tl.float32)
    if HAS_SHARED:
        shared_row = tl.cast(num_ranks, tl.int64) * part_stride
        acc += tl.load(partials + shared_row + offs, mask=rmask[:, None], other=0.0).to(tl.float32)
    tl.store(out + offs, acc.to(out.dtype.element_ty), mask=rmask[:, None])


def _as_bytes(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as the uint8 the kernels read (a view where it already is one, no copy)."""
    if mask.dtype == torch.bool and mask.is_contiguous():
        return mask.view(torch.uint8)
    return mask.to(torch.uint8).contiguous()


def reduce_partials(partials, mask, num_tokens: int, has_shared: bool, out_dtype):
    """Deterministic sum of a [S, T_max, H] partials region for the first num_tokens tokens;
    mask bool [T, R] says which owners pushed a row."""
    num_ranks = mask.shape[1]
    H = partials.shape[2]
    out = torch.empty(num_tokens, H, dtype=out_dtype, device=partials.device)
    if num_tokens == 0:
        return out
    assert H % 128 == 0
    grid = (triton.cdiv(num_tokens, 16), H // 128)
    _reduce_partials_kernel[grid](
        partials,
        partials.stride(0),
        _as_bytes(mask),
        out,
        num_tokens,
        H,
        num_ranks,
        HAS_SHARED=has_shared,
        BLOCK_T=16,
        BLOCK_H=128,
        num_warps=4,
    )
    return out


# ----------------------------------------------------------------------------- grouped GEMM


@triton.jit
def _grouped_gemm_kernel(
    a,
    a_scales,
    b,
    b_scales,
    c,
    block_expert,
    N,
    K,
    stride_am,
    stride_asm,
    stride_be,
    stride_bn,
    stride_bse,
    stride_bsn,
    stride_cm,
    num_m_blocks,
    SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """C[m, :] = A[m, :] @ B[e]^T for the rows of every BLOCK_M block, e = block_expert[block]
    (-1: idle block). With SCALED, A is e4m3 with one fp32 scale per 1x128 and B e4m3 with one
    per 128x128 block; each 128-deep partial product is scaled before it is accumulated."""
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n_blocks
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    e = tl.load(block_expert + pid_m)
    if e < 0:
        return
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b + e.to(tl.int64) * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        a_tile = tl.load(a_ptrs)
        b_tile = tl.load(b_ptrs)
        if SCALED:
            a_s = tl.load(a_scales + offs_m * stride_asm + kb)
            b_s = tl.load(b_scales + e.to(tl.int64) * stride_bse + (offs_n // 128) * stride_bsn + kb)
            acc += tl.dot(a_tile, b_tile) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a_tile, b_tile, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    tl.store(c + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c.dtype.element_ty))


def grouped_gemm(
    a,
    b,
    block_expert,
    out,
    a_scales=None,
    b_scales=None,
    block_m: int = 128,
    block_n: int | None = None,
    num_stages: int | None = None,
    num_warps: int = 8,
    group_m: int = 16,
):
    """out[rows of block i] = a[rows] @ b[block_expert[i]]^T for every block_m-row block.

    a [M, K] (bf16, or e4m3 with a_scales [M, K/128] fp32), b [E, N, K] (bf16, or e4m3 with
    b_scales [E, N/128, K/128] fp32), block_expert int32 [M / block_m] (-1 = skip), out [M, N].
    """
    M, K = a.shape
    N = b.shape[1]
    scaled = a_scales is not None
    block_k = 128 if scaled else 64
    block_n = block_n or 128
    assert M % block_m == 0 and N % block_n == 0 and K % block_k == 0, (M, N, K, block_m, block_n, block_k)
    assert a.stride(1) == 1 and b.stride(2) == 1 and out.stride(-1) == 1
    num_m_blocks = M // block_m
    grid = (num_m_blocks * (N // block_n),)
    _grouped_gemm_kernel[grid](
        a,
        a_scales if scaled else a,
        b,
        b_scales if scaled else b,
        out,
        block_expert,
        N,
        K,
        a.stride(0),
        a_scales.stride(0) if scaled else 0,
        b.stride(0),
        b.stride(1),
        b_scales.stride(0) if scaled else 0,
        b_scales.stride(1) if scaled else 0,
        out.stride(0),
        num_m_blocks,
        SCALED=scaled,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=group_m,
        num_warps=num_warps,
        num_stages=num_stages or 4,
    )
    return out
