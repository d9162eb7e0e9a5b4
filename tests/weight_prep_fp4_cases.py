"""The E2M1 (mxfp8_mxfp4) weight-prep kernel against quant.py, bit for bit: shared by
test_weight_prep_fp4.py's GPU tests and, run as a script, by its Triton-interpreter test on CPU
(`TRITON_INTERPRET=1 python tests/weight_prep_fp4_cases.py`; the interpreter must be chosen before
triton is imported, hence a process of its own)."""

from __future__ import annotations

import torch
from poison import poisoned
from weight_prep_cases import assert_same_bits

from megamoe_train.config import MegaMoEConfig
from megamoe_train.precision import RECIPES
from megamoe_train.quant import E2M1_VALUES, quantize_weight, quantize_weight_t
from megamoe_train.weights import interleave_gate_up, quantize_expert_weights

MX = RECIPES["mxfp8_mxfp4"]
MASTER_DTYPES = (torch.float32, torch.bfloat16)
FIELDS = ("w1", "w1_scales", "w2", "w2_scales", "w1_t", "w1_t_scales", "w2_t", "w2_t_scales")


def tie_tile(g: torch.Generator) -> torch.Tensor:
    """A 32 x 32 tile whose every row and column holds a +-6 (on the diagonal), so every 1 x 32
    block of it, along either axis, has scale 1 and its codes are the E2M1 rounding of the values
    themselves: every E2M1 value, every midpoint between two (the ties) and the float32 numbers
    either side of each, and a subnormal, in random signs."""
    values = torch.tensor(E2M1_VALUES)
    mids = (values[1:] + values[:-1]) / 2
    cand = torch.cat(
        [
            values,
            mids,
            torch.nextafter(mids, torch.full_like(mids, 7.0)),
            torch.nextafter(mids, torch.zeros_like(mids)),
            torch.tensor([2.0**-130]),
        ]
    )
    signs = torch.where(torch.rand(32, 32, generator=g) < 0.5, -1.0, 1.0)
    tile = cand[torch.randint(cand.numel(), (32, 32), generator=g)] * signs
    diagonal = torch.arange(32)
    tile[diagonal, diagonal] = 6.0 * signs[diagonal, diagonal]
    return tile


def fp4_master(e: int, n: int, k: int, dtype: torch.dtype, seed: int, device="cpu") -> torch.Tensor:
    """Random [E, N, K] (N, K multiples of 32) whose 32 x 32 tiles span magnitudes ~2**-40..2**40,
    elements spreading e**+-6 within a tile, then placed over it: a zero tile (zeros and -0.0), a
    tile of subnormals, one of amax 3 * 2**-126 (the largest amax of the smallest scale, 2**-127,
    to which the scale is clamped below: amax / scale lands on 6 exactly), one of the largest
    finite values, two tie tiles (tie_tile, one scaled by a power of two: the same ties at another
    scale), one of amax exactly 6 * 2**j with a corner one bf16 ulp above it, and NaN, -NaN, inf
    and -inf in blocks of their own. The tiles go to random places (on shapes of fewer than 11
    tiles some overwrite others)."""
    g = torch.Generator().manual_seed(seed)
    nt, kt = n // 32, k // 32
    tile_scale = torch.exp2(torch.randint(-40, 41, (e, nt, 1, kt, 1), generator=g).float())
    w = torch.randn(e, nt, 32, kt, 32, generator=g) * torch.exp(torch.randn(e, nt, 32, kt, 32, generator=g) * 2)
    w = (w * tile_scale).view(e, n, k)
    finfo = torch.finfo(dtype)
    tiles = [(i, j) for i in range(nt) for j in range(kt)]
    order = torch.randperm(len(tiles), generator=g).tolist()

    def tile(index: int) -> tuple[int, slice, slice]:
        i, j = tiles[order[index % len(tiles)]]
        return index % e, slice(32 * i, 32 * i + 32), slice(32 * j, 32 * j + 32)

    x, rows, cols = tile(0)
    w[x, rows, cols] = 0.0
    w[x, rows.start : rows.start + 16, cols] = -0.0
    x, rows, cols = tile(1)
    w[x, rows, cols] = torch.randn(32, 32, generator=g) * 2.0**-128  # subnormal in fp32 and bf16
    x, rows, cols = tile(2)
    w[x, rows, cols] = torch.randn(32, 32, generator=g) * 2.0**-127
    w[x, rows, cols].diagonal().copy_(torch.full((32,), 3 * 2.0**-126))
    x, rows, cols = tile(3)
    w[x, rows, cols] = (torch.rand(32, 32, generator=g) * 2 - 1) * finfo.max
    w[x, rows.start, cols.start] = -finfo.max
    x, rows, cols = tile(4)
    w[x, rows, cols] = tie_tile(g) * 2.0 ** int(torch.randint(-20, 21, (), generator=g))
    x, rows, cols = tile(5)
    w[x, rows, cols] = tie_tile(g)
    x, rows, cols = tile(6)
    power = 2.0 ** int(torch.randint(-30, 31, (), generator=g))
    w[x, rows, cols] = torch.randn(32, 32, generator=g) * power
    w[x, rows, cols].diagonal().copy_(torch.full((32,), 6.0 * power))
    w[x, rows.start : rows.start + 2, cols.start : cols.start + 2] = 6.0 * power * (1 + 2.0**-7)  # exact in bf16
    for index, special in enumerate((float("nan"), -float("nan"), float("inf"), -float("inf"))):
        x, rows, cols = tile(7 + index)
        w[x, rows.start + index, cols.start + 2 * index + 1] = special
    return w.to(dtype).to(device)


