"""The parallel layouts of test_layouts.py on GPUs (NCCL, CUDA symmetric memory), marked `gpu`:
each runs where the host has a GPU per rank (4 or 8) and skips otherwise."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

import layout_cases as cases  # noqa: E402
from test_layouts import LAYOUTS, check_layout_results  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_stock_gpu(mcore_pool, tmp_path, layout):
    world, kw, schedule, moe_layers = LAYOUTS[layout]
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    res = mcore_pool("nccl", world=world).run(cases.layout_training, kw, str(tmp_path), tol=1e-4, param_tol=1e-4)
    check_layout_results(res, schedule, moe_layers)
