"""Expert weight transforms: gate/up interleave, kernel layouts per recipe, and the cache."""

import gc

import pytest
import torch

from megamoe_train.config import MegaMoEConfig
from megamoe_train.precision import RECIPES
from megamoe_train.quant import (
    dequantize_weight,
    fold_mx_weight,
    mx_weight_shifts,
    quantize_weight,
    quantize_weight_t,
    ue8m0_to_float,
)
from megamoe_train.weights import (
    _CACHE,
    ExpertWeights,
    clear_weight_cache,
    deinterleave_gate_up,
    interleave_gate_up,
    transform_weights,
)

E, H, I = 2, 256, 256  # smallest sizes every recipe accepts (fp8 needs multiples of 128)


def config(recipe="bf16", dtype=torch.bfloat16):
    return MegaMoEConfig(
        num_experts=E, hidden=H, intermediate=I, topk=1, num_max_tokens_per_rank=8, recipe=recipe, dtype=dtype
    )


def master_weights(seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, 2 * I, H, generator=g) * 0.05
    w2 = torch.randn(E, H, I, generator=g) * 0.05
    if requires_grad:
        return torch.nn.Parameter(w1), torch.nn.Parameter(w2)
    return w1, w2


@pytest.fixture(autouse=True)
def empty_cache():
    clear_weight_cache()
    yield
    clear_weight_cache()


# ----------------------------------------------------------------------------- interleave


def test_interleave_order_and_inverse():
    g = torch.Generator().manual_seed(1)
    t = torch.randn(3, 2 * 32, 5, generator=g)
    gate, up = t[:, :32], t[:, 32:]
    out = interleave_gate_up(t, 8)
    assert torch.equal(out[:, 0:8], gate[:, 0:8])
    assert torch.equal(out[:, 8:16], up[:, 0:8])
    assert torch.equal(out[:, 16:24], gate[:, 8:16])
    assert torch.equal(out[:, 56:64], up[:, 24:32])
    assert torch.equal(deinterleave_gate_up(out, 8), t)
    # Any dim, and chunk == I is the identity.
    assert torch.equal(deinterleave_gate_up(interleave_gate_up(t, 4, dim=1), 4, dim=1), t)
    u = torch.randn(2 * 6, 3, generator=g)
    assert torch.equal(interleave_gate_up(u, 3, dim=0)[3:6], u[6:9])
    assert torch.equal(interleave_gate_up(t, 32), t)


def test_interleave_rejects_bad_sizes():
    with pytest.raises(ValueError, match="multiple of chunk=8"):
        interleave_gate_up(torch.zeros(2 * 12, 4), 8)
    with pytest.raises(ValueError, match="multiple of chunk"):
        deinterleave_gate_up(torch.zeros(7, 4), 1)
    with pytest.raises(ValueError, match="chunk"):
        interleave_gate_up(torch.zeros(16, 4), 0)


# ----------------------------------------------------------------------------- layouts


def test_bf16_transform_reads_master_weights_in_place():
    """Native weights stay in master order ([gate; up], chunk == I); the result is the caller's
    storage when the dtype already matches (no copy per weight update), a cast otherwise."""
    w1, w2 = master_weights()
    ew = transform_weights(w1, w2, config(dtype=torch.float32))
    assert isinstance(ew, ExpertWeights) and ew.recipe == "bf16" and ew.chunk == I
    assert ew.w1_scales is None and ew.w2_scales is None
    assert ew.w1.data_ptr() == w1.data_ptr() and ew.w2.data_ptr() == w2.data_ptr(), "must read the parameters in place"
    assert torch.equal(ew.dequantize_w1(), w1) and torch.equal(ew.dequantize_w2(), w2)
    assert ew.compute_copies(torch.float32)[0].data_ptr() == w1.data_ptr()
    w1.data.mul_(2)  # a write through .data (mixed-precision optimizers): seen, nothing cached
    assert torch.equal(transform_weights(w1, w2, config(dtype=torch.float32)).w1, w1)

    ew = transform_weights(w1, w2, config(dtype=torch.bfloat16))
    assert ew.w1.dtype == torch.bfloat16 and ew.w2.dtype == torch.bfloat16 and ew.chunk == I
    assert torch.equal(ew.w1, w1.bfloat16())


