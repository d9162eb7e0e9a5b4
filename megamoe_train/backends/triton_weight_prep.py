"""Triton kernels that prepare quantized expert weights once per weight update (fp8; mxfp4 below).

`quantize_blocks` reads a master weight [E, N, K] (fp32 / bf16) once and, per block of
the recipe's weight block (128 x 128 for fp8), computes the block's amax and fp32 scale and
writes, in the same pass: the e4m3 data and scales in kernel layout (fc1: gate/up interleaved in
chunks of rows) and the e4m3 data and scales of the master-order weight transposed ([E, K, N],
the operand of an FP8 dgrad GEMM); by default it quantizes and stores a block 64 rows at a time
after the whole block's amax (rows_per_step, each step's rows read again from L2).
`dequantize_blocks` turns kernel-layout data back into the master-order weight in a compute
dtype (the copies a bf16 backward reads).

Both are bit for bit what quant.quantize_weight / quant.dequantize_weight and the torch gate/up
(de)interleave give: scale = max(amax, 1e-4) / 448 and data = x / scale with correctly rounded
divisions (tl.math.div_rn and triton_kernels.divide_rn; Triton's `/` is approximate), clamp to
+-448, round to nearest even.

CPU tensors run only under the Triton interpreter (TRITON_INTERPRET=1, used by the tests). Its
float casts do not round to nearest even (triton 3.8: fp32 -> bf16 truncates, fp8 rounds ties up),
so for CPU tensors the kernels convert with integer ops that do (SOFT_CAST, triton_kernels'
_e4m3_bits / _e4m3_value, shared with its MX row kernels); on the GPU the hardware conversions
(cvt.rn) do it.

`quantize_e2m1_blocks` does the same for the mxfp8_mxfp4 recipe's E2M1 weights with ue8m0 scales in
1 x 32 blocks: one pass over the master weight writes the packed codes and scales in kernel layout
(blocks along K, fc1 rows interleaved) and, optionally, the dgrad's transposed copy (the master
weight transposed, blocks along N: quant.quantize_weight_t, a quantization of its own since the
blocks are not square). Bit for bit quant.quantize_weight / quantize_weight_t, with integer ops and
one multiply by an exact power of two, the same on the GPU and in the interpreter (no soft casts
needed).

`fold_e2m1_blocks` turns those kernel-layout E2M1 weights into the operand of Hopper's fp8 GEMMs
(quant.fold_mx_weight, bit for bit): e4m3 elements against each 128 x 128 block's largest 1 x 32
scale, one fp32 power-of-two scale per block (the fold math shared with triton_kernels' MX rows).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import quant
from .triton_kernels import _e4m3_bits, _e4m3_value, _mx_fold, _mx_fold_scale, divide_rn

# Kernels may only read constexpr globals.
_E4M3_MAX = tl.constexpr(quant.E4M3_MAX)
_MIN_AMAX = tl.constexpr(quant._FP32_SCALE_MIN_AMAX)
_E2M1_MAX_BITS = tl.constexpr(0x40C00000)  # float32 bits of 6.0, quant.E2M1_MAX
_ONE_BITS = tl.constexpr(0x3F800000)  # float32 bits of 1.0


MASTER_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels are written for


def master_dtypes(device: torch.device, weight_format: str = "e4m3") -> tuple[torch.dtype, ...]:
    """Master (and compute-copy) dtypes the kernels of `weight_format` take on `device`. fp8 on
    the GPU: bf16 only: with fp32 masters the H200 run of tests/test_weight_prep.py (triton 3.6)
    gave bits different from quant.py (cause not found yet, 2026-11-30), so fp32 masters take the
    torch ops there; the interpreter covers both. e2m1: both everywhere: its kernel divides
    nothing, calls no libdevice function (triton compiles those flushing subnormals) and widens a
    bf16 master to the float32 it is, so both dtypes take the same float32 ops
    (tests/test_weight_prep_fp4.py's GPU tests compare both; not yet run on a GPU, 2026-12-04)."""
    if weight_format == "e2m1":
        return MASTER_DTYPES
    return (torch.bfloat16,) if device.type == "cuda" else MASTER_DTYPES


def supports(device: torch.device) -> bool:
    """The GPU needs hardware e4m3 (sm89+); CPU tensors need the interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


# ----------------------------------------------------------------------------- conversions


@triton.jit
def _to_output(v, OUT_BF16: tl.constexpr, SOFT_CAST: tl.constexpr):
    """float32 -> what the output tensor holds: bf16 (rounded to nearest even; as int16 bits
    under SOFT_CAST) or float32 unchanged."""
    if OUT_BF16:
        if SOFT_CAST:
            bits = v.to(tl.int32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = tl.where(v != v, 0x7FC0, rounded)
            return rounded.to(tl.int16)
        else:
            return v.to(tl.bfloat16)
    else:
        return v


# ----------------------------------------------------------------------------- layouts


@triton.jit
def _kernel_row_block(nb, half_blocks, chunk_blocks, GATE_UP: tl.constexpr):
    """Row block nb of the master weight -> its row block in kernel layout. fc1 (GATE_UP):
    [gate; up] -> gate chunk 0, up chunk 0, gate chunk 1, ... with chunks of chunk_blocks
    blocks; fc2 keeps its order."""
    if GATE_UP:
        half = nb // half_blocks
        idx = nb % half_blocks
        return (2 * (idx // chunk_blocks) + half) * chunk_blocks + idx % chunk_blocks
    else:
        return nb


@triton.jit
def _block_ids(N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(expert, row block, column block) of this program; column blocks vary fastest."""
    pid = tl.program_id(0)
    k_blocks = K // BLOCK_K
    n_blocks = N // BLOCK_N
    kb = pid % k_blocks
    nb = (pid // k_blocks) % n_blocks
    e = (pid // (k_blocks * n_blocks)).to(tl.int64)
    return e, nb, kb, n_blocks, k_blocks


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _quantize_blocks_kernel(
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
    half_blocks,
    chunk_blocks,
    GATE_UP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SOFT_CAST: tl.constexpr,
    ROWS: tl.constexpr,
):
    """One program per weight block: read it, write it quantized twice (kernel layout, transposed
    master order) with its scale. ROWS < BLOCK_N: the quantization and both stores go ROWS rows at
    a time, each chunk read again (from L2) after the block's amax, so fewer values are live."""
    e, nb, kb, n_blocks, k_blocks = _block_ids(N, K, BLOCK_N, BLOCK_K)
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_K)
    # 64-bit block bases, 32-bit offsets inside a block (fewer live registers per element).
    block = src + e * stride_e + (nb * BLOCK_N).to(tl.int64) * stride_n + (kb * BLOCK_K).to(tl.int64) * stride_k
    x = tl.load(block + r[:, None] * stride_n + c[None, :] * stride_k).to(tl.float32)

    # amax as the integer max of |x|'s bits (monotonic for non-negative floats), one reduction
    # over the whole block (axis None: no per-row shuffles). NaN bits exceed inf's, so a NaN
    # anywhere makes the block NaN, as torch's amax / clamp_min do (float max skips NaN).
    amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(tl.maximum(amax, _MIN_AMAX, propagate_nan=tl.PropagateNan.ALL), _E4M3_MAX)
    recip = tl.math.div_rn(1.0, scale)

    kernel_nb = _kernel_row_block(nb, half_blocks, chunk_blocks, GATE_UP)
    base = e * N * K
    out = data + base + (kernel_nb * BLOCK_N).to(tl.int64) * K + kb * BLOCK_K
    out_t = data_t + base + (kb * BLOCK_K).to(tl.int64) * N + nb * BLOCK_N
    tl.store(scales + (e * n_blocks + kernel_nb) * k_blocks + kb, scale)
    tl.store(scales_t + (e * k_blocks + kb) * n_blocks + nb, scale)
    if ROWS == BLOCK_N:
        q = _quantize_values(x, scale, recip, SOFT_CAST)
        tl.store(out + r[:, None] * K + c[None, :], q)
        tl.store(out_t + c[:, None] * N + r[None, :], tl.trans(q))
    else:
        rr = tl.arange(0, ROWS)
        for r0 in tl.static_range(0, BLOCK_N, ROWS):
            xr = tl.load(block + (r0 + rr)[:, None] * stride_n + c[None, :] * stride_k).to(tl.float32)
            q = _quantize_values(xr, scale, recip, SOFT_CAST)
            tl.store(out + (r0 + rr)[:, None] * K + c[None, :], q)
            tl.store(out_t + c[:, None] * N + (r0 + rr)[None, :], tl.trans(q))


@triton.jit
def _quantize_values(x, scale, recip, SOFT_CAST: tl.constexpr):
    """x / scale (triton_kernels.divide_rn: why not div_rn), clamped to +-448, as e4m3 bits."""
    y = divide_rn(x, scale, recip)
    y = tl.minimum(
        tl.maximum(y, -_E4M3_MAX, propagate_nan=tl.PropagateNan.ALL), _E4M3_MAX, propagate_nan=tl.PropagateNan.ALL
    )
    return _e4m3_bits(y, SOFT_CAST)


@triton.jit
def _dequantize_blocks_kernel(
    data,
    scales,
    out,
    N,
    K,
    half_blocks,
    chunk_blocks,
    GATE_UP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    OUT_BF16: tl.constexpr,
    SOFT_CAST: tl.constexpr,
):
    """One program per block of the master-order output: read its kernel-layout block, multiply
    by the block scale in float32, convert."""
    e, nb, kb, n_blocks, k_blocks = _block_ids(N, K, BLOCK_N, BLOCK_K)
    kernel_nb = _kernel_row_block(nb, half_blocks, chunk_blocks, GATE_UP)
    offsets = tl.arange(0, BLOCK_N)[:, None] * K + tl.arange(0, BLOCK_K)[None, :]
    base = e * N * K + kb * BLOCK_K
    b = tl.load(data + base + (kernel_nb * BLOCK_N).to(tl.int64) * K + offsets)
    scale = tl.load(scales + (e * n_blocks + kernel_nb) * k_blocks + kb)
    v = _e4m3_value(b, SOFT_CAST) * scale
    tl.store(out + base + (nb * BLOCK_N).to(tl.int64) * K + offsets, _to_output(v, OUT_BF16, SOFT_CAST))


# ----------------------------------------------------------------------------- launchers


def _gate_up_blocks(n: int, block_n: int, chunk: int | None) -> tuple[int, int]:
    """(row blocks per half, row blocks per chunk) for fc1; (1, 1) unused for fc2."""
    if chunk is None:
        return 1, 1
    if n % 2 or (n // 2) % chunk or chunk % block_n:
        raise ValueError(
            f"gate/up rows: {n} must be 2 * I with I a multiple of chunk={chunk}, "
            f"itself a multiple of the block rows {block_n}"
        )
    return n // 2 // block_n, chunk // block_n


def _check_tiling(name: str, shape: torch.Size, device: torch.device, block: tuple[int, int]) -> None:
    if len(shape) != 3:
        raise ValueError(f"{name}: expected [E, N, K], got shape {list(shape)}")
    if any(b <= 0 or b & (b - 1) for b in block):
        raise ValueError(f"block: {block} must be powers of two")
    if shape[1] % block[0] or shape[2] % block[1]:
        raise ValueError(f"{name}: shape {list(shape)} does not tile into {block} blocks")
    if not supports(device):
        raise ValueError(
            f"{name}: the weight-prep kernels need a CUDA sm89+ tensor (or a CPU one under "
            f"TRITON_INTERPRET=1), got {device}"
        )


def quantize_blocks(
    w: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    chunk: int | None = None,
    num_warps: int = 8,
    rows_per_step: int | None = 64,
):
    """Quantize w [E, N, K] to e4m3 with fp32 scales per `block` (rows, cols) in one pass.

    Returns (data, scales, data_t, scales_t): data [E, N, K] e4m3 and scales [E, N/bn, K/bk] in
    kernel layout (with chunk: gate/up interleaved in chunks of `chunk` rows, else master order);
    data_t [E, K, N] and scales_t [E, K/bk, N/bn]: the master-order data and scales transposed.
    rows_per_step (a power of two dividing the block's rows; None = all): how many rows of a block
    are quantized and stored at a time, after the whole block's amax. Defaults: 64 rows with 8
    warps, the fastest on an H200 (2026-12-01: S1's w1 3.00 ms against 3.79 for whole blocks at 4
    warps, the best whole-block setting, w2 1.44 against 1.93, the proxy's -20%; 16 rows lost, 32
    was within 3-10% of 64). benchmarks/bench_weight_prep.py sweeps num_warps.
    """
    if w.dtype not in master_dtypes(w.device):
        raise ValueError(f"weight: expected one of {master_dtypes(w.device)} on {w.device.type}, got {w.dtype}")
    _check_tiling("weight", w.shape, w.device, block)
    E, N, K = w.shape
    block_n, block_k = block
    if max(w.stride(1), w.stride(2)) * max(block) >= 2**31:
        w = w.contiguous()  # offsets inside a block are 32-bit
    half_blocks, chunk_blocks = _gate_up_blocks(N, block_n, chunk)
    rows = block_n if rows_per_step is None else rows_per_step
    if rows <= 0 or rows & (rows - 1) or block_n % rows:
        raise ValueError(f"rows_per_step: {rows_per_step} must be a power of two dividing the block's {block_n} rows")
    data = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=w.device)
    data_t = torch.empty(E, K, N, dtype=torch.float8_e4m3fn, device=w.device)
    scales = torch.empty(E, N // block_n, K // block_k, dtype=torch.float32, device=w.device)
    scales_t = torch.empty(E, K // block_k, N // block_n, dtype=torch.float32, device=w.device)
    grid = (E * (N // block_n) * (K // block_k),)
    _quantize_blocks_kernel[grid](
        w,
        *w.stride(),
        data.view(torch.uint8),
        scales,
        data_t.view(torch.uint8),
        scales_t,
        N,
        K,
        half_blocks,
        chunk_blocks,
        GATE_UP=chunk is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SOFT_CAST=w.device.type == "cpu",
        ROWS=rows,
        num_warps=num_warps,
    )
    return data, scales, data_t, scales_t


def dequantize_blocks(
    data: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype,
    block: tuple[int, int] = (128, 128),
    chunk: int | None = None,
    num_warps: int = 8,
):
    """Kernel-layout e4m3 data [E, N, K] and fp32 scales -> master order [E, N, K] in dtype
    (bfloat16 or float32): the dequantized value rounded once to dtype."""
    if data.dtype != torch.float8_e4m3fn or not data.is_contiguous():
        raise ValueError(f"data: expected contiguous float8_e4m3fn, got {data.dtype}")
    _check_tiling("data", data.shape, data.device, block)
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype: the kernel writes bfloat16 or float32, got {dtype}")
    E, N, K = data.shape
    block_n, block_k = block
    expected = (E, N // block_n, K // block_k)
    if scales.dtype != torch.float32 or tuple(scales.shape) != expected or not scales.is_contiguous():
        raise ValueError(
            f"scales: expected contiguous float32 {list(expected)}, got {scales.dtype} {list(scales.shape)}"
        )
    half_blocks, chunk_blocks = _gate_up_blocks(N, block_n, chunk)
    out = torch.empty(E, N, K, dtype=dtype, device=data.device)
    soft = data.device.type == "cpu"
    _dequantize_blocks_kernel[(E * (N // block_n) * (K // block_k),)](
        data.view(torch.uint8),
        scales,
        out.view(torch.int16) if soft and dtype == torch.bfloat16 else out,
        N,
        K,
        half_blocks,
        chunk_blocks,
        GATE_UP=chunk is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        OUT_BF16=dtype == torch.bfloat16,
        SOFT_CAST=soft,
        num_warps=num_warps,
    )
    return out


# ----------------------------------------------------------------------------- e2m1 (mxfp4) weights


@triton.jit
def _ue8m0_scales(amax_bits):
    """Block maxima as float32 bits (non-negative, so ordered like the values; NaN's above inf's)
    -> (stored ue8m0 code, uint8; 1 / scale, float32). quant._block_scales in integers: with
    amax = 1.f * 2**(b - 127) (b its biased exponent) and 6 = 1.5 * 2**2, ceil(log2(amax / 6)) is
    b - 129, plus one when f > 0.5; the code is that plus 127, at least 0 (a finite amax gives at
    most 253). quant.py's floor on amax (2**-126) needs no counterpart: every amax up to
    3 * 2**-126, subnormal or zero too, gets code 0 either way. NaN or inf: 255, and a NaN
    reciprocal so the block decodes to NaN."""
    code = tl.maximum((amax_bits >> 23) - 2 + ((amax_bits & 0x7FFFFF) > 0x400000).to(tl.int32), 0)
    finite = amax_bits < 0x7F800000
    # 2**(127 - code), biased exponent 254 - code: at least 1, a normal number.
    recip = tl.where(finite, (254 - code) << 23, 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where(finite, code, 255).to(tl.uint8), recip


@triton.jit
def _e2m1_codes(x, recip):
    """x * recip (a power of two, so the product is x / scale exactly) -> E2M1 codes (int32,
    sign << 3 | magnitude index), as quant._e2m1_encode: nearest value, ties to the even index,
    saturating at 6. Integer ops and a plain multiply only (no libdevice, which flushes
    subnormals on the GPU). The sign is the product's, so a NaN block's signs follow the
    device's NaN propagation as torch's division does."""
    y = x * recip
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 28) & 8
    magnitude = tl.minimum(bits & 0x7FFFFFFF, _E2M1_MAX_BITS)  # NaN and inf saturate to 6 too
    # [1, 6]: keep one mantissa bit, rounding to nearest even (a carry moves into the exponent),
    # and rebias: 1.0 (exponent field 127) is index 2.
    normal = ((magnitude + 0x1FFFFF + ((magnitude >> 22) & 1)) >> 22) - (126 << 1)
    # Below 1: 0, 0.5 or 1.0 (indices 0, 1, 2); the tie 0.25 goes to 0, 0.75 to 1.0.
    m = magnitude.to(tl.float32, bitcast=True)
    small = (m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32)
    return sign | tl.where(magnitude < _ONE_BITS, small, normal)


@triton.jit
def _pack_pairs(codes, ROWS: tl.constexpr, COLS: tl.constexpr):
    """codes [ROWS, COLS] -> bytes [ROWS, COLS / 2], as quant.pack_fp4: the even column in the
    low nibble."""
    even, odd = tl.split(tl.reshape(codes, [ROWS, COLS // 2, 2]))
    return (even | (odd << 4)).to(tl.uint8)


@triton.jit
def _quantize_e2m1_kernel(
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
    inter,
    chunk,
    GATE_UP: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    BF16_BITS: tl.constexpr,
    TILE_N: tl.constexpr,
    TILE_K: tl.constexpr,
):
    """One program per TILE_N x TILE_K tile of the master weight: read it once, write its 1 x 32
    blocks along K packed in kernel layout (fc1 rows gate/up interleaved) with their scales and,
    with TRANSPOSED, its 32 x 1 blocks along N packed into the transposed copy with theirs.
    BF16_BITS: src holds bf16 masters as int16 bits, widened to float32 by a shift (exact, also
    for subnormals, which the interpreter's bf16 cast gets wrong in triton 3.8)."""
    e, nt, kt, n_tiles, k_tiles = _block_ids(N, K, TILE_N, TILE_K)
    r = tl.arange(0, TILE_N)
    c = tl.arange(0, TILE_K)
    tile = src + e * stride_e + (nt * TILE_N).to(tl.int64) * stride_n + (kt * TILE_K).to(tl.int64) * stride_k
    x = tl.load(tile + r[:, None] * stride_n + c[None, :] * stride_k)
    if BF16_BITS:
        x = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    # amax as the integer max of |x|'s bits, as the fp8 kernel does (a NaN wins over inf).
    magnitude = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF

    # Kernel layout: [E, N, K / 2] bytes and [E, N, K / 32] scales, fc1 rows interleaved in
    # chunks of `chunk` rows (_kernel_row_block with one-row blocks).
    amax = tl.max(tl.reshape(magnitude, [TILE_N, TILE_K // 32, 32]), axis=2)
    code, recip = _ue8m0_scales(amax)
    recip = tl.reshape(tl.broadcast_to(recip[:, :, None], [TILE_N, TILE_K // 32, 32]), [TILE_N, TILE_K])
    packed = _pack_pairs(_e2m1_codes(x, recip), TILE_N, TILE_K)
    row = e * N + _kernel_row_block(nt * TILE_N + r, inter, chunk, GATE_UP).to(tl.int64)
    tl.store(data + row[:, None] * (K // 2) + kt * (TILE_K // 2) + tl.arange(0, TILE_K // 2)[None, :], packed)
    tl.store(scales + row[:, None] * (K // 32) + kt * (TILE_K // 32) + tl.arange(0, TILE_K // 32)[None, :], code)

    if TRANSPOSED:
        # The master-order weight transposed: [E, K, N / 2] bytes and [E, K, N / 32] scales.
        amax_t = tl.max(tl.reshape(magnitude, [TILE_N // 32, 32, TILE_K]), axis=1)
        code_t, recip_t = _ue8m0_scales(amax_t)
        recip_t = tl.reshape(tl.broadcast_to(recip_t[:, None, :], [TILE_N // 32, 32, TILE_K]), [TILE_N, TILE_K])
        packed_t = _pack_pairs(tl.trans(_e2m1_codes(x, recip_t)), TILE_K, TILE_N)
        row_t = e * K + (kt * TILE_K + c).to(tl.int64)
        tl.store(data_t + row_t[:, None] * (N // 2) + nt * (TILE_N // 2) + tl.arange(0, TILE_N // 2)[None, :], packed_t)
        tl.store(
            scales_t + row_t[:, None] * (N // 32) + nt * (TILE_N // 32) + tl.arange(0, TILE_N // 32)[None, :],
            tl.trans(code_t),
        )


def _tile(size: int, largest: int) -> int:
    """The largest power of two up to `largest` (at least one block, 32) that divides size."""
    tile = largest
    while size % tile:
        tile //= 2
    return tile


def quantize_e2m1_blocks(
    w: torch.Tensor,
    chunk: int | None = None,
    transposed: bool = True,
    tile: tuple[int, int] = (64, 128),
    num_warps: int = 4,
):
    """Quantize w [E, N, K] to E2M1 with ue8m0 scales in 1 x 32 blocks (the mxfp8_mxfp4 recipe's
    weights) in one pass; N and K multiples of 32.

    Returns (data, scales, data_t, scales_t): data [E, N, K/2] packed uint8 (two codes a byte, the
    even element in the low nibble) and scales [E, N, K/32] uint8 in kernel layout (with chunk:
    rows gate/up interleaved in chunks of `chunk` rows, else master order); data_t [E, K, N/2] and
    scales_t [E, K, N/32]: the master-order weight transposed, quantized in 1 x 32 blocks along N
    (other blocks than data's, so not data transposed; the quantized dgrad's weights); None, None
    without `transposed`. Bit for bit quant.quantize_weight of the interleaved master weight and
    quant.quantize_weight_t of the master weight. tile: the
    (rows, cols) one program reads at most, powers of two of at least 32 (smaller where the shape
    needs).
    """
    if w.dtype not in master_dtypes(w.device, "e2m1"):
        raise ValueError(f"weight: expected one of {master_dtypes(w.device, 'e2m1')}, got {w.dtype}")
    if any(t < 32 or t & (t - 1) for t in tile):
        raise ValueError(f"tile: {tile} must be powers of two of at least 32")
    _check_tiling("weight", w.shape, w.device, (32, 32))  # the transposed copy blocks N by 32 too
    E, N, K = w.shape
    tile_n, tile_k = _tile(N, tile[0]), _tile(K, tile[1])
    if max(w.stride(1), w.stride(2)) * max(tile_n, tile_k) >= 2**31:
        w = w.contiguous()  # offsets inside a tile are 32-bit
    inter, chunk_rows = _gate_up_blocks(N, 1, chunk)
    data = torch.empty(E, N, K // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(E, N, K // 32, dtype=torch.uint8, device=w.device)
    if transposed:
        data_t = torch.empty(E, K, N // 2, dtype=torch.uint8, device=w.device)
        scales_t = torch.empty(E, K, N // 32, dtype=torch.uint8, device=w.device)
    else:
        data_t, scales_t = data, scales  # never written (TRANSPOSED off)
    _quantize_e2m1_kernel[(E * (N // tile_n) * (K // tile_k),)](
        w.view(torch.int16) if w.dtype == torch.bfloat16 else w,
        *w.stride(),
        data,
        scales,
        data_t,
        scales_t,
        N,
        K,
        inter,
        chunk_rows,
        GATE_UP=chunk is not None,
        TRANSPOSED=transposed,
        BF16_BITS=w.dtype == torch.bfloat16,
        TILE_N=tile_n,
        TILE_K=tile_k,
        num_warps=num_warps,
    )
    if not transposed:
        return data, scales, None, None
    return data, scales, data_t, scales_t


# ----------------------------------------------------------------------------- mxfp4 weights folded for fp8 MMA


@triton.jit
def _e2m1_values(codes):
    """E2M1 codes (int32, sign << 3 | index) -> their exact float32 values, from the bits: index
    i >= 2 is (1 + (i & 1) / 2) * 2**((i >> 1) - 1), i.e. bits (i << 22) + (126 << 23); index 1 is
    0.5 (126 << 23), 0 is 0; code 8 is -0.0, as quant._e2m1_decode."""
    index = codes & 7
    bits = tl.where(index >= 2, (index << 22) + (126 << 23), index * (126 << 23))
    return (bits | ((codes & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _fold_e2m1_kernel(
    data,
    scales,
    out,
    out_scales,
    N,
    K,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    SOFT_CAST: tl.constexpr,
):
    """One program per BLOCK x BLOCK (128 x 128) fold block: reads the block's 1 x 32 ue8m0 codes
    (BLOCK x BLOCK/32 bytes) for its largest, then ROWS rows at a time their packed codes (and
    their scale codes again, a few bytes from L1), and writes the folded e4m3 rows and the block's
    fp32 scale."""
    e, nb, kb, n_blocks, k_blocks = _block_ids(N, K, BLOCK, BLOCK)
    SB: tl.constexpr = BLOCK // 32  # 1 x 32 scales per row of the block
    first_row = e * N + (nb * BLOCK).to(tl.int64)
    scale_cols = kb * SB + tl.arange(0, SB)
    r = tl.arange(0, BLOCK)
    codes = tl.load(scales + (first_row + r)[:, None] * (K // 32) + scale_cols[None, :]).to(tl.int32)
    block_code = tl.max(codes)
    rr = tl.arange(0, ROWS)
    packed_cols = kb * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
    cols = kb * BLOCK + tl.arange(0, BLOCK)
    for r0 in tl.static_range(0, BLOCK, ROWS):
        row = first_row + r0 + rr
        packed = tl.load(data + row[:, None] * (K // 2) + packed_cols[None, :]).to(tl.int32)
        # quant.unpack_fp4: the even element in the low nibble
        e2m1 = tl.reshape(tl.join(packed & 15, packed >> 4), [ROWS, BLOCK])
        x = tl.reshape(_e2m1_values(e2m1), [ROWS, SB, 32])
        row_codes = tl.load(scales + row[:, None] * (K // 32) + scale_cols[None, :]).to(tl.int32)
        folded = _mx_fold(x, row_codes, block_code, SOFT_CAST)
        tl.store(out + row[:, None] * K + cols[None, :], tl.reshape(folded, [ROWS, BLOCK]))
    tl.store(out_scales + (e * n_blocks + nb) * k_blocks + kb, _mx_fold_scale(block_code))


def fold_e2m1_blocks(data: torch.Tensor, scales: torch.Tensor, rows_per_step: int = 32, num_warps: int = 4):
    """mxfp8_mxfp4 weights as Hopper's fp8 GEMMs read them, quant.fold_mx_weight bit for bit: data
    packed E2M1 uint8 [E, N, K/2] and scales ue8m0 uint8 [E, N, K/32] (N, K multiples of 128) ->
    (e4m3 [E, N, K], fp32 power-of-two scales [E, N/128, K/128]), each 128 x 128 block's elements
    re-expressed against its largest 1 x 32 scale. rows_per_step: rows of a block folded and stored
    at a time (a power of two dividing 128)."""
    if data.dtype != torch.uint8 or scales.dtype != torch.uint8 or data.dim() != 3:
        raise ValueError(
            f"fold_e2m1_blocks: expected uint8 [E, N, K/2] data and scales, got {data.dtype} {scales.dtype}"
        )
    E, N, K = data.shape[0], data.shape[1], 2 * data.shape[2]
    block = quant.MX_FOLD_BLOCK
    _check_tiling("data", torch.Size((E, N, K)), data.device, (block, block))
    if tuple(scales.shape) != (E, N, K // 32):
        raise ValueError(f"fold_e2m1_blocks: scales must have shape {[E, N, K // 32]}, got {list(scales.shape)}")
    if rows_per_step <= 0 or rows_per_step & (rows_per_step - 1) or block % rows_per_step:
        raise ValueError(f"rows_per_step: {rows_per_step} must be a power of two dividing {block}")
    out = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=data.device)
    out_scales = torch.empty(E, N // block, K // block, dtype=torch.float32, device=data.device)
    _fold_e2m1_kernel[(E * (N // block) * (K // block),)](
        data.contiguous(),
        scales.contiguous(),
        out.view(torch.uint8),
        out_scales,
        N,
        K,
        BLOCK=block,
        ROWS=rows_per_step,
        SOFT_CAST=data.device.type == "cpu",
        num_warps=num_warps,
    )
    return out, out_scales
