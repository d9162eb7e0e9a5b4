"""The MX fold kernels against quant.py, bit for bit: triton_kernels' quantize_rows_mx, fold_mx_rows
and swiglu_forward(mx=True), and triton_weight_prep's fold_e2m1_blocks. Shared by test_mx_fold.py's
GPU tests and, run as a script, by its Triton-interpreter test on CPU
(`TRITON_INTERPRET=1 python tests/mx_fold_cases.py`; the interpreter must be chosen before triton
is imported, hence a process of its own).

Every comparison is of the bits (NaN signs and payloads included); the inputs give the 1x32 blocks
of a fold block scales 0 to 12 binades apart (some elements underflow to e4m3's subnormals or to
zero), blocks past the fold's -30 clamp, all-zero blocks, subnormal inputs (the smallest scale),
the largest values, amax on and just past 448 * 2**j, and NaN and inf elements."""

from __future__ import annotations

import torch
from poison import poisoned
from weight_prep_cases import assert_same_bits
from weight_prep_fp4_cases import fp4_master

from megamoe_train.precision import RECIPES
from megamoe_train.quant import fold_mx_act, fold_mx_weight, quantize_act, quantize_weight

MX = RECIPES["mxfp8_mxfp4"]
POISON_E4M3 = 0x5A  # a finite e4m3 code (208.0): the kernels never leave it in a live row by chance
POISON_CODE = 0xA5
POISON_SCALE = -3.0


def live_rows(n: int, device) -> torch.Tensor:
    return torch.tensor([n], dtype=torch.int32, device=device)


def mx_rows(p: int, w: int, dtype: torch.dtype, seed: int, device="cpu") -> torch.Tensor:
    """Random rows [P, W] (W a multiple of 128): each 1x128 block at 2**-40..2**40, its four 1x32
    blocks 0..12 binades below that (a few 40 below: past the fold's clamp), elements spreading
    e**+-4.5 within a block; over them (P >= 8, W >= 256): an all-zero 1x32 block and an all-zero
    1x128 block (-0.0 in half), a block of bf16 / fp32 subnormals, the largest finite values, amax
    exactly 448 * 2**j and one ulp above it, and NaN, -NaN, inf and -inf elements."""
    g = torch.Generator().manual_seed(seed)
    nb = w // 128
    base = torch.randint(-40, 41, (p, nb, 1, 1), generator=g)
    drop = torch.randint(0, 13, (p, nb, 4, 1), generator=g)
    drop = torch.where(torch.rand(p, nb, 4, 1, generator=g) < 0.05, torch.full_like(drop, 40), drop)
    x = torch.randn(p, nb, 4, 32, generator=g) * torch.exp(torch.randn(p, nb, 4, 32, generator=g) * 1.5)
    x = (x * torch.exp2((base - drop).float())).view(p, w)
    finfo = torch.finfo(dtype)
    x[0, 32:64] = 0.0
    x[1, 128:256] = 0.0
    x[1, 128:192] = -0.0
    x[2, :128] = torch.randn(128, generator=g) * 2.0**-130  # subnormal in fp32 and bf16
    x[3, 128:256] = (torch.rand(128, generator=g) * 2 - 1) * finfo.max
    power = 2.0 ** int(torch.randint(-30, 31, (), generator=g))
    x[4, :64] = torch.randn(64, generator=g) * power
    x[4, 5] = 448.0 * power
    x[4, 40] = -448.0 * power * (1 + 2.0**-7)  # exact in bf16
    x[5, 3] = float("nan")
    x[5, 200] = -float("nan")
    x[6, 70] = float("inf")
    x[7, 250] = -float("inf")
    return x.to(dtype).to(device)


