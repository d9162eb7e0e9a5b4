"""The fp8 weight-prep kernel against the torch path (its oracle), bit for bit: shared by
test_weight_prep.py's GPU tests and, run as a script, by its Triton-interpreter test on CPU
(`TRITON_INTERPRET=1 python tests/weight_prep_cases.py`; the interpreter must be chosen before
triton is imported, hence a process of its own)."""

from __future__ import annotations

import sys

import torch
from poison import poisoned

from megamoe_train.config import MegaMoEConfig
from megamoe_train.precision import RECIPES
from megamoe_train.quant import quantize_weight
from megamoe_train.weights import deinterleave_gate_up, interleave_gate_up, quantize_expert_weights

FP8 = RECIPES["fp8"]


def master_weight(e: int, n: int, k: int, dtype: torch.dtype, seed: int, device="cpu") -> torch.Tensor:
    """Random [E, N, K] whose 128 x 128 blocks span ~2**-24..2**24 and whose elements spread
    e**+-6 within a block, plus: a block of zeros (half of them -0.0), a block below the amax
    floor 1e-4 (e4m3 subnormals and zeros), and a block with one huge value (its other elements
    land on subnormals or zero)."""
    g = torch.Generator().manual_seed(seed)
    nb, kb = n // 128, k // 128
    block_scale = torch.exp2(torch.randint(-24, 25, (e, nb, 1, kb, 1), generator=g).float())
    w = torch.randn(e, nb, 128, kb, 128, generator=g) * torch.exp(torch.randn(e, nb, 128, kb, 128, generator=g) * 2)
    w = (w * block_scale).view(e, n, k)
    w[0, :128, :128] = 0.0
    w[0, :64, :128] = -0.0
    w[-1, -128:, :128] = torch.randn(128, 128, generator=g) * 1e-7
    w[0, -128:, -128:] = torch.randn(128, 128, generator=g)
    w[0, -100, -3] = 3e7
    return w.to(dtype).to(device)


def _dtypes(device) -> tuple[torch.dtype, ...]:
    """Master / compute-copy dtypes the kernels take there (fp32 last when present)."""
    from megamoe_train.backends.triton_weight_prep import master_dtypes

    return tuple(sorted(master_dtypes(torch.device(device)), key=lambda d: d == torch.float32))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype} {list(got.shape)} vs {want.dtype} {list(want.shape)}"
    )
    diff = _bits(got) != _bits(want)
    assert not diff.any(), (
        f"{what}: {int(diff.sum())} of {diff.numel()} elements differ, first at {diff.nonzero()[0].tolist()}"
    )


FIELDS = ("w1", "w1_scales", "w2", "w2_scales", "w1_t", "w1_t_scales", "w2_t", "w2_t_scales")


def check_expert_weights(e: int, inter: int, hidden: int, dtype: torch.dtype, seed: int, device="cpu") -> None:
    """quantize_expert_weights and compute_copies (bf16, fp32): kernel == torch, every field."""
    cfg = MegaMoEConfig(
        num_experts=e, hidden=hidden, intermediate=inter, topk=1, num_max_tokens_per_rank=8, recipe="fp8"
    )
    w1 = master_weight(e, 2 * inter, hidden, dtype, seed, device)
    w2 = master_weight(e, hidden, inter, dtype, seed + 1, device)
    got = poisoned(quantize_expert_weights, w1, w2, cfg, use_kernel=True)
    want = quantize_expert_weights(w1, w2, cfg, use_kernel=False)
    for name in FIELDS:
        assert getattr(got, name).is_contiguous(), name
        assert_same_bits(getattr(got, name), getattr(want, name), f"{name} ({dtype}, E={e} I={inter} H={hidden})")
    assert got.chunk == want.chunk == FP8.gate_up_chunk
    for out_dtype in _dtypes(device):
        copies = poisoned(got.compute_copies, out_dtype, use_kernel=True)
        # A fresh torch-path object: compute_copies caches per object.
        oracle = quantize_expert_weights(w1, w2, cfg, use_kernel=False).compute_copies(out_dtype, use_kernel=False)
        for name, a, b in zip(("w1", "w2"), copies, oracle):
            assert_same_bits(a, b, f"compute_copies({out_dtype}) {name} ({dtype}, E={e} I={inter} H={hidden})")


def check_chunk_and_strides(device="cpu") -> None:
    """quantize_blocks with a chunk of two blocks and a non-contiguous master weight."""
    from megamoe_train.backends.triton_weight_prep import dequantize_blocks, quantize_blocks

    base = master_weight(2, 1024, 512, _dtypes(device)[-1], seed=5, device=device)
    w = base.transpose(1, 2)  # [2, 512, 1024], strided
    data, scales, data_t, scales_t = poisoned(quantize_blocks, w)
    ref_data, ref_scales = quantize_weight(w, FP8)
    assert_same_bits(data, ref_data, "strided data")
    assert_same_bits(scales, ref_scales, "strided scales")
    assert_same_bits(data_t, ref_data.mT.contiguous(), "strided data_t")
    assert_same_bits(scales_t, ref_scales.mT.contiguous(), "strided scales_t")

    data, scales, data_t, _ = poisoned(quantize_blocks, base, chunk=256)
    ref_data, ref_scales = quantize_weight(base, FP8)
    assert_same_bits(data, interleave_gate_up(ref_data, 256), "chunk 256 data")
    assert_same_bits(scales, interleave_gate_up(ref_scales, 2), "chunk 256 scales")
    assert_same_bits(data_t, ref_data.mT.contiguous(), "chunk 256 data_t")
    out = poisoned(dequantize_blocks, data, scales, torch.bfloat16, chunk=256)
    from megamoe_train.quant import dequantize_weight

    assert_same_bits(
        out, deinterleave_gate_up(dequantize_weight(data, scales, FP8), 256).to(torch.bfloat16), "chunk 256 copies"
    )