def reference(w: torch.Tensor, chunk: int | None) -> tuple[torch.Tensor, ...]:
    """What the kernel must write: quant.quantize_weight of the interleaved master (interleaving
    1 x 32 blocks' data and scales rows alike) and quant.quantize_weight_t of the master (the
    dgrad's copy: transposed, in master order, blocked along the master's rows)."""
    data, scales = quantize_weight(w, MX)
    if chunk is not None:
        data, scales = interleave_gate_up(data, chunk), interleave_gate_up(scales, chunk)
    data_t, scales_t = quantize_weight_t(w, MX)
    return data, scales, data_t, scales_t


def check_blocks(e: int, n: int, k: int, device="cpu", chunk=None, seed=0, **kwargs) -> None:
    """quantize_e2m1_blocks == reference on fresh fp4_master weights, both master dtypes, plus a
    strided master (the same values, stored transposed)."""
    from megamoe_train.backends.triton_weight_prep import quantize_e2m1_blocks

    for dtype in MASTER_DTYPES:
        w = fp4_master(e, n, k, dtype, seed, device)
        strided = w.mT.contiguous().mT
        for master, layout in ((w, "contiguous"), (strided, "strided")):
            got = poisoned(quantize_e2m1_blocks, master, chunk=chunk, **kwargs)
            for name, a, b in zip(("data", "scales", "data_t", "scales_t"), got, reference(w, chunk)):
                assert a.is_contiguous(), name
                assert_same_bits(a, b, f"{name} ({dtype}, {layout}, [{e}, {n}, {k}], chunk {chunk}, {kwargs})")
            seed += 1


def check_specials_present() -> None:
    """fp4_master holds what it promises, so the comparisons cover it: the four NaN-scale blocks,
    the smallest scale (code 0) with a code of 6, scale 1 (the tie tiles), an all-zero block
    and -0.0 codes; and the ties do tie."""
    for dtype in MASTER_DTYPES:
        w = fp4_master(2, 128, 192, dtype, seed=3)
        data, scales = quantize_weight(w, MX)
        codes = torch.stack([data & 0xF, data >> 4], -1).flatten(-2)
        assert (scales == 255).sum() == 4 and (scales == 127).any()
        assert ((codes & 7) == 7).view(*scales.shape, 32)[scales == 0].any()
        assert (data == 0).view(*scales.shape, 16).all(-1).any() and (codes == 8).any()
        mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
        assert torch.isin(w.float().abs(), mids).sum() > 50


