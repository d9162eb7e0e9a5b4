"""Numerics of megamoe_train.quant: exact codes, tie rules, layouts and error bounds."""

import pytest
import torch

from megamoe_train.precision import RECIPES
from megamoe_train.quant import (
    E2M1_VALUES,
    dequantize_act,
    dequantize_grad,
    dequantize_tokens_t,
    dequantize_weight,
    fake_quantize_act,
    fake_quantize_grad,
    fake_quantize_tokens,
    float_to_ue8m0,
    pack_fp4,
    quantize_act,
    quantize_grad,
    quantize_tokens_t,
    quantize_weight,
    quantize_weight_t,
    ue8m0_to_float,
    unpack_fp4,
)

FP8, MX, BF16 = RECIPES["fp8"], RECIPES["mxfp8_mxfp4"], RECIPES["bf16"]
FP8_WGRAD = RECIPES["fp8_e4m3_wgrad"]  # fp8 with the wgrad operands quantized along the tokens


def randn(*shape, seed=0, spread=True):
    """Random values, never all zero; with spread, each run of 32 gets its own power-of-two
    magnitude (2**-12 .. 2**11) so blocks differ a lot."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if spread:
        exponents = torch.randint(-12, 12, (*shape[:-1], shape[-1] // 32), generator=g)
        x = x * torch.exp2(exponents.float()).repeat_interleave(32, -1)
    return x


def block_amax(x, block):
    return x.abs().unflatten(-1, (-1, block)).amax(-1)


def fp4_row(values):
    """One weight row of 32 values, padded with 6.0 so the block amax is 6 (scale 1)."""
    row = torch.full((32,), 6.0)
    row[: len(values)] = torch.tensor(values)
    return row.reshape(1, 32)


def fp4_codes(w):
    return unpack_fp4(quantize_weight(w, MX)[0])


# ----------------------------------------------------------------------------- E2M1


def test_every_e2m1_value_round_trips_exactly():
    values = list(E2M1_VALUES) + [-v for v in E2M1_VALUES]
    for exponent in (-20, -3, 0, 7):
        w = fp4_row(values) * 2.0**exponent
        data, scales = quantize_weight(w, MX)
        assert ue8m0_to_float(scales).item() == 2.0**exponent
        assert torch.equal(dequantize_weight(data, scales, MX), w)
    assert unpack_fp4(quantize_weight(fp4_row(values), MX)[0])[0, :16].tolist() == list(range(16))


def test_e2m1_ties_round_to_even_mantissa():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    w = fp4_row(ties + [-t for t in ties])
    got = dequantize_weight(*quantize_weight(w, MX), MX)[0, :14].tolist()
    assert got == expected + [-e for e in expected]
    # Just off a tie goes to the nearest value, whichever side is even.
    w = fp4_row([0.26, 0.74, 1.26, 1.74, 2.51, 3.49, 4.99, 5.01])
    got = dequantize_weight(*quantize_weight(w, MX), MX)[0, :8].tolist()
    assert got == [0.5, 0.5, 1.5, 1.5, 3.0, 3.0, 4.0, 6.0]


def test_fp4_packing_puts_even_element_in_low_nibble():
    w = fp4_row([0.5, -6.0, 0.0, 3.0])  # codes 1, 15, 0, 5
    data, _ = quantize_weight(w, MX)
    assert data.dtype == torch.uint8 and data.shape == (1, 16)
    assert data[0, :2].tolist() == [0xF1, 0x50]
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert torch.equal(packed & 0xF, codes[..., 0::2]) and torch.equal(packed >> 4, codes[..., 1::2])
    assert torch.equal(unpack_fp4(packed), codes)


def test_fp4_sign_is_kept_for_values_rounding_to_zero():
    codes = fp4_codes(fp4_row([0.1, -0.1]))
    assert codes[0, :2].tolist() == [0, 8]


# ----------------------------------------------------------------------------- ue8m0


def test_ue8m0_encoding_round_trips():
    biased = torch.arange(255, dtype=torch.uint8)
    scales = ue8m0_to_float(biased)
    assert torch.equal(scales, torch.exp2(torch.arange(255, dtype=torch.float64) - 127).float())
    assert torch.equal(float_to_ue8m0(scales), biased)
    assert torch.isnan(ue8m0_to_float(torch.tensor([255], dtype=torch.uint8))).all()
    # Not a power of two: rounds up, so a scale never shrinks.
    assert float_to_ue8m0(torch.tensor([3.0, 0.3])).tolist() == [129, 126]


def _is_pow2(t):
    mantissa, _ = torch.frexp(t)
    return bool((mantissa == 0.5).all())


@pytest.mark.parametrize("magnitude", [2.0**-100, 1e-9, 1.0, 1e9, 1e30])
def test_ue8m0_scales_are_tightest_power_of_two_without_overflow(magnitude):
    x = randn(4, 256, seed=2) * magnitude
    # Values just above and exactly at the boundaries where the exponent steps up.
    x[0, :4] = torch.tensor([448.0, -448.0 * (1 + 2**-23), 448.0 * (1 - 2**-24), 224.0]) * magnitude
    data, scales = quantize_act(x, MX)
    scale = ue8m0_to_float(scales)
    assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8 and scales.shape == (4, 8)
    assert _is_pow2(scale)
    decoded = data.float()
    assert not torch.isnan(decoded).any() and decoded.abs().max() <= 448
    ratio = block_amax(x, 32) / scale
    assert ((ratio > 224) & (ratio <= 448)).all(), "scale must be the smallest power of two that fits"

    w = x.reshape(8, 128) / 448 * 6
    data, scales = quantize_weight(w, MX)
    ratio = block_amax(w, 32) / ue8m0_to_float(scales)
    assert _is_pow2(ue8m0_to_float(scales)) and ((ratio > 3) & (ratio <= 6)).all()


# ----------------------------------------------------------------------------- error bounds


def _within(err, x, rel, abs_):
    return bool((err <= x.abs() * rel + abs_ + x.abs() * 2**-22).all())


def test_fp8_act_scales_and_error_bound():
    x = randn(2, 3, 512, seed=3)
    data, scales = quantize_act(x, FP8)
    amax = block_amax(x, 128).clamp_min(1e-4)
    assert scales.dtype == torch.float32 and scales.shape == (2, 3, 4)
    assert torch.equal(scales, amax / 448)
    assert torch.equal(block_amax(data.float(), 128), torch.full_like(amax, 448.0))
    # e4m3: half an ulp is 2**-4 of the value; subnormals are spaced 2**-9 * scale.
    expand = lambda s: s.repeat_interleave(128, -1)  # noqa: E731
    err = (dequantize_act(data, scales, FP8) - x).abs()
    assert _within(err, x, 2**-4, expand(amax / 448) * 2**-10)
    # The bound is tight enough to catch a wrong scale.
    wrong = (dequantize_act(data, scales * 1.25, FP8) - x).abs()
    assert not _within(wrong, x, 2**-4, expand(amax / 448) * 2**-10)


def test_mx_act_error_bound():
    x = randn(4, 256, seed=4)
    data, scales = quantize_act(x, MX)
    scale = ue8m0_to_float(scales).repeat_interleave(32, -1)
    err = (dequantize_act(data, scales, MX) - x).abs()
    assert _within(err, x, 2**-4, scale * 2**-10)
    assert not _within((dequantize_act(data, scales + 1, MX) - x).abs(), x, 2**-4, scale * 2**-10)


def test_fp8_weight_blocks_and_error_bound():
    w = randn(2, 256, 384, seed=5, spread=False)
    w[0, 128:, :128] *= 1000  # blocks of very different magnitude
    data, scales = quantize_weight(w, FP8)
    assert data.dtype == torch.float8_e4m3fn and data.shape == w.shape
    assert scales.dtype == torch.float32 and scales.shape == (2, 2, 3)
    amax = w.abs().unflatten(-1, (3, 128)).unflatten(-3, (2, 128)).amax(dim=(-3, -1))
    assert torch.equal(scales, amax / 448)
    scale = scales.repeat_interleave(128, -2).repeat_interleave(128, -1)
    err = (dequantize_weight(data, scales, FP8) - w).abs()
    assert _within(err, w, 2**-4, scale * 2**-10)


def test_fp4_weight_error_bound():
    w = randn(3, 16, 128, seed=6)
    data, scales = quantize_weight(w, MX)
    assert data.shape == (3, 16, 64) and scales.shape == (3, 16, 4) and scales.dtype == torch.uint8
    scale = ue8m0_to_float(scales).repeat_interleave(32, -1)
    err = (dequantize_weight(data, scales, MX) - w).abs()
    # E2M1 has one mantissa bit (half ulp = 1/4 of the value); subnormal step is 0.5 * scale.
    assert _within(err, w, 2**-2, scale * 2**-2)


# ----------------------------------------------------------------------------- idempotence


def test_fp8_requantizing_dequantized_gives_identical_bits():
    x = randn(3, 512, seed=7)
    data, scales = quantize_act(x, FP8)
    data2, scales2 = quantize_act(dequantize_act(data, scales, FP8), FP8)
    assert torch.equal(data.view(torch.uint8), data2.view(torch.uint8)) and torch.equal(scales, scales2)
    w = randn(256, 256, seed=8)
    data, scales = quantize_weight(w, FP8)
    data2, scales2 = quantize_weight(dequantize_weight(data, scales, FP8), FP8)
    assert torch.equal(data.view(torch.uint8), data2.view(torch.uint8)) and torch.equal(scales, scales2)


def test_ue8m0_requantizing_is_a_projection():
    """Re-quantizing a dequantized tensor gives the same values, and the same bits once stable.

    Bits can differ on the first pass: a block whose largest element rounds down onto half
    the format's max (224 for e4m3, 3 for e2m1) gets half the scale and doubled codes, which
    decode to identical values. From then on the bits are fixed.
    """
    x = randn(4, 512, seed=9)
    y = fake_quantize_act(x, MX)
    data, scales = quantize_act(y, MX)
    assert torch.equal(dequantize_act(data, scales, MX), y)
    data2, scales2 = quantize_act(dequantize_act(data, scales, MX), MX)
    assert torch.equal(data.view(torch.uint8), data2.view(torch.uint8)) and torch.equal(scales, scales2)

    # The first-pass case: block max 225 -> scale 1, code 224 -> requantized: scale 1/2, code 448.
    z = torch.zeros(1, 32)
    z[0, 0] = 225.0
    data, scales = quantize_act(z, MX)
    data2, scales2 = quantize_act(dequantize_act(data, scales, MX), MX)
    assert (scales.item(), data[0, 0].item(), scales2.item(), data2[0, 0].item()) == (127, 224.0, 126, 448.0)

    w = randn(16, 256, seed=10)
    v = dequantize_weight(*quantize_weight(w, MX), MX)
    data, scales = quantize_weight(v, MX)
    assert torch.equal(dequantize_weight(data, scales, MX), v)
    assert torch.equal(quantize_weight(dequantize_weight(data, scales, MX), MX)[0], data)


# ----------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("recipe", [FP8, MX], ids=lambda r: r.name)
def test_zero_blocks_give_zeros(recipe):
    x = randn(2, 256, seed=11)
    x[0, :128] = 0
    x[1, :128] = 1e-40  # subnormal blocks: the clamped scale must not blow up either
    y = fake_quantize_act(x, recipe)
    assert not torch.isnan(y).any() and (y[0, :128] == 0).all()
    assert ((y[1, :128] - x[1, :128]).abs() <= 1e-40).all()
    w = randn(256, 256, seed=12)
    w[:128, :128] = 0
    v = dequantize_weight(*quantize_weight(w, recipe), recipe)
    assert not torch.isnan(v).any() and (v[:128, :128] == 0).all()


def test_float_to_ue8m0_non_finite_is_nan_code():
    codes = float_to_ue8m0(torch.tensor([float("nan"), float("inf"), 1.0]))
    assert codes.tolist() == [255, 255, 127]  # NaN / Inf read as 1.0 (127) before


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("recipe", [FP8, MX], ids=lambda r: r.name)
def test_non_finite_blocks_become_nan_not_finite_values(recipe, bad):
    """A NaN or Inf element makes its whole block NaN (OCP MX: the block's scale is NaN), as the
    fp32 scales do; it must never come back as finite values (NaN weights or activations would
    then be hidden from the loss). The other blocks are untouched."""
    x = randn(2, 256, seed=13)
    x[0, 5] = bad
    y = fake_quantize_act(x, recipe)
    assert torch.isnan(y[0, : recipe.act_block]).all()
    assert torch.equal(y[:, 128:], fake_quantize_act(x[:, 128:], recipe)) and not torch.isnan(y[1]).any()
    w = randn(256, 256, seed=14)
    w[3, 7] = bad
    rows, cols = recipe.weight_block
    v = dequantize_weight(*quantize_weight(w, recipe), recipe)
    assert torch.isnan(v[3 // rows * rows : 3 // rows * rows + rows, :cols]).all()
    assert torch.isnan(v).sum() == rows * cols


def test_native_recipe_passes_through():
    x = randn(2, 40, seed=13, spread=False).bfloat16()
    data, scales = quantize_act(x, BF16)
    assert data is x and scales is None
    assert fake_quantize_act(x, BF16).dtype == torch.float32
    data, scales = quantize_weight(x, BF16)
    assert data is x and scales is None and torch.equal(dequantize_weight(data, None, BF16), x.float())


@pytest.mark.parametrize("recipe", [FP8, MX], ids=lambda r: r.name)
def test_leading_dims_and_low_precision_input(recipe):
    x = randn(2, 3, 4, 256, seed=14)
    data, scales = quantize_act(x, recipe)
    flat_data, flat_scales = quantize_act(x.reshape(-1, 256), recipe)
    assert torch.equal(data.reshape(-1, 256).view(torch.uint8), flat_data.view(torch.uint8))
    assert torch.equal(scales.reshape(flat_scales.shape), flat_scales)
    xb = x.bfloat16()
    assert torch.equal(fake_quantize_act(xb, recipe), fake_quantize_act(xb.float(), recipe))
    assert fake_quantize_act(xb, recipe).dtype == torch.float32


def test_shape_errors():
    with pytest.raises(ValueError, match="multiple of"):
        quantize_act(torch.ones(2, 100), FP8)
    with pytest.raises(ValueError, match="multiple of"):
        quantize_act(torch.ones(2, 48), MX)
    with pytest.raises(ValueError, match="row dim 100"):
        quantize_weight(torch.ones(100, 128), FP8)
    with pytest.raises(ValueError, match="last dim 48"):
        quantize_weight(torch.ones(4, 48), MX)
    with pytest.raises(ValueError, match="scales must have shape"):
        dequantize_act(quantize_act(torch.ones(2, 256), FP8)[0], torch.ones(2, 3), FP8)
    with pytest.raises(ValueError, match="scales must have shape"):
        dequantize_weight(quantize_weight(torch.ones(4, 64), MX)[0], None, MX)
    with pytest.raises(ValueError, match="floating"):
        quantize_act(torch.ones(2, 128, dtype=torch.int32), FP8)


# ----------------------------------------------------------------------------- gradients


def test_grad_format_per_recipe():
    assert FP8.grad_format == "e4m3" and FP8.quantized_dgrad
    assert MX.grad_format == "e4m3" and MX.quantized_dgrad
    assert not BF16.quantized_dgrad


def test_fp8_gradients_quantize_like_activations():
    g = randn(3, 5, 256, seed=11)
    data, scales = quantize_grad(g, FP8)
    ref_data, ref_scales = quantize_act(g, FP8)
    assert data.dtype == torch.float8_e4m3fn and scales.shape == (3, 5, 2)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8)) and torch.equal(scales, ref_scales)
    assert torch.equal(fake_quantize_grad(g, FP8), dequantize_grad(data, scales, FP8))
    assert torch.equal(fake_quantize_grad(g.bfloat16(), FP8), fake_quantize_act(g.bfloat16(), FP8))


def test_mx_gradients_quantize_like_mx_activations():
    """mxfp8_mxfp4's dgrads read MXFP8 gradients: e4m3 with ue8m0 scales in 1x32 blocks along K."""
    g = randn(3, 5, 96, seed=13)  # every 1x32 block of its own magnitude
    data, scales = quantize_grad(g, MX)
    ref_data, ref_scales = quantize_act(g, MX)
    assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8 and scales.shape == (3, 5, 3)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8)) and torch.equal(scales, ref_scales)
    assert torch.equal(fake_quantize_grad(g, MX), dequantize_grad(data, scales, MX))
    assert torch.equal(fake_quantize_grad(g.bfloat16(), MX), fake_quantize_act(g.bfloat16(), MX))


