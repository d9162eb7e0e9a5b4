"""Run a call with every torch.empty poisoned (NaN for floats, the largest value for integers), so
an element a kernel should have written but did not makes the comparison fail."""

import torch


def poisoned(fn, *args, **kwargs):
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        return fn(*args, **kwargs)
    finally:
        torch.use_deterministic_algorithms(False)