def check_every_rounding(device="cpu") -> None:
    """Blocks whose amax is 448 have scale 1, so the data is the e4m3 rounding of the inputs
    themselves: every e4m3 value, every midpoint (ties to even) and its neighbours. And every
    code back to bf16 / fp32."""
    from megamoe_train.backends.triton_weight_prep import dequantize_blocks, quantize_blocks

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[~codes.isnan()].unique()
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.full_like(mids, 1e9), torch.full_like(mids, -1e9)
    cand = torch.cat(
        [
            values,
            mids,
            torch.nextafter(mids, up),
            torch.nextafter(mids, down),
            torch.tensor([-0.0, 1e-30, -1e-30, 447.99, -447.99]),
        ]
    )
    cand = cand[cand.abs() <= 448]
    w = torch.zeros(1, 128, 128 * 2)
    w.view(-1)[: cand.numel()] = cand
    w[0, 127, 127] = w[0, 127, 255] = 448.0  # both blocks: amax 448
    w = w.to(device)
    if torch.float32 in _dtypes(device):  # the ties need fp32 masters (bf16 cannot hold the midpoints)
        data, scales, _, _ = poisoned(quantize_blocks, w)
        ref_data, ref_scales = quantize_weight(w, FP8)
        assert (ref_scales == 1).all()
        assert_same_bits(scales, ref_scales, "scale-1 scales")
        assert_same_bits(data, ref_data, "e4m3 rounding of every tie")

    every_code = torch.arange(256, dtype=torch.uint8).repeat(128).view(1, 128, 256).view(torch.float8_e4m3fn).to(device)
    scales = torch.tensor([[[0.37, 3e-5]]], device=device)
    for dtype in _dtypes(device):
        out = poisoned(dequantize_blocks, every_code, scales, dtype)
        ref = (every_code.float().unflatten(-1, (2, 128)) * scales.unsqueeze(-1)).flatten(-2).to(dtype)
        nan = ref.isnan()
        assert torch.equal(out.isnan(), nan), f"{dtype}: NaN codes"
        assert_same_bits(out.masked_fill(nan, 0), ref.masked_fill(nan, 0), f"every code to {dtype}")


def check_nan_block(device="cpu") -> None:
    """A NaN makes its whole block NaN (as torch's amax does); other blocks are untouched."""
    from megamoe_train.backends.triton_weight_prep import quantize_blocks

    w = master_weight(1, 128, 256, _dtypes(device)[-1], seed=9, device=device)
    w[0, 3, 4] = float("nan")
    data, scales, _, _ = quantize_blocks(w)
    ref_data, ref_scales = quantize_weight(w, FP8)
    assert scales[0, 0, 0].isnan() and ref_scales[0, 0, 0].isnan()
    assert data[0, :, :128].float().isnan().all() and ref_data[0, :, :128].float().isnan().all()
    assert_same_bits(scales[..., 1:], ref_scales[..., 1:], "scales beside a NaN block")
    assert_same_bits(data[..., 128:], ref_data[..., 128:], "data beside a NaN block")


def check_rows_per_step(device="cpu", rows=(None, 32, 64)) -> None:
    """quantize_blocks a few rows of a block at a time, or the whole block at once (None): the
    default's bits (and torch's), with a chunk, a NaN block and a strided master weight."""
    from megamoe_train.backends.triton_weight_prep import quantize_blocks

    base = master_weight(2, 512, 256, _dtypes(device)[-1], seed=11, device=device)
    base[1, 130, 7] = float("nan")
    for w, chunk in ((base, 128), (base.transpose(1, 2), None)):
        want = quantize_blocks(w, chunk=chunk)
        ref_data, _ = quantize_weight(w, FP8)
        assert_same_bits(want[2], ref_data.mT.contiguous(), "data_t")
        for r in rows:
            got = poisoned(quantize_blocks, w, chunk=chunk, rows_per_step=r)
            for name, a, b in zip(("data", "scales", "data_t", "scales_t"), got, want):
                assert_same_bits(a, b, f"{name}, {r} rows per step, chunk {chunk}")
    for bad in (0, 48, 256):
        try:
            quantize_blocks(base, rows_per_step=bad)
        except ValueError as e:
            assert "rows_per_step" in str(e)
        else:
            raise AssertionError(f"rows_per_step={bad} accepted")


def run_interpreter_cases() -> None:
    """Small shapes for the CPU interpreter (slow: numpy per program)."""
    check_every_rounding()
    check_nan_block()
    check_chunk_and_strides()
    check_rows_per_step()
    check_expert_weights(2, 256, 384, torch.float32, seed=1)  # non-square: w1 [512, 384], w2 [384, 256]
    check_expert_weights(2, 384, 256, torch.bfloat16, seed=2)


if __name__ == "__main__":
    run_interpreter_cases()
    print("weight prep: kernel == torch in the Triton interpreter", file=sys.stderr)
