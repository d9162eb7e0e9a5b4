"""Block-scaled quantization: the one place where the numerics of every recipe live.

The reference oracle, the weight transforms and the tests all call these functions, so a
GPU kernel that matches them bit for bit matches the recipe. Everything here is plain torch
(float32 math, no custom kernels) and works on CPU and CUDA tensors with any leading dims.

Storage, per recipe (see precision.py); gradients quantized for the dgrad GEMMs
(recipe.grad_format) and both operands of the wgrad GEMMs (recipe.wgrad_format, blocks along the
token dim, stored transposed) use the activation rules, the dgrads' weights (quantize_weight_t:
the master weights transposed, blocked along the dgrad's reduction dim) the weight rules:
  * native: the tensor itself, no scales.
  * e4m3 + fp32 scales: scale = max(amax, 1e-4) / 448 per block, data float8_e4m3fn.
  * e4m3 / e2m1 + ue8m0 scales: scale = 2**ceil(log2(amax / max_value)), a power of two
    stored as its biased exponent (uint8, exponent + 127). Rounding the exponent up means
    no element of a block ever exceeds the format's largest value. A block holding a NaN or
    Inf gets the NaN scale (255) and decodes to all NaN.
  * e2m1 (FP4) codes are sign << 3 | magnitude index, two per byte, the even element in
    the low nibble.

Quantizing a dequantized tensor always gives back the same values. With fp32 scales it also
gives the same bits; with ue8m0 scales a block whose largest element rounded down onto half
the format's max (224 or 3) comes back with half the scale and doubled codes.
"""

from __future__ import annotations

import math

import torch

from .precision import PrecisionRecipe

E4M3_MAX = 448.0
E2M1_MAX = 6.0
# Magnitudes of the eight E2M1 codes; index = (exponent << 1) | mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring E2M1 magnitudes; a value on one of them is a tie.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

_FP32_SCALE_MIN_AMAX = 1e-4  # keeps fp32 scales away from 0 so all-zero blocks stay 0
_UE8M0_MIN_AMAX = 2.0**-126  # smallest normal float32: keeps frexp exact for zero blocks
_UE8M0_BIAS = 127
_FORMAT_MAX = {"e4m3": E4M3_MAX, "e2m1": E2M1_MAX}


# ----------------------------------------------------------------------------- ue8m0 scales


def ue8m0_to_float(u8: torch.Tensor) -> torch.Tensor:
    """Decode biased exponents (uint8) to float32 powers of two, bit-exactly.

    Built from the float32 bit pattern rather than exp2 so the result cannot depend on a
    device's math library: 1..254 are normal numbers, 0 is the subnormal 2**-127 and 255 is
    NaN, as in the OCP MX format.
    """
    if u8.dtype != torch.uint8:
        raise ValueError(f"ue8m0_to_float: expected a uint8 tensor, got {u8.dtype}")
    biased = u8.to(torch.int32)
    bits = torch.where(biased > 0, biased << 23, torch.full_like(biased, 1 << 22))
    bits = torch.where(biased == 255, torch.full_like(biased, 0x7FC00000), bits)
    return bits.view(torch.float32)