def test_native_gradients_pass_through():
    g = randn(4, 64, seed=12)
    data, scales = quantize_grad(g, BF16)
    assert data is g and scales is None
    assert torch.equal(fake_quantize_grad(g, BF16), g)


def test_gradient_shape_errors():
    with pytest.raises(
        ValueError, match="quantize_grad: last dim 100 is not a multiple of the 'fp8' gradient block 128"
    ):
        quantize_grad(torch.randn(2, 100), FP8)
    data, scales = quantize_grad(randn(2, 256), FP8)
    with pytest.raises(ValueError, match="dequantize_grad: scales must have shape"):
        dequantize_grad(data, scales[:, :1], FP8)
    with pytest.raises(ValueError, match="quantized gradients need activation blocks"):
        RECIPES["fp8"].__class__("bad", "native", 0, "e4m3", (128, 128), "fp32", 128, grad_format="e4m3")
    with pytest.raises(ValueError, match="the 'mxfp8_mxfp4' gradient block 32"):
        quantize_grad(torch.randn(2, 48), MX)


# ----------------------------------------------------------------------------- the dgrads' weights


def test_dgrad_weights_of_square_blocks_are_the_forward_blocks_transposed():
    w = randn(2, 256, 384, seed=14)
    w[1, :128, 128:256] *= 40  # one block far larger than the rest
    data_t, scales_t = quantize_weight_t(w, FP8)
    data, scales = quantize_weight(w, FP8)
    assert data_t.shape == (2, 384, 256) and scales_t.shape == (2, 3, 2)
    assert torch.equal(data_t.view(torch.uint8), data.mT.contiguous().view(torch.uint8))
    assert torch.equal(scales_t, scales.mT)


