"""The triton executor's fp8 backward kernels and wiring on CPU, through Triton's interpreter
(tests/fp8_backward_checks.py, in a subprocess with TRITON_INTERPRET=1), and the fp8 wgrad's
operand quantization kernel. Skipped without triton."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

TESTS = Path(__file__).parent


def _run_checks(*args):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(TESTS / "fp8_backward_checks.py"), *args], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, f"interpreter checks failed:\n{run.stdout}\n{run.stderr[-4000:]}"
    assert "all interpreter checks passed" in run.stdout


def test_fp8_backward_kernels_in_triton_interpreter():
    _run_checks()


def test_wgrad_quantize_tokens_t_in_triton_interpreter():
    """The wgrad operands' quantization kernel bit for bit quant.quantize_tokens_t (bf16 and e4m3
    sources, NaN padding rows, poisoned output, every column tile)."""
    _run_checks("wgrad_quant")