def check_expert_weights(e: int, inter: int, hidden: int, device="cpu", seed=0) -> None:
    """quantize_expert_weights for mxfp8_mxfp4: the kernel path == the torch path, every field,
    the dgrad's transposed copies (w1_t, w2_t: quant.quantize_weight_t of the masters) included."""
    cfg = MegaMoEConfig(
        num_experts=e, hidden=hidden, intermediate=inter, topk=1, num_max_tokens_per_rank=8, recipe=MX.name
    )
    for dtype in MASTER_DTYPES:
        w1 = fp4_master(e, 2 * inter, hidden, dtype, seed, device)
        w2 = fp4_master(e, hidden, inter, dtype, seed + 1, device)
        got = poisoned(quantize_expert_weights, w1, w2, cfg, use_kernel=True)
        want = quantize_expert_weights(w1, w2, cfg, use_kernel=False)
        for name in FIELDS:
            assert getattr(got, name).is_contiguous(), name
            assert_same_bits(getattr(got, name), getattr(want, name), f"{name} ({dtype}, E={e} I={inter} H={hidden})")
        for name, master in (("w1_t", w1), ("w2_t", w2)):
            data_t, scales_t = quantize_weight_t(master, MX)
            assert_same_bits(getattr(got, name), data_t, f"{name} against quantize_weight_t ({dtype})")
            assert_same_bits(getattr(got, f"{name}_scales"), scales_t, f"{name}_scales against quantize_weight_t")
        assert got.chunk == want.chunk == MX.gate_up_chunk
        seed += 2


def check_without_transposed(device="cpu") -> None:
    from megamoe_train.backends.triton_weight_prep import quantize_e2m1_blocks

    w = fp4_master(2, 128, 96, torch.bfloat16, seed=4, device=device)
    data, scales, data_t, scales_t = poisoned(quantize_e2m1_blocks, w, chunk=16, transposed=False)
    assert data_t is None and scales_t is None
    ref = reference(w, 16)
    assert_same_bits(data, ref[0], "data without the transposed copy")
    assert_same_bits(scales, ref[1], "scales without the transposed copy")


def check_rejects(device="cpu") -> None:
    from megamoe_train.backends.triton_weight_prep import quantize_e2m1_blocks

    w = torch.zeros(1, 64, 64, device=device)
    for bad, what in (
        (dict(w=torch.zeros(1, 48, 64, device=device)), "tile into"),  # N not a multiple of 32
        (dict(w=torch.zeros(1, 64, 80, device=device)), "tile into"),
        (dict(w=w.double()), "expected one of"),
        (dict(w=w, tile=(16, 64)), "tile"),
        (dict(w=w, tile=(64, 96)), "tile"),
        (dict(w=w, chunk=24), "gate/up rows"),
    ):
        try:
            quantize_e2m1_blocks(**bad)
        except ValueError as error:
            assert what in str(error), (bad, error)
        else:
            raise AssertionError(f"accepted {bad}")


def run_interpreter_cases() -> None:
    """Small, odd shapes for the CPU interpreter (slow: numpy per program): dims multiples of 32
    but not of 128, tiles of 32 and 64 rows or columns, fc1 interleave chunks of 8 and 32."""
    check_specials_present()
    check_blocks(3, 96, 160, seed=10)
    check_blocks(2, 192, 96, chunk=8, seed=20)
    check_blocks(1, 320, 224, chunk=32, seed=30, tile=(128, 32))
    check_blocks(2, 64, 64, chunk=32, seed=40, tile=(32, 32))
    check_blocks(1, 64, 384, seed=45)  # the default tile, 64 x 128
    check_expert_weights(3, 96, 160, seed=50)
    check_without_transposed()
    check_rejects()


if __name__ == "__main__":
    run_interpreter_cases()
    print("fp4 weight prep: kernel == quant.py in the Triton interpreter")