def float_to_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Encode positive scales as biased exponents (uint8), rounding up to a power of two.

    Rounding up (never down) keeps the guarantee that data / scale stays in range.
    Exponents outside [-127, 127] are clamped; NaN and Inf give 255 (NaN).
    """
    if not scale.is_floating_point():
        raise ValueError(f"float_to_ue8m0: expected a floating tensor, got {scale.dtype}")
    mantissa, exponent = torch.frexp(scale.float())
    # scale = m * 2**e with m in [0.5, 1): an exact power of two has m == 0.5.
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    return _biased(exponent, finite=scale.isfinite())


def _biased(exponent: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """The stored ue8m0 code of each exponent; 255 (NaN) where the value it came from is NaN or
    Inf (frexp gives them exponent 0, which would read as a scale of 1)."""
    code = (exponent.clamp(-_UE8M0_BIAS, _UE8M0_BIAS) + _UE8M0_BIAS).to(torch.uint8)
    return torch.where(finite, code, torch.full_like(code, 255))


def _pow2_exponent_above(amax: torch.Tensor, max_value: float) -> torch.Tensor:
    """ceil(log2(amax / max_value)) computed exactly from frexp, without a rounded divide.

    With amax = m * 2**e and max_value = mv * 2**ev (m, mv in [0.5, 1)), the ratio is
    (m / mv) * 2**(e - ev) and m / mv lies in (0.5, 2), so the ceiling is e - ev, plus one
    when m > mv. torch.log2 could round a value just above a power of two down to it and
    let the block's largest element overflow.
    """
    m, e = torch.frexp(amax)
    mv, ev = math.frexp(max_value)
    return e - ev + (m > mv).to(e.dtype)


def _block_scales(amax: torch.Tensor, fmt: str, scale_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale as float32 for the math, scale as stored) for float32 block maxima."""
    max_value = _FORMAT_MAX[fmt]
    if scale_format == "fp32":
        # Divide by a tensor, not a Python number: CUDA turns `t / number` into a multiply
        # by the rounded reciprocal, which would make the scales differ from the CPU's.
        scale = amax.clamp_min(_FP32_SCALE_MIN_AMAX) / torch.full_like(amax, max_value)
        return scale, scale
    if scale_format == "ue8m0":
        exponent = _pow2_exponent_above(amax.clamp_min(_UE8M0_MIN_AMAX), max_value)
        # A NaN or Inf in the block: the NaN scale, so the whole block decodes to NaN as with fp32
        # scales (an ordinary scale would saturate the block's other elements and turn the
        # non-finite one into a finite value).
        stored = _biased(exponent, finite=amax.isfinite())
        return ue8m0_to_float(stored), stored
    raise ValueError(f"scale_format: unsupported {scale_format!r} for a quantized format")


def _decode_scales(scales: torch.Tensor, scale_format: str) -> torch.Tensor:
    return ue8m0_to_float(scales) if scale_format == "ue8m0" else scales.float()


# ----------------------------------------------------------------------------- element codecs