def test_mx_dgrad_weights_are_blocked_along_the_other_axis():
    """E2M1 1x32 blocks along N, the dgrad's reduction dim: a quantization of its own. A row of
    large values sets the scales of its own blocks in the forward's copy, but in the transposed
    copy those of every column's block of 32 rows that holds it, whose other rows come out
    coarser there."""
    w = randn(64, 96, seed=15, spread=False) * 0.01
    w[5] *= 1000  # one large row
    data_t, scales_t = quantize_weight_t(w, MX)
    assert data_t.dtype == torch.uint8 and data_t.shape == (96, 32) and scales_t.shape == (96, 2)
    data, scales = quantize_weight(w, MX)
    assert (scales[5] > scales[4]).all()  # the forward's: row 5's own blocks
    assert (scales_t[:, 0] > scales_t[:, 1]).all()  # the dgrad's: rows 0..31 of every column
    back, back_fwd = dequantize_weight(data_t, scales_t, MX), dequantize_weight(data, scales, MX).mT
    assert torch.equal(back, dequantize_weight(*quantize_weight(w.mT.contiguous(), MX), MX))
    assert ((back - w.mT).abs() <= ue8m0_to_float(scales_t).repeat_interleave(32, -1)).all()
    others = [r for r in range(32) if r != 5]  # ~1000x below row 5: zeros in the dgrad's copy
    assert not back[:, others].any()
    assert (back_fwd - w.mT)[:, others].abs().sum() < 0.2 * w.mT[:, others].abs().sum()
    assert torch.equal(quantize_weight_t(w, BF16)[0], w.mT) and quantize_weight_t(w, BF16)[1] is None
    with pytest.raises(ValueError, match="quantize_weight_t: expected a tensor"):
        quantize_weight_t(torch.ones(32), MX)
    with pytest.raises(ValueError, match="last dim 48"):
        quantize_weight_t(torch.ones(32, 48).mT, MX)


