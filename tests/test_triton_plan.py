"""The device plan's Triton kernels against plan.build_plan on CPU, through Triton's interpreter
(tests/plan_kernel_checks.py in a subprocess with TRITON_INTERPRET=1). Skipped without triton."""

import pytest

pytest.importorskip("triton")

from interpreted import run_interpreted  # noqa: E402


def test_device_plan_matches_plan_py_in_triton_interpreter():
    run_interpreted("plan_kernel_checks.py", "all plan checks passed")