def e4m3_rows(p: int, w: int, seed: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Arbitrary MXFP8 rows: every e4m3 byte (NaNs of both signs too) over ue8m0 codes at a random
    base per 1x128 block minus 0..12 (a few minus 40 or 255: the NaN scale), some codes 0 (scale
    2**-127) and 254."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (p, w), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    base = torch.randint(0, 255, (p, w // 128, 1), generator=g)
    codes = base - torch.randint(0, 13, (p, w // 128, 4), generator=g)
    odd = torch.rand(p, w // 128, 4, generator=g)
    codes = torch.where(odd < 0.04, base - 40, codes)
    codes = torch.where(odd > 0.98, torch.full_like(codes, 255), codes).clamp(0, 255)
    codes = codes.view(p, w // 32)
    codes[0, :4] = 0
    codes[1, :4] = 254
    return data.to(device), codes.to(torch.uint8).to(device)


def check_inputs_cover() -> None:
    """mx_rows and e4m3_rows hold what they promise, so the comparisons cover it."""
    data, codes = quantize_act(mx_rows(16, 384, torch.bfloat16, seed=1), MX)
    assert (codes == 255).sum() == 4 and (codes == 0).any() and ((codes > 0) & (codes < 255)).any()
    groups = codes.view(16, -1, 4).int()
    finite = (groups < 255).all(-1, keepdim=True)
    shift = (groups.amax(-1, keepdim=True) - groups)[finite.expand_as(groups)]
    assert set(range(13)) <= set(shift.tolist()) and (shift > 30).any(), "shifts 0..12 and past the clamp"
    folded, _ = fold_mx_act(data, codes)
    underflow = (data.float() != 0) & (folded.float() == 0)
    rounded = (data.float() != 0) & (folded.float() != 0) & (folded.float().abs() < 2.0**-6)
    assert underflow.sum() > 20 and rounded.sum() > 20, "elements underflow to zero and to subnormals"
    assert (data.view(torch.uint8) == 0x80).any() and (folded.view(torch.uint8) == 0x80).any(), "-0.0"
    data, codes = e4m3_rows(16, 384, seed=2)
    assert (codes == 255).any() and (data.view(torch.uint8) == 0xFF).any()


def check_quantize_rows_mx(p: int, w: int, live: int, device="cpu", seed=0, **kwargs) -> None:
    """quantize_rows_mx == quant.quantize_act for rows < live (bf16 and fp32 sources); rows past live
    keep their poison."""
    from megamoe_train.backends.triton_kernels import quantize_rows_mx

    for dtype in (torch.bfloat16, torch.float32):
        x = mx_rows(p, w, dtype, seed, device)
        out = torch.full((p, w), POISON_E4M3, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
        scales = torch.full((p, w // 32), POISON_CODE, dtype=torch.uint8, device=device)
        quantize_rows_mx(x, out, scales, live_rows(live, device), **kwargs)
        want, want_scales = quantize_act(x[:live], MX)
        what = f"quantize_rows_mx ({dtype}, [{p}, {w}], {live} live, {kwargs})"
        assert_same_bits(out[:live], want, f"{what} data")
        assert_same_bits(scales[:live], want_scales, f"{what} scales")
        assert (out[live:].view(torch.uint8) == POISON_E4M3).all() and (scales[live:] == POISON_CODE).all(), (
            f"{what}: rows past num_rows written"
        )
        seed += 1


def check_fold_mx_rows(p: int, w: int, live: int, device="cpu", seed=0, **kwargs) -> None:
    """fold_mx_rows == quant.fold_mx_act for rows < live, in place, on quantize_act's rows (bf16
    sources) and on arbitrary bytes and codes; rows past live untouched (data, scales, out_scales)."""
    from megamoe_train.backends.triton_kernels import fold_mx_rows

    sources = (quantize_act(mx_rows(p, w, torch.bfloat16, seed, device), MX), e4m3_rows(p, w, seed + 1, device))
    for source, (data, codes) in zip(("quantize_act", "arbitrary"), sources):
        folded = data.clone()
        kept_codes = codes.clone()
        out_scales = torch.full((p, w // 128), POISON_SCALE, device=device)
        fold_mx_rows(folded, codes, out_scales, live_rows(live, device), **kwargs)
        want, want_scales = fold_mx_act(data[:live], codes[:live])
        what = f"fold_mx_rows ({source}, [{p}, {w}], {live} live, {kwargs})"
        assert_same_bits(folded[:live], want, f"{what} data")
        assert_same_bits(out_scales[:live], want_scales, f"{what} scales")
        assert_same_bits(folded[live:], data[live:], f"{what} rows past num_rows")
        assert torch.equal(codes, kept_codes), f"{what}: 1x32 scales written"
        assert (out_scales[live:] == POISON_SCALE).all(), f"{what}: scales past num_rows written"


def swiglu_inputs(p: int, inter: int, chunk: int, seed: int, device):
    """h [P, 2I] bf16 (gate/up interleaved in chunks) whose up halves' 1x32 blocks of the SwiGLU output
    sit 0..12 binades apart (a few 40), one all-zero 1x32 block, a NaN and an inf; row weights."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(p, inter, generator=g) * 2
    drop = torch.randint(0, 13, (p, inter // 32, 1), generator=g)
    drop = torch.where(torch.rand(p, inter // 32, 1, generator=g) < 0.05, torch.full_like(drop, 40), drop)
    up = (torch.randn(p, inter // 32, 32, generator=g) * torch.exp2(-drop.float())).view(p, inter)
    up[0, 32:64] = 0.0
    gate[1, 5] = float("nan")
    up[2, 130] = float("inf")
    h = torch.stack([gate.view(p, -1, chunk), up.view(p, -1, chunk)], dim=2).reshape(p, 2 * inter)
    row_w = torch.rand(p, generator=g) + 0.1
    return h.to(torch.bfloat16).to(device), row_w.to(device)


def check_swiglu_mx(p: int, inter: int, live: int, clamp, device="cpu", seed=0, chunk=MX.gate_up_chunk, **kwargs):
    """swiglu_forward(mx=True) == quant.fold_mx_act(*quant.quantize_act(a)) with a the kernel's own
    fp32 SwiGLU value (swiglu_forward into an fp32 act); rows past live keep their poison."""
    from megamoe_train.backends.triton_kernels import swiglu_forward

    h, row_w = swiglu_inputs(p, inter, chunk, seed, device)
    a = torch.full((p, inter), float("nan"), device=device)
    swiglu_forward(h, row_w, a, None, live_rows(live, device), chunk, clamp, **kwargs)
    act = torch.full((p, inter), POISON_E4M3, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    act_scales = torch.full((p, inter // 128), POISON_SCALE, device=device)
    swiglu_forward(h, row_w, act, act_scales, live_rows(live, device), chunk, clamp, mx=True, **kwargs)
    want, want_scales = fold_mx_act(*quantize_act(a[:live], MX))
    what = f"swiglu_forward mx ([{p}, {inter}], {live} live, clamp {clamp}, chunk {chunk}, {kwargs})"
    assert_same_bits(act[:live], want, f"{what} act")
    assert_same_bits(act_scales[:live], want_scales, f"{what} scales")
    assert (act[live:].view(torch.uint8) == POISON_E4M3).all() and (act_scales[live:] == POISON_SCALE).all(), (
        f"{what}: rows past num_rows written"
    )
    assert (want.view(torch.uint8) == 0).any(), f"{what}: zeros"
    # the NaN gate stays NaN through the clamp too, as torch's clamp keeps it (expert_math)
    assert want_scales.isnan().any(), f"{what}: a NaN block"
    from megamoe_train.expert_math import swiglu

    ref = swiglu(h[:live].cpu(), chunk, clamp) * row_w[:live, None].cpu()
    assert torch.equal(a[:live].isnan().cpu(), ref.isnan()), f"{what}: NaN where the oracle has none, or not"


def e2m1_weights(e: int, n: int, k: int, seed: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Arbitrary packed E2M1 weights (every code, -0.0 too) over ue8m0 codes at a random base per
    128 x 128 block minus 0..12 (a few minus 40); one block's codes all 0 (its scale 2**-127), one's
    0 or 1, one with a code 254 and one with a NaN code (255)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    base = torch.randint(40, 255, (e, n // 128, 1, k // 128, 1), generator=g)
    codes = base - torch.randint(0, 13, (e, n // 128, 128, k // 128, 4), generator=g)
    far = torch.rand(e, n // 128, 128, k // 128, 4, generator=g) < 0.02
    codes = torch.where(far, base - 40, codes).view(e, n, k // 32)
    codes[0, :128, :4] = 0
    codes[1, :128, :4] = torch.randint(0, 2, (128, 4), generator=g)
    codes[-1, -128:, -4:] = torch.randint(200, 255, (128, 4), generator=g)
    codes[-1, -100, -3] = 254
    codes[0, -128:, -4:] = torch.randint(100, 120, (128, 4), generator=g)
    codes[0, -7, -2] = 255
    return data.to(device), codes.to(torch.uint8).to(device)


def check_fold_e2m1_blocks(e: int, n: int, k: int, device="cpu", seed=0, **kwargs) -> None:
    """fold_e2m1_blocks == quant.fold_mx_weight on arbitrary codes and on quant.quantize_weight of
    fp4_master weights (NaN, inf, subnormal, zero and largest-value blocks), every output element
    written (torch.empty poisoned)."""
    from megamoe_train.backends.triton_weight_prep import fold_e2m1_blocks

    master = fp4_master(e, n, k, torch.float32, seed, device)
    sources = (e2m1_weights(e, n, k, seed, device), quantize_weight(master, MX))
    for source, (data, scales) in zip(("arbitrary", "quantize_weight"), sources):
        got, got_scales = poisoned(fold_e2m1_blocks, data, scales, **kwargs)
        want, want_scales = fold_mx_weight(data, scales)
        what = f"fold_e2m1_blocks ({source}, [{e}, {n}, {k}], {kwargs})"
        assert got.is_contiguous() and got_scales.is_contiguous(), what
        assert_same_bits(got, want, f"{what} data")
        assert_same_bits(got_scales, want_scales, f"{what} scales")
        assert want_scales.isnan().any(), f"{what}: a NaN block"


def check_weight_inputs_cover() -> None:
    """e2m1_weights holds what it promises, and its folds lose elements to zero and land others on
    e4m3's subnormals, so the comparisons cover those roundings."""
    data, scales = e2m1_weights(3, 256, 384, seed=3)
    folded, folded_scales = fold_mx_weight(data, scales)
    assert (folded_scales.view(torch.int32) == 1 << 22).any(), "a block of scale 2**-127"
    assert folded_scales.isnan().sum() == 1 and (scales == 254).any()
    codes = torch.stack([data & 15, data >> 4], dim=-1).flatten(-2)
    bits = folded.view(torch.uint8)
    finite = bits & 0x7F != 0x7F
    assert ((codes & 7 != 0) & (bits & 0x7F == 0) & finite).sum() > 20, "elements that round to zero"
    assert ((bits & 0x78 == 0) & (bits & 7 != 0)).sum() > 20, "e4m3 subnormals"
    assert (bits == 0x80).any(), "-0.0"


def check_rejects(device="cpu") -> None:
    from megamoe_train.backends.triton_weight_prep import fold_e2m1_blocks

    def bytes_(*shape):
        return torch.zeros(shape, dtype=torch.uint8, device=device)

    good, scales = bytes_(1, 128, 64), bytes_(1, 128, 4)
    for bad, what in (
        (dict(data=bytes_(1, 192, 64), scales=bytes_(1, 192, 4)), "tile"),  # N not a multiple of 128
        (dict(data=bytes_(1, 128, 32), scales=bytes_(1, 128, 2)), "tile"),
        (dict(data=good, scales=scales[:, :, :2]), "scales must have shape"),
        (dict(data=good.float(), scales=scales), "expected uint8"),
        (dict(data=good, scales=scales, rows_per_step=48), "rows_per_step"),
    ):
        try:
            fold_e2m1_blocks(**bad)
        except ValueError as error:
            assert what in str(error), (bad, error)
        else:
            raise AssertionError(f"accepted {bad}")


def run_interpreter_cases() -> None:
    """Small odd shapes for the CPU interpreter: rows not a multiple of the row tile, live rows fewer
    than the rows, widths of one and three 1x128 blocks, N of two and three fold blocks."""
    check_inputs_cover()
    check_weight_inputs_cover()
    check_quantize_rows_mx(75, 384, 61, seed=10)
    check_quantize_rows_mx(20, 256, 20, seed=12, block_r=16)
    check_fold_mx_rows(75, 384, 61, seed=20)
    check_fold_mx_rows(21, 256, 9, seed=22, block_r=8)
    check_swiglu_mx(45, 256, 37, None, seed=30)
    check_swiglu_mx(40, 384, 40, 3.0, seed=31, chunk=128, block_r=16)
    check_fold_e2m1_blocks(3, 256, 384, seed=40)
    check_fold_e2m1_blocks(3, 384, 128, seed=41, rows_per_step=128)
    check_rejects()


if __name__ == "__main__":
    run_interpreter_cases()
    print("mx fold: kernels == quant.py in the Triton interpreter")