# ----------------------------------------------------------------------------- wgrad operands (token blocks)


def e4m3_bits(t):
    return t.contiguous().view(torch.uint8)


def test_wgrad_format_per_recipe():
    assert not FP8.quantized_wgrad and RECIPES["fp8_e4m3_wgrad"].quantized_wgrad
    assert not BF16.quantized_wgrad and not MX.quantized_wgrad


def test_tokens_t_layout_and_rounding_rule():
    """[P, C] -> data [C, P] (tokens contiguous), scales [C, P/128]: per column, blocks of 128 rows,
    scale = max(amax, 1e-4) / 448, the activation quantizer's rounding of the transpose."""
    values = randn(256, 384, seed=20).t().contiguous()  # [P=384, C=256], magnitudes spread along P
    data, scales = quantize_tokens_t(values, FP8_WGRAD)
    assert data.dtype == torch.float8_e4m3fn and data.shape == (256, 384) and data.is_contiguous()
    assert scales.dtype == torch.float32 and scales.shape == (256, 3) and scales.is_contiguous()
    amax = values.abs().unflatten(0, (3, 128)).amax(1).t()  # [C, P/128]
    assert torch.equal(scales, amax.clamp_min(1e-4) / torch.full_like(amax, 448.0))
    ref_data, ref_scales = quantize_act(values.t().contiguous(), FP8)
    assert torch.equal(e4m3_bits(data), e4m3_bits(ref_data)) and torch.equal(scales, ref_scales)
    deq = dequantize_tokens_t(data, scales, FP8_WGRAD)
    assert torch.equal(deq, dequantize_act(ref_data, ref_scales, FP8))
    # the e4m3 error bound: 2^-4 relative for normals, half a subnormal step (2^-10 * scale) below
    step = scales.repeat_interleave(128, 1)
    assert ((deq - values.t()).abs() <= values.t().abs() * 2**-4 + step * 2**-10).all()


