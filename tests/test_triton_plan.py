"""The device plan's Triton kernels against plan.build_plan on CPU, through Triton's interpreter
(tests/plan_kernel_checks.py in a subprocess with TRITON_INTERPRET=1). Skipped without triton."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

TESTS = Path(__file__).parent


def test_device_plan_matches_plan_py_in_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(TESTS / "plan_kernel_checks.py")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, f"plan checks failed:\n{run.stdout}\n{run.stderr[-4000:]}"
    assert "all plan checks passed" in run.stdout
