"""The router's top-k selection kernel (megamoe_trainer.perf.router_topk) and the adapter's
routing-map slots kernel (megatron_patch.routing) against megatron's torch router
(tests/routing_kernel_checks.py): on CPU through Triton's interpreter in a subprocess, on one GPU
marked `gpu`. Also: installing the patch is idempotent and leaves CPU tensors on megatron's own code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("triton")

from interpreted import run_interpreted  # noqa: E402

TESTS = Path(__file__).parent.parent


def test_routing_kernels_match_megatron_in_triton_interpreter():
    run_interpreted("routing_kernel_checks.py", "all routing checks passed")


INSTALL_CHECK = """
import torch
from megatron.core.transformer.moe import router
from megatron_patch import routing
from megatron_patch.moe_layer import routing_to_topk
from megamoe_trainer.perf import router_topk
original = router.topk_routing_with_score_function
assert router_topk.use_fused_router_topk() and router_topk.use_fused_router_topk()  # idempotent
assert router_topk.fused_router_topk_installed() and router.topk_routing_with_score_function is not original
assert router.topk_routing_with_score_function.__wrapped_original__ is original
# CPU tensors without the interpreter: megatron's code and the argsort path, unchanged
logits = torch.randn(9, 16)
probs, routing_map = router.topk_routing_with_score_function(logits, 2, score_function="softmax")
want_probs, want_map = original(logits, 2, score_function="softmax")
assert torch.equal(probs, want_probs) and torch.equal(routing_map, want_map)
assert router_topk.select_topk(logits, 2) is None and routing.routing_map_slots(routing_map, 2) is None
idx, weights = routing_to_topk(probs, routing_map, 3)
assert (idx[:, 2] == -1).all() and torch.equal(idx[:, :2], routing_map.nonzero()[:, 1].view(9, 2))
print("install ok")
"""


def test_install_is_idempotent_and_cpu_runs_megatron_code():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", INSTALL_CHECK], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and "install ok" in run.stdout, f"{run.stdout}\n{run.stderr[-4000:]}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_routing_kernels_match_megatron_gpu():
    sys.path.insert(0, str(TESTS))
    import routing_kernel_checks

    routing_kernel_checks.run_all(torch.device("cuda"))