def _encode(scaled: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 values already divided by their scale -> stored elements (unpacked)."""
    if fmt == "e4m3":
        # Clamp first: the exact divide can land a hair above 448 for fp32 scales.
        return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    if fmt == "e2m1":
        return _e2m1_encode(scaled)
    raise ValueError(f"unsupported element format {fmt!r}")


def _decode(data: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "e4m3":
        return data.float()
    if fmt == "e2m1":
        return _e2m1_decode(unpack_fp4(data))
    raise ValueError(f"unsupported element format {fmt!r}")


def _e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value, ties to the even code; returns uint8 codes 0..15.

    Counting the midpoints below |v| strictly and non-strictly gives the two neighbouring
    codes on a tie (and the same code otherwise); of those two, the even one wins.
    """
    midpoints = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=v.device)
    magnitude = v.abs().clamp_max(E2M1_MAX)
    below = torch.bucketize(magnitude, midpoints, right=False)
    at_or_below = torch.bucketize(magnitude, midpoints, right=True)
    index = torch.where(below % 2 == 0, below, at_or_below)
    sign = torch.signbit(v).to(torch.uint8) << 3
    return sign | index.to(torch.uint8)


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    table = torch.cat([table, -table])  # codes 8..15 are the negatives (8 is -0.0)
    return table[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes [..., K] into bytes [..., K/2]: element 2j low nibble, 2j+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim must be even, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_fp4: bytes [..., K/2] -> codes [..., K]."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4: expected uint8 packed data, got {packed.dtype}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- activations


def _check_last_dim(name: str, k: int, block: int, what: str) -> None:
    if block <= 0 or k % block:
        raise ValueError(f"{name}: last dim {k} is not a multiple of the {what} block {block}")


def _quantize_rows(name: str, x: torch.Tensor, fmt: str, block: int, scale_format: str, what: str):
    """x [..., K] -> (data, scales [..., K / block]) in 1 x block blocks along K."""
    if not x.is_floating_point() or x.dim() == 0:
        raise ValueError(f"{name}: expected a floating tensor [..., K], got {x.dtype} {list(x.shape)}")
    _check_last_dim(name, x.shape[-1], block, what)
    blocks = x.float().unflatten(-1, (-1, block))
    amax = blocks.abs().amax(dim=-1)
    scale, stored = _block_scales(amax, fmt, scale_format)
    data = _encode(blocks / scale.unsqueeze(-1), fmt).flatten(-2)
    return data, stored


def _dequantize_rows(name: str, data: torch.Tensor, scales, fmt: str, block: int, scale_format: str, what: str):
    _check_last_dim(name, data.shape[-1], block, what)
    expected = (*data.shape[:-1], data.shape[-1] // block)
    if scales is None or tuple(scales.shape) != expected:
        got = None if scales is None else list(scales.shape)
        raise ValueError(f"{name}: scales must have shape {list(expected)}, got {got}")
    values = _decode(data, fmt).unflatten(-1, (-1, block))
    return (values * _decode_scales(scales, scale_format).unsqueeze(-1)).flatten(-2)


def quantize_act(x: torch.Tensor, recipe: PrecisionRecipe) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize activations [..., K] in 1 x recipe.act_block blocks along K.

    Returns (data, scales) with scales [..., K / act_block]; native recipes return (x, None).
    """
    if recipe.act_format == "native":
        return x, None
    return _quantize_rows(
        "quantize_act", x, recipe.act_format, recipe.act_block, recipe.scale_format, f"{recipe.name!r} activation"
    )


def dequantize_act(data: torch.Tensor, scales: torch.Tensor | None, recipe: PrecisionRecipe) -> torch.Tensor:
    """Exact float32 value of stored activations: element * its block's scale."""
    if recipe.act_format == "native":
        return data.float()
    return _dequantize_rows(
        "dequantize_act",
        data,
        scales,
        recipe.act_format,
        recipe.act_block,
        recipe.scale_format,
        f"{recipe.name!r} activation",
    )


def fake_quantize_act(x: torch.Tensor, recipe: PrecisionRecipe) -> torch.Tensor:
    """The value activations take through the recipe's storage, as float32."""
    return dequantize_act(*quantize_act(x, recipe), recipe)


# ----------------------------------------------------------------------------- gradients


def quantize_grad(g: torch.Tensor, recipe: PrecisionRecipe) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize an output gradient [..., K] for a dgrad GEMM reducing over K (recipe.grad_format):
    the activation quantizer's rounding, 1 x recipe.act_block blocks along K. Native: (g, None)."""
    if recipe.grad_format == "native":
        return g, None
    return _quantize_rows(
        "quantize_grad", g, recipe.grad_format, recipe.act_block, recipe.scale_format, f"{recipe.name!r} gradient"
    )


def dequantize_grad(data: torch.Tensor, scales: torch.Tensor | None, recipe: PrecisionRecipe) -> torch.Tensor:
    if recipe.grad_format == "native":
        return data.float()
    return _dequantize_rows(
        "dequantize_grad",
        data,
        scales,
        recipe.grad_format,
        recipe.act_block,
        recipe.scale_format,
        f"{recipe.name!r} gradient",
    )


def fake_quantize_grad(g: torch.Tensor, recipe: PrecisionRecipe) -> torch.Tensor:
    """The value a dgrad GEMM reads for the gradient g, as float32."""
    return dequantize_grad(*quantize_grad(g, recipe), recipe)


# ----------------------------------------------------------------------------- wgrad operands


def quantize_tokens_t(values: torch.Tensor, recipe: PrecisionRecipe) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize a pool matrix [P, C] for a wgrad GEMM reducing over its rows (recipe.wgrad_format):
    per column, in 1 x recipe.act_block blocks along the rows (block j = rows j*128 .. j*128+127),
    with the activation quantizer's rounding. Returns the transposed layout the GEMM reads, tokens
    contiguous: (data [C, P], scales [C, P / act_block]). P must be a multiple of the block.
    Native: (values^T, None)."""
    if recipe.wgrad_format == "native":
        return values.t(), None
    if not values.is_floating_point() or values.dim() != 2:
        raise ValueError(
            f"quantize_tokens_t: expected a floating tensor [P, C], got {values.dtype} {list(values.shape)}"
        )
    if values.shape[0] % recipe.act_block:
        raise ValueError(
            f"quantize_tokens_t: {values.shape[0]} rows are not a multiple of the {recipe.name!r} "
            f"wgrad token block {recipe.act_block}"
        )
    data, scales = _quantize_rows(
        "quantize_tokens_t",
        values.t(),
        recipe.wgrad_format,
        recipe.act_block,
        recipe.scale_format,
        f"{recipe.name!r} wgrad token",
    )
    return data.contiguous(), scales.contiguous()


def dequantize_tokens_t(data: torch.Tensor, scales: torch.Tensor | None, recipe: PrecisionRecipe) -> torch.Tensor:
    """Exact float32 value [C, P] of quantize_tokens_t's output (still transposed)."""
    if recipe.wgrad_format == "native":
        return data.float()
    return _dequantize_rows(
        "dequantize_tokens_t",
        data,
        scales,
        recipe.wgrad_format,
        recipe.act_block,
        recipe.scale_format,
        f"{recipe.name!r} wgrad token",
    )


def fake_quantize_tokens(values: torch.Tensor, recipe: PrecisionRecipe) -> torch.Tensor:
    """The value a wgrad GEMM reads for one expert's rows [n, C] (pool order, n any), as float32
    [n, C]: blocks of act_block rows from the first row, the last one padded with zero rows."""
    if recipe.wgrad_format == "native":
        return values.float()
    n = values.shape[0]
    padded = -(-n // recipe.act_block) * recipe.act_block
    full = torch.zeros(padded, values.shape[1], dtype=torch.float32, device=values.device)
    full[:n] = values.float()
    return dequantize_tokens_t(*quantize_tokens_t(full, recipe), recipe).t()[:n]


# ----------------------------------------------------------------------------- weights


def _weight_blocks(name: str, n: int, k: int, recipe: PrecisionRecipe) -> tuple[int, int]:
    rows, cols = recipe.weight_block
    if rows <= 0 or n % rows:
        raise ValueError(f"{name}: row dim {n} is not a multiple of the {recipe.name!r} weight block rows {rows}")
    _check_last_dim(name, k, cols, f"{recipe.name!r} weight")
    return rows, cols


def _split(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[..., N, K] -> [..., N/rows, rows, K/cols, cols], a view."""
    return w.unflatten(-1, (-1, cols)).unflatten(-3, (-1, rows))


def quantize_weight(w: torch.Tensor, recipe: PrecisionRecipe) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize weights [..., N, K] in recipe.weight_block (rows, cols) blocks, cols along K.

    Returns (data, scales) with scales [..., N/rows, K/cols]. e4m3 data is [..., N, K]
    float8_e4m3fn; e2m1 data is packed uint8 [..., N, K/2]. Native returns (w, None).
    """
    if recipe.weight_format == "native":
        return w, None
    if not w.is_floating_point() or w.dim() < 2:
        raise ValueError(f"quantize_weight: expected a floating tensor [..., N, K], got {w.dtype} {list(w.shape)}")
    rows, cols = _weight_blocks("quantize_weight", w.shape[-2], w.shape[-1], recipe)
    blocks = _split(w.float(), rows, cols)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale, stored = _block_scales(amax, recipe.weight_format, recipe.scale_format)
    scaled = blocks / scale.unsqueeze(-1).unsqueeze(-3)
    data = _encode(scaled, recipe.weight_format).flatten(-2).flatten(-3, -2)
    if recipe.weight_format == "e2m1":
        data = pack_fp4(data)
    return data, stored


def dequantize_weight(data: torch.Tensor, scales: torch.Tensor | None, recipe: PrecisionRecipe) -> torch.Tensor:
    """Exact float32 value of stored weights [..., N, K] (K = 2 * packed width for e2m1)."""
    if recipe.weight_format == "native":
        return data.float()
    values = _decode(data, recipe.weight_format)
    n, k = values.shape[-2], values.shape[-1]
    rows, cols = _weight_blocks("dequantize_weight", n, k, recipe)
    expected = (*values.shape[:-2], n // rows, k // cols)
    if scales is None or tuple(scales.shape) != expected:
        got = None if scales is None else list(scales.shape)
        raise ValueError(f"dequantize_weight: scales must have shape {list(expected)}, got {got}")
    scale = _decode_scales(scales, recipe.scale_format)
    blocks = _split(values, rows, cols) * scale.unsqueeze(-1).unsqueeze(-3)
    return blocks.flatten(-2).flatten(-3, -2)


def quantize_weight_t(w: torch.Tensor, recipe: PrecisionRecipe) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights as a quantized dgrad GEMM reads them (recipe.grad_format): w [..., N, K] (the
    forward's layout, reducing over K) transposed to [..., K, N] and quantized by quantize_weight,
    i.e. in weight blocks along N, the dgrad's reduction dim. Square blocks (fp8) give the forward's
    blocks transposed, bit for bit; 1 x 32 blocks (mxfp8_mxfp4) other blocks than the forward's,
    a quantization of their own. dequantize_weight reads the result ([..., K, N])."""
    if w.dim() < 2:
        raise ValueError(f"quantize_weight_t: expected a tensor [..., N, K], got {list(w.shape)}")
    return quantize_weight(w.mT.contiguous(), recipe)


# ----------------------------------------------------------------------------- MX operands of fp8 MMA
#
# Hopper has no block-scaled MMA: its fp8 GEMMs apply one fp32 scale per 128-deep K block of
# each operand row (activations) or 128 x 128 block (weights). The mxfp8_mxfp4 recipe's 1 x 32
# power-of-two scales are folded into the elements for them: within a fold block, every element
# is re-expressed against the block's largest 1 x 32 scale 2^B, i.e. multiplied by 2^(b - B) (b its
# own 1 x 32 exponent) and rounded to e4m3, and the block's scale is 2^B. A power-of-two factor
# only moves the exponent, so the dequantized value is unchanged wherever the product stays on
# e4m3's grid; only elements that land below it round (to e4m3's subnormal steps, 2^-9 * 2^B):
# - weights (E2M1, magnitudes 0.5 to 6 of 2^b): exact while B - b <= 8;
# - activations (E4M3, 3 mantissa bits): exact while the product is a normal e4m3 number,
#   at least 2^-6 * 2^B, about 2^-14 of the block's largest element or more.
# A NaN 1 x 32 scale (a block that held NaN or Inf) makes its whole fold block NaN.

MX_FOLD_BLOCK = 128


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent as float32 for integer exponents in [-126, 127], from the bits (exact)."""
    return ((exponent.to(torch.int32) + _UE8M0_BIAS) << 23).view(torch.float32)


def _fold(values: torch.Tensor, exponents: torch.Tensor, block_max: torch.Tensor, nan_block: torch.Tensor):
    """values [..., 32-blocks, 32] (fp32, each block's own scale divided out) -> e4m3 values against
    block_max (broadcast to the 32-blocks), NaN where nan_block."""
    # below 2^-30 every element rounds to 0 on e4m3's grid (its smallest step is 2^-9): clamping
    # the shift there keeps 2**shift a normal float32
    shift = (exponents - block_max).clamp_min(-30)
    folded = values * _pow2(shift).unsqueeze(-1)
    folded = torch.where(nan_block.unsqueeze(-1), torch.full_like(folded, float("nan")), folded)
    return folded.to(torch.float8_e4m3fn)


def _fold_scales(block_max: torch.Tensor, nan_block: torch.Tensor) -> torch.Tensor:
    scale = ue8m0_to_float((block_max + _UE8M0_BIAS).to(torch.uint8))
    return torch.where(nan_block, torch.full_like(scale, float("nan")), scale)


def fold_mx_act(data: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 rows (e4m3 [..., K], ue8m0 1 x 32 scales [..., K/32]) -> the fp8 GEMMs' operand:
    e4m3 [..., K] and fp32 power-of-two scales [..., K/128], one per 1 x 128 fold block (the
    section comment above)."""
    if data.dtype != torch.float8_e4m3fn or scales.dtype != torch.uint8:
        raise ValueError(f"fold_mx_act: expected e4m3 data and uint8 scales, got {data.dtype} and {scales.dtype}")
    k = data.shape[-1]
    _check_last_dim("fold_mx_act", k, MX_FOLD_BLOCK, "fold")
    if tuple(scales.shape) != (*data.shape[:-1], k // 32):
        raise ValueError(f"fold_mx_act: scales must have shape {[*data.shape[:-1], k // 32]}, got {list(scales.shape)}")
    exponents = scales.to(torch.int32) - _UE8M0_BIAS  # [..., K/32]
    nan = scales == 255
    groups = exponents.unflatten(-1, (-1, 4))
    block_max = groups.amax(dim=-1)  # [..., K/128]
    nan_block = nan.unflatten(-1, (-1, 4)).any(dim=-1)
    values = data.float().unflatten(-1, (-1, 32))  # [..., K/32, 32]
    folded = _fold(values, exponents, block_max.repeat_interleave(4, dim=-1), nan_block.repeat_interleave(4, dim=-1))
    return folded.flatten(-2), _fold_scales(block_max, nan_block)


def fold_mx_weight(data: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 weights (packed E2M1 [..., N, K/2], ue8m0 1 x 32 scales [..., N, K/32]) -> the fp8
    GEMMs' operand: e4m3 [..., N, K] and fp32 power-of-two scales [..., N/128, K/128], one per
    128 x 128 fold block (the section comment above)."""
    if data.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"fold_mx_weight: expected uint8 data and scales, got {data.dtype} and {scales.dtype}")
    n, k = data.shape[-2], 2 * data.shape[-1]
    if n % MX_FOLD_BLOCK or k % MX_FOLD_BLOCK:
        raise ValueError(f"fold_mx_weight: N={n} and K={k} must be multiples of {MX_FOLD_BLOCK}")
    if tuple(scales.shape) != (*data.shape[:-1], k // 32):
        raise ValueError(
            f"fold_mx_weight: scales must have shape {[*data.shape[:-1], k // 32]}, got {list(scales.shape)}"
        )
    exponents = scales.to(torch.int32) - _UE8M0_BIAS  # [..., N, K/32]
    nan = scales == 255
    # [..., N/128, 128, K/128, 4] -> the fold block's largest exponent [..., N/128, K/128]
    split = exponents.unflatten(-1, (-1, 4)).unflatten(-3, (-1, MX_FOLD_BLOCK))
    block_max = split.amax(dim=(-3, -1))
    nan_block = nan.unflatten(-1, (-1, 4)).unflatten(-3, (-1, MX_FOLD_BLOCK)).any(dim=-1).any(dim=-2)
    per_row = block_max.repeat_interleave(MX_FOLD_BLOCK, dim=-2).repeat_interleave(4, dim=-1)  # [..., N, K/32]
    nan_row = nan_block.repeat_interleave(MX_FOLD_BLOCK, dim=-2).repeat_interleave(4, dim=-1)
    values = _e2m1_decode(unpack_fp4(data)).unflatten(-1, (-1, 32))  # [..., N, K/32, 32]
    folded = _fold(values, exponents, per_row, nan_row)
    return folded.flatten(-2), _fold_scales(block_max, nan_block)


MX_SHIFT_MAX = 15  # a 1 x 32 block this many binades or more below its fold block's largest: all e4m3 zeros


def mx_weight_shifts(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ue8m0 1 x 32 weight scales [..., N, K/32] -> what the expert GEMM that expands E2M1 in
    shared memory reads beside the packed weights: shifts uint8 [..., N/128, K/128, 128, 4], each
    row's four 1 x 32 blocks' B - b in its 128 x 128 fold block (B the block's largest exponent,
    clamped at MX_SHIFT_MAX: from 13 on every E2M1 magnitude times 2^-shift rounds to e4m3 zero),
    contiguous per (row block, K block); and fold_mx_weight's scales fp32 [..., N/128, K/128].
    Expanding element code c of a block with shift d to e4m3(E2M1_VALUES[c] * 2^-d) gives
    fold_mx_weight's e4m3 data."""
    if scales.dtype != torch.uint8 or scales.dim() < 2:
        raise ValueError(f"mx_weight_shifts: expected uint8 scales [..., N, K/32], got {scales.dtype}")
    n, k = scales.shape[-2], 32 * scales.shape[-1]
    if n % MX_FOLD_BLOCK or k % MX_FOLD_BLOCK:
        raise ValueError(f"mx_weight_shifts: N={n} and K={k} must be multiples of {MX_FOLD_BLOCK}")
    exponents = scales.to(torch.int32) - _UE8M0_BIAS
    split = exponents.unflatten(-1, (-1, 4)).unflatten(-3, (-1, MX_FOLD_BLOCK))  # [..., N/128, 128, K/128, 4]
    block_max = split.amax(dim=(-3, -1))
    nan_block = (scales == 255).unflatten(-1, (-1, 4)).unflatten(-3, (-1, MX_FOLD_BLOCK)).any(dim=-1).any(dim=-2)
    shifts = (block_max.unsqueeze(-2).unsqueeze(-1) - split).clamp(0, MX_SHIFT_MAX).to(torch.uint8)
    return shifts.transpose(-3, -2).contiguous(), _fold_scales(block_max, nan_block)