def test_tokens_t_one_large_value_sets_only_its_block():
    g = torch.Generator().manual_seed(21)
    values = torch.randn(256, 128, generator=g)
    values[130, 5] = 1000.0
    data, scales = quantize_tokens_t(values, FP8_WGRAD)
    assert scales[5, 1] == torch.tensor(1000.0) / 448.0 and data[5, 130].float() == 448.0
    clean = values.clone()
    clean[130, 5] = 0.0
    clean_data, clean_scales = quantize_tokens_t(clean, FP8_WGRAD)
    changed = (scales != clean_scales).nonzero().tolist()
    assert changed == [[5, 1]], changed  # only that column's block
    same = torch.ones(128, 256, dtype=torch.bool)
    same[5, 128:] = False
    assert torch.equal(e4m3_bits(data)[same], e4m3_bits(clean_data)[same])
    # the rest of that block is rounded on the large scale: coarser, still within the e4m3 bound
    block = dequantize_tokens_t(data, scales, FP8_WGRAD)[5, 128:]
    assert ((block - values[128:, 5]).abs() <= values[128:, 5].abs() * 2**-4 + scales[5, 1] * 2**-10).all()


def test_tokens_t_zero_rows_and_blocks():
    g = torch.Generator().manual_seed(22)
    values = torch.randn(384, 256, generator=g)
    values[100:128] = 0  # padding rows at the end of an expert's first block
    values[256:] = 0  # a whole block of zeros
    data, scales = quantize_tokens_t(values, FP8_WGRAD)
    assert (e4m3_bits(data)[:, 100:128] == 0).all() and (e4m3_bits(data)[:, 256:] == 0).all()
    assert torch.equal(scales[:, 2], torch.full((256,), 1e-4) / torch.full((256,), 448.0))
    assert torch.equal(scales[:, 0], values[:128].abs().amax(0) / 448.0)  # zero rows do not touch the scale
    # one expert's 100 rows: blocks from its first row, the last one padded with zero rows
    assert torch.equal(
        fake_quantize_tokens(values[:100], FP8_WGRAD), dequantize_tokens_t(data, scales, FP8_WGRAD).t()[:100]
    )
    assert torch.equal(
        fake_quantize_tokens(values[:300], FP8_WGRAD), dequantize_tokens_t(data, scales, FP8_WGRAD).t()[:300]
    )


