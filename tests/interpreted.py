"""Run one of tests/' kernel-checks scripts in a subprocess under Triton's interpreter: how the
Triton kernels are tested on CPU (TRITON_INTERPRET must be set before triton is first imported,
so never in the pytest process itself)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def interpreter_env() -> dict[str, str]:
    """The environment of such a subprocess: TRITON_INTERPRET=1, tests/ importable and the checkout
    these tests belong to first on the path (a script's own folder replaces the working directory
    there, so an installed copy of megamoe_train elsewhere would win)."""
    path = [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(path))


def run_interpreted(script: str, done_line: str, *args: str) -> None:
    """Run tests/<script> with interpreter_env(); assert it exited 0 and printed done_line. Waits
    for the process (pytest-timeout ends a hang)."""
    env = interpreter_env()
    run = subprocess.run([sys.executable, str(TESTS / script), *args], env=env, capture_output=True, text=True)
    assert run.returncode == 0, f"{script} failed:\n{run.stdout}\n{run.stderr[-4000:]}"
    assert done_line in run.stdout, f"{script} did not finish:\n{run.stdout}"
