"""The MX operands of Hopper's fp8 MMA: the Triton kernels that quantize activations to mxfp8
(quantize_rows_mx), fold them (fold_mx_rows, swiglu_forward(mx=True)) and fold mxfp4 weights
(fold_e2m1_blocks) against quant.py bit for bit, in the Triton interpreter on CPU
(tests/mx_fold_cases.py in a subprocess, skipped without triton) and on the GPU at larger shapes
(marked `gpu`)."""

import pytest
from mx_fold_cases import (
    check_fold_e2m1_blocks,
    check_fold_mx_rows,
    check_quantize_rows_mx,
    check_rejects,
    check_swiglu_mx,
)


def test_kernels_match_quant_in_triton_interpreter():
    pytest.importorskip("triton")
    from interpreted import run_interpreted

    run_interpreted("mx_fold_cases.py", "mx fold: kernels == quant.py in the Triton interpreter")


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("p, w, live", [(4133, 7168, 4000), (300, 2048, 300), (77, 384, 1)])
def test_row_kernels_match_quant_on_gpu(p, w, live):
    check_quantize_rows_mx(p, w, live, device="cuda", seed=p)
    check_quantize_rows_mx(p, w, live, device="cuda", seed=p + 7, block_r=8, num_warps=8)
    check_fold_mx_rows(p, w, live, device="cuda", seed=p + 1)
    check_fold_mx_rows(p, w, live, device="cuda", seed=p + 2, block_r=64, num_warps=8)


@pytest.mark.gpu
@pytest.mark.parametrize("clamp", [None, 7.0])
def test_swiglu_mx_matches_quant_on_gpu(clamp):
    check_swiglu_mx(2053, 2048, 2000, clamp, device="cuda", seed=5)
    check_swiglu_mx(300, 384, 257, clamp, device="cuda", seed=6, chunk=128, block_r=8)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [(8, 4096, 7168), (3, 2816, 2048), (2, 384, 128)], ids=["E8_N4096_K7168", "E3_N2816_K2048", "small"]
)
def test_fold_e2m1_blocks_matches_quant_on_gpu(shape):
    check_fold_e2m1_blocks(*shape, device="cuda", seed=sum(shape))
    check_fold_e2m1_blocks(*shape, device="cuda", seed=sum(shape) + 1, rows_per_step=128, num_warps=8)


@pytest.mark.gpu
def test_fold_e2m1_blocks_rejects_on_gpu():
    check_rejects("cuda")