def test_tokens_t_native_and_errors():
    v = randn(8, 64, seed=23)
    data, scales = quantize_tokens_t(v, BF16)
    assert torch.equal(data, v.t()) and scales is None and torch.equal(fake_quantize_tokens(v, MX), v)
    with pytest.raises(
        ValueError, match="quantize_tokens_t: 200 rows are not a multiple of the 'fp8_e4m3_wgrad' wgrad token block 128"
    ):
        quantize_tokens_t(torch.randn(200, 128), FP8_WGRAD)
    with pytest.raises(ValueError, match=r"quantize_tokens_t: expected a floating tensor \[P, C\]"):
        quantize_tokens_t(torch.randn(2, 128, 4), FP8_WGRAD)
    data, scales = quantize_tokens_t(torch.randn(256, 4), FP8_WGRAD)
    with pytest.raises(ValueError, match="dequantize_tokens_t: scales must have shape"):
        dequantize_tokens_t(data, scales[:, :1], FP8_WGRAD)
    with pytest.raises(ValueError, match="a quantized wgrad needs activation blocks"):
        RECIPES["fp8"].__class__("bad", "native", 0, "native", (0, 0), "none", 8, wgrad_format="e4m3")


def test_mx_weight_shifts_expand_to_fold_mx_weight():
    """The shared-memory expansion (a table per shift: E2M1 magnitude times 2^-shift as e4m3, the
    code's sign on top) of mx_weight_shifts' shifts gives fold_mx_weight's bits, also where 1x32
    scales lie more binades apart than e4m3 holds exactly (clamped shifts, rounded and zero
    elements), and the two give the same block scales."""
    from megamoe_train.quant import fold_mx_weight, mx_weight_shifts

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(2, 256, 384, generator=gen)
    w *= torch.exp2(torch.randint(-9, 6, (2, 256, 1), generator=gen).float())
    w *= torch.exp2(torch.randint(-4, 4, (2, 1, 12), generator=gen).float()).repeat_interleave(32, -1)
    w[0, 5, :32] = 0.0  # an all-zero 1x32 block
    data, scales = quantize_weight(w, MX)
    folded, folded_scales = fold_mx_weight(data, scales)
    shifts, block_scales = mx_weight_shifts(scales)
    assert shifts.shape == (2, 2, 3, 128, 4) and int(shifts.max()) == 15
    assert torch.equal(block_scales, folded_scales)
    table = torch.stack(
        [(torch.tensor(E2M1_VALUES) * 2.0**-d).to(torch.float8_e4m3fn).view(torch.uint8) for d in range(16)]
    )
    codes = unpack_fp4(data).long()
    row_shifts = shifts.transpose(-3, -2).reshape(2, 256, 12).repeat_interleave(32, -1).long()
    expanded = table[row_shifts, codes & 7] | ((codes & 8) << 4).to(torch.uint8)
    assert torch.equal(expanded, folded.view(torch.uint8))
    # the fold's values: E2M1's where the shift is at most 8, a little off (e4m3's subnormal grid,
    # at most 2^-10 of the block's scale) where it is more
    value = folded.float().unflatten(-1, (-1, 128)).unflatten(-3, (-1, 128)) * folded_scales[:, :, None, :, None]
    exact = dequantize_weight(data, scales, MX)
    error = (value.flatten(-2).flatten(-3, -2) - exact).abs()
    assert error.max() > 0
    assert (error <= block_scales.repeat_interleave(128, -2).repeat_interleave(128, -1) * 2.0**-10).all()


