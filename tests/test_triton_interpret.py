"""The triton executor's fp8 backward kernels and wiring on CPU, through Triton's interpreter
(tests/fp8_backward_checks.py, in a subprocess with TRITON_INTERPRET=1), and the fp8 wgrad's
operand quantization kernel. Skipped without triton."""

import pytest

pytest.importorskip("triton")

from interpreted import run_interpreted  # noqa: E402


def _run_checks(*args):
    run_interpreted("fp8_backward_checks.py", "all interpreter checks passed", *args)


def test_fp8_backward_kernels_in_triton_interpreter():
    _run_checks()


def test_wgrad_quantize_tokens_t_in_triton_interpreter():
    """The wgrad operands' quantization kernel bit for bit quant.quantize_tokens_t (bf16 and e4m3
    sources, NaN padding rows, poisoned output, every column tile)."""
    _run_checks("wgrad_quant")


def test_row_quantizers_propagate_nan_in_triton_interpreter():
    """A NaN or inf in a 1x128 block: the row quantizer, the wgrad operands' and SwiGLU's
    requantization give what quant.py gives (a NaN scale for a NaN block), not a finite -448."""
    _run_checks("nan")
