"""The triton executor's fp8 backward kernels and wiring on CPU, through Triton's interpreter
(tests/fp8_backward_checks.py, in a subprocess with TRITON_INTERPRET=1). Skipped without triton."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

TESTS = Path(__file__).parent


def test_fp8_backward_kernels_in_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(TESTS / "fp8_backward_checks.py")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, f"interpreter checks failed:\n{run.stdout}\n{run.stderr[-4000:]}"
    assert "all interpreter checks passed" in run.stdout