def test_fold_mx_act_keeps_the_values_on_e4m3s_normal_grid():
    """fold_mx_act re-expresses MXFP8 rows against each 1x128 block's largest 1x32 scale 2^A: the
    dequantized values are unchanged wherever the folded element is a normal e4m3 number before
    rounding (at least 2^-6 of 2^A), within half of e4m3's smallest step (2^-10 * 2^A) elsewhere; a NaN 1x32 block
    makes its 1x128 block NaN."""
    from megamoe_train.quant import fold_mx_act

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(37, 384, generator=gen) * torch.exp2(
        torch.randint(-12, 4, (37, 12), generator=gen).float()
    ).repeat_interleave(32, -1)
    x[3, 40] = float("nan")
    data, scales = quantize_act(x, MX)
    folded, folded_scales = fold_mx_act(data, scales)
    assert folded.dtype == torch.float8_e4m3fn and folded_scales.shape == (37, 3)
    assert torch.isnan(folded_scales[3, 0]) and not torch.isnan(folded_scales[3, 1:]).any()
    value = (folded.float().unflatten(-1, (-1, 128)) * folded_scales[..., None]).flatten(-2)
    exact = dequantize_act(data, scales, MX)
    scale = folded_scales.repeat_interleave(128, -1)
    ok = ~torch.isnan(scale)
    normal = (exact / scale).abs() >= 2.0**-6  # before the fold's rounding
    assert torch.equal(value[ok & normal], exact[ok & normal])
    assert ((value - exact).abs()[ok] <= scale[ok] * 2.0**-10).all()
    assert (value[ok] != exact[ok]).any()  # the spread reaches e4m3's subnormals