def test_fp8_transform_layout():
    w1, w2 = master_weights(seed=2)
    w1[0, I : I + 128] *= 100  # one up-block far larger than the rest
    ew = transform_weights(w1, w2, config("fp8"))
    assert ew.chunk == 128
    assert ew.w1.dtype == torch.float8_e4m3fn and ew.w1.shape == (E, 2 * I, H)
    assert ew.w1_scales.dtype == torch.float32 and ew.w1_scales.shape == (E, 2 * I // 128, H // 128)
    assert ew.w2.shape == (E, H, I) and ew.w2_scales.shape == (E, H // 128, I // 128)
    # Scales are the master-order scales, one 128-row block per chunk, interleaved.
    ref_data, ref_scales = quantize_weight(w1, RECIPES["fp8"])
    assert torch.equal(deinterleave_gate_up(ew.w1_scales, 1), ref_scales)
    assert torch.equal(ew.w1_scales[0, 1], ref_scales[0, I // 128])  # chunk 1 = up rows 0:128
    assert torch.equal(deinterleave_gate_up(ew.w1.view(torch.uint8), 128), ref_data.view(torch.uint8))
    for got, want in ((deinterleave_gate_up(ew.dequantize_w1(), 128), w1), (ew.dequantize_w2(), w2)):
        assert ((got - want).abs() <= want.abs() * 2**-4 + want.abs().amax() * 2**-10).all()


def test_fp8_dgrad_operands_are_the_forward_blocks_transposed():
    """w1_t / w2_t (the fp8 dgrad GEMMs' B operands): the forward's quantized weights in master
    order, transposed with their 128x128 scale blocks (H != I so a wrong transpose shows)."""
    hidden, inter = 384, 256
    g = torch.Generator().manual_seed(5)
    w1 = torch.randn(E, 2 * inter, hidden, generator=g) * 0.05
    w2 = torch.randn(E, hidden, inter, generator=g) * 0.05
    w1[1, inter : inter + 128, 128:256] *= 50  # one up-block far larger than the rest
    cfg = MegaMoEConfig(
        num_experts=E, hidden=hidden, intermediate=inter, topk=1, num_max_tokens_per_rank=8, recipe="fp8"
    )
    ew = transform_weights(w1, w2, cfg)
    fp8 = RECIPES["fp8"]
    assert ew.w1_t.dtype == torch.float8_e4m3fn and ew.w1_t.shape == (E, hidden, 2 * inter) and ew.w1_t.is_contiguous()
    assert ew.w1_t_scales.dtype == torch.float32 and ew.w1_t_scales.shape == (E, hidden // 128, 2 * inter // 128)
    assert ew.w2_t.dtype == torch.float8_e4m3fn and ew.w2_t.shape == (E, inter, hidden) and ew.w2_t.is_contiguous()
    assert ew.w2_t_scales.shape == (E, inter // 128, hidden // 128)
    # Same values as the forward's weights, read transposed: fc1 in master order [gate; up].
    w1_master = deinterleave_gate_up(ew.dequantize_w1(), ew.chunk)
    assert torch.equal(dequantize_weight(ew.w1_t, ew.w1_t_scales, fp8), w1_master.transpose(1, 2))
    assert torch.equal(dequantize_weight(ew.w2_t, ew.w2_t_scales, fp8), ew.dequantize_w2().transpose(1, 2))
    assert torch.equal(ew.w1_t_scales[1, 1, inter // 128], ew.w1_t_scales[1, 1].amax())  # the scaled-up block
    # Quantizing the transposed master weights gives the same bits (square blocks).
    data, scales = quantize_weight(w1.transpose(1, 2), fp8)
    assert torch.equal(data.view(torch.uint8), ew.w1_t.view(torch.uint8)) and torch.equal(scales, ew.w1_t_scales)


def test_no_dgrad_operands_without_quantized_dgrad():
    ew = transform_weights(*master_weights(), config("bf16"))
    assert ew.w1_t is None and ew.w1_t_scales is None and ew.w2_t is None and ew.w2_t_scales is None
    with pytest.raises(ValueError, match="recipe 'bf16' has no quantized dgrad, so no w1_t"):
        ew.dequantize_w1_t()
    with pytest.raises(ValueError, match="no w1_t"):
        ew.mma_dgrad_operands()


def test_mxfp4_dgrad_operands_are_the_transposed_masters_quantized():
    """w1_t / w2_t of mxfp8_mxfp4: quant.quantize_weight_t of the master weights, fc1 in master
    order (its columns [gate | up], as dH's), packed E2M1 with 1x32 ue8m0 blocks along 2I and H
    (H != I so a wrong transpose shows); what the GPU executor's dgrads read of them: the shifts
    and block scales of the expert GEMM (made once), or the fold to e4m3 (made once)."""
    hidden, inter = 384, 256
    g = torch.Generator().manual_seed(6)
    w1 = torch.randn(E, 2 * inter, hidden, generator=g) * 0.05
    w2 = torch.randn(E, hidden, inter, generator=g) * 0.05
    w1[1, inter + 3] = 4.0  # one up row far larger than the rest
    cfg = MegaMoEConfig(
        num_experts=E, hidden=hidden, intermediate=inter, topk=1, num_max_tokens_per_rank=8, recipe="mxfp8_mxfp4"
    )
    mx = RECIPES["mxfp8_mxfp4"]
    ew = transform_weights(w1, w2, cfg)
    assert ew.w1_t.dtype == torch.uint8 and ew.w1_t.shape == (E, hidden, inter) and ew.w1_t.is_contiguous()
    assert ew.w1_t_scales.dtype == torch.uint8 and ew.w1_t_scales.shape == (E, hidden, 2 * inter // 32)
    assert ew.w2_t.shape == (E, inter, hidden // 2) and ew.w2_t_scales.shape == (E, inter, hidden // 32)
    for (data, scales), master in (((ew.w1_t, ew.w1_t_scales), w1), ((ew.w2_t, ew.w2_t_scales), w2)):
        want_data, want_scales = quantize_weight_t(master, mx)
        assert torch.equal(data, want_data) and torch.equal(scales, want_scales)
    # the large up row lands in column inter + 3 of w1_t: the scales of its 1x32 blocks there
    big = ew.w1_t_scales[1, :, (inter + 3) // 32]
    assert (big > ew.w1_t_scales[1, :, (inter + 3) // 32 - 1]).all() and (big > ew.w1_t_scales[0, :, 8]).all()
    value = ew.dequantize_w1_t()
    assert value.shape == (E, hidden, 2 * inter)
    scale = ue8m0_to_float(ew.w1_t_scales).repeat_interleave(32, -1)
    assert ((value - w1.mT).abs() <= scale).all()  # within one E2M1 step of its own block
    shifts = ew.mx_dgrad_gemm_operands()
    assert ew.mx_dgrad_gemm_operands() is shifts and shifts[0] is ew.w1_t and shifts[3] is ew.w2_t
    for got, want in zip(shifts[1:3] + shifts[4:], mx_weight_shifts(ew.w1_t_scales) + mx_weight_shifts(ew.w2_t_scales)):
        assert torch.equal(got, want)
    folded = ew.mma_dgrad_operands()
    assert ew.mma_dgrad_operands() is folded
    for got, want in zip(folded, fold_mx_weight(ew.w1_t, ew.w1_t_scales) + fold_mx_weight(ew.w2_t, ew.w2_t_scales)):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_mxfp4_transform_layout():
    w1, w2 = master_weights(seed=3)
    ew = transform_weights(w1, w2, config("mxfp8_mxfp4"))
    assert ew.chunk == 8
    assert ew.w1.dtype == torch.uint8 and ew.w1.shape == (E, 2 * I, H // 2)
    assert ew.w1_scales.dtype == torch.uint8 and ew.w1_scales.shape == (E, 2 * I, H // 32)
    assert ew.w2.shape == (E, H, I // 2) and ew.w2_scales.shape == (E, H, I // 32)
    ref_data, ref_scales = quantize_weight(w1, RECIPES["mxfp8_mxfp4"])
    assert torch.equal(deinterleave_gate_up(ew.w1, 8), ref_data)
    assert torch.equal(deinterleave_gate_up(ew.w1_scales, 8), ref_scales)
    for got, want, scales in (
        (deinterleave_gate_up(ew.dequantize_w1(), 8), w1, deinterleave_gate_up(ew.w1_scales, 8)),
        (ew.dequantize_w2(), w2, ew.w2_scales),
    ):
        scale = ue8m0_to_float(scales).repeat_interleave(32, -1)
        assert ((got - want).abs() <= (want.abs() + scale) * 2**-2).all()


def test_mxfp4_mma_operands_are_the_folded_weights():
    """The fp8 GEMMs' view of the MX weights: quant.fold_mx_weight of the stored ones (w1 still
    interleaved), made once; at these magnitudes the fold is exact, so they dequantize to the
    E2M1 values, and the compute copies (the forward's weights in bf16, which no MX GEMM reads)
    are those values in master order."""
    w1, w2 = master_weights(seed=4)
    ew = transform_weights(w1, w2, config("mxfp8_mxfp4"))
    w1_f, w1_fs, w2_f, w2_fs = ew.mma_operands()
    assert ew.mma_operands()[0] is w1_f
    for (data, scales), (want_data, want_scales) in (
        ((w1_f, w1_fs), fold_mx_weight(ew.w1, ew.w1_scales)),
        ((w2_f, w2_fs), fold_mx_weight(ew.w2, ew.w2_scales)),
    ):
        assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
        assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8)) and torch.equal(scales, want_scales)
    for data, scales, want in ((w1_f, w1_fs, ew.dequantize_w1()), (w2_f, w2_fs, ew.dequantize_w2())):
        assert torch.equal(dequantize_weight(data, scales, RECIPES["fp8"]), want)
    c1, c2 = ew.compute_copies(torch.bfloat16)
    assert torch.equal(c1, deinterleave_gate_up(ew.dequantize_w1(), 8).to(torch.bfloat16))
    assert torch.equal(c2, ew.dequantize_w2().to(torch.bfloat16))
    fp8 = transform_weights(w1, w2, config("fp8"))
    assert all(a is b for a, b in zip(fp8.mma_operands(), (fp8.w1, fp8.w1_scales, fp8.w2, fp8.w2_scales)))


def test_resident_bytes_count_each_storage_once_and_the_derived_operands():
    """resident_bytes: the quantized weights, their dgrad copies and the derived operands made so
    far, each storage once (fp8's mma_operands alias its weights). mxfp8_mxfp4 as stored (E2M1
    plus ue8m0 per 32) is about half of fp8 (e4m3 plus fp32 per 128 x 128); its folded e4m3
    copies add a byte per weight."""
    w1, w2 = master_weights(seed=5)
    n = w1.numel() + w2.numel()
    fp8 = transform_weights(w1, w2, config("fp8"))
    stored = sum(t.untyped_storage().nbytes() for t in (fp8.w1, fp8.w1_scales, fp8.w2, fp8.w2_scales))
    stored += sum(t.untyped_storage().nbytes() for t in (fp8.w1_t, fp8.w1_t_scales, fp8.w2_t, fp8.w2_t_scales))
    assert fp8.resident_bytes() == stored
    fp8.mma_operands()
    assert fp8.resident_bytes() == stored
    mx = transform_weights(w1, w2, config("mxfp8_mxfp4"))
    assert mx.resident_bytes() == n + 2 * n // 32  # two E2M1 copies (half a byte), two ue8m0 per 32
    assert mx.resident_bytes() < 0.6 * fp8.resident_bytes()
    mx.mma_operands()
    assert mx.resident_bytes() > fp8.resident_bytes()
    bf16 = transform_weights(w1.bfloat16(), w2.bfloat16(), config("bf16"))
    assert bf16.resident_bytes() == 2 * n


def test_frozen_weights_read_their_derived_operands_and_make_none():
    """freeze_operands (a graphed layer's prepared weights): an operand made before is read as
    made, one not made raises instead of being made (inside a captured forward or backward it
    would be remade by that graph's replays only); what is stored, not derived, is still read."""
    w1, w2 = master_weights(seed=5)
    ew = transform_weights(w1, w2, config("mxfp8_mxfp4"))
    folded = ew.mma_operands()
    ew.freeze_operands()
    assert ew.mma_operands() is folded
    unmade = {
        "mma_dgrad_operands": ew.mma_dgrad_operands,
        "mx_gemm_operands": ew.mx_gemm_operands,
        "mx_dgrad_gemm_operands": ew.mx_dgrad_gemm_operands,
        "compute_copies": lambda: ew.compute_copies(torch.bfloat16),
    }
    for name, make in unmade.items():
        with pytest.raises(RuntimeError, match=rf"ExpertWeights\.{name}.*prepare_weights must make"):
            make()
    fp8 = transform_weights(w1, w2, config("fp8"))
    fp8.freeze_operands()
    assert all(a is b for a, b in zip(fp8.mma_operands(), (fp8.w1, fp8.w1_scales, fp8.w2, fp8.w2_scales)))
    assert all(a is b for a, b in zip(fp8.mma_dgrad_operands(), (fp8.w1_t, fp8.w1_t_scales, fp8.w2_t, fp8.w2_t_scales)))
    native = transform_weights(w1.to(torch.bfloat16), w2.to(torch.bfloat16), config("bf16"))
    native.freeze_operands()
    assert all(a is b for a, b in zip(native.compute_copies(torch.bfloat16), (native.w1, native.w2)))


def test_result_is_detached():
    w1, w2 = master_weights(requires_grad=True)
    for recipe in RECIPES:
        ew = transform_weights(w1, w2, config(recipe))
        assert not ew.w1.requires_grad and not ew.w2.requires_grad


def test_validation_names_the_argument():
    w1, w2 = master_weights()
    cfg = config()
    with pytest.raises(ValueError, match=r"w1: expected shape \[E, 512, 256\], got \[2, 256, 256\]"):
        transform_weights(w1[:, :I], w2, cfg)
    with pytest.raises(ValueError, match=r"w2: expected shape \[E, 256, 256\], got \[256, 256\]"):
        transform_weights(w1, w2[0], cfg)
    with pytest.raises(ValueError, match=r"w2: expected 2 experts"):
        transform_weights(w1, w2[:1], cfg)
    with pytest.raises(ValueError, match="w1: expected a floating dtype"):
        transform_weights(w1.to(torch.int32), w2, cfg)
    with pytest.raises(ValueError, match="w2: expected device cpu"):
        transform_weights(w1, w2.to("meta"), cfg)


@pytest.mark.parametrize("recipe", ["fp8", "mxfp8_mxfp4"])
def test_prepared_weights_need_the_dgrad_copies(recipe):
    """mega_moe(prepared_weights=) of a recipe with a quantized dgrad: without w1_t / w2_t, or with
    them of another shape, the call is bad input (the backward would read them)."""
    import dataclasses

    from megamoe_train.validation import _check_prepared

    cfg = config(recipe)
    ew = transform_weights(*master_weights(), cfg)
    assert _check_prepared(ew, cfg, E, torch.device("cpu")) is None
    missing = dataclasses.replace(ew, w2_t=None)
    assert "no w2_t, which recipe" in _check_prepared(missing, cfg, E, torch.device("cpu"))
    wrong = dataclasses.replace(ew, w1_t=ew.w1_t[:, : H // 2])
    assert "prepared_weights: w1_t is" in _check_prepared(wrong, cfg, E, torch.device("cpu"))


# ----------------------------------------------------------------------------- cache


def test_cache_hit_returns_same_object():
    w1, w2 = master_weights(requires_grad=True)
    cfg = config("fp8")
    first = transform_weights(w1, w2, cfg)
    assert transform_weights(w1, w2, cfg) is first
    assert transform_weights(w1, w2, config("fp8")) is first  # an equal config hits too
    assert transform_weights(w1, w2, config("mxfp8_mxfp4")) is not first


def test_cache_misses_after_optimizer_step():
    w1, w2 = master_weights(requires_grad=True)
    cfg = config(dtype=torch.bfloat16)  # fp32 masters, bf16 compute: a cached cast
    opt = torch.optim.SGD([w1, w2], lr=0.1)
    before = transform_weights(w1, w2, cfg)
    (w1.sum() + w2.square().sum()).backward()
    opt.step()
    after = transform_weights(w1, w2, cfg)
    assert after is not before
    assert torch.equal(after.w1, w1.detach().bfloat16())
    assert torch.equal(after.w2, w2.detach().bfloat16())
    assert transform_weights(w1, w2, cfg) is after


def test_cache_misses_after_other_updates():
    w1, w2 = master_weights(requires_grad=True)
    cfg = config(dtype=torch.bfloat16)  # fp32 masters, bf16 compute: a cached cast
    first = transform_weights(w1, w2, cfg)
    with torch.no_grad():
        w2.add_(1)
    second = transform_weights(w1, w2, cfg)
    assert second is not first and torch.equal(second.w2, w2.detach().bfloat16())
    w1.data = w1.data * 2  # a new storage: caught through data_ptr
    third = transform_weights(w1, w2, cfg)
    assert third is not second and torch.equal(third.w1, w1.detach().bfloat16())
    other_w2 = w2.detach().clone()
    assert transform_weights(w1, other_w2, cfg) is not third


def test_writes_through_data_need_clear_weight_cache():
    """Known limit: `.data` has its own version counter, so writes through it go unseen."""
    w1, w2 = master_weights(requires_grad=True)
    cfg = config(dtype=torch.bfloat16)  # fp32 masters, bf16 compute: a cached cast
    first = transform_weights(w1, w2, cfg)
    w1.data.add_(1)
    assert transform_weights(w1, w2, cfg) is first
    clear_weight_cache()
    fresh = transform_weights(w1, w2, cfg)
    assert fresh is not first and torch.equal(fresh.w1, w1.detach().bfloat16())


def test_cache_does_not_keep_weights_alive():
    w1, w2 = master_weights()
    transform_weights(w1, w2, config())
    assert len(_CACHE) == 1
    del w1
    gc.collect()
    assert len(_CACHE) == 0
