"""The adapter cases of test_adapter.py on 2 GPUs (NCCL, CUDA symmetric memory), marked `gpu`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

import mcore_cases as cases  # noqa: E402
from test_adapter import EQUIVALENCE_CASES  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


@pytest.mark.parametrize("case", list(EQUIVALENCE_CASES))
def test_equivalence_with_stock_moe_gpu(mcore_pool, case):
    mcore_pool("nccl").run(cases.equivalence, EQUIVALENCE_CASES[case], tol=1e-4)


def test_equivalence_bf16_gpu(mcore_pool):
    mcore_pool("nccl").run(cases.equivalence, dict(moe_shared_expert_intermediate_size=96), bf16=True, tol=3e-2)


def test_cuda_graphs_auto_gpu(mcore_pool):
    """moe_megamoe_cuda_graph=None (the trainer's default): layers the GPU executor runs (bf16,
    H = I = 128) replay from CUDA graphs and match stock; layers it does not run (H = 64: the
    reference executor, as on a GPU older than sm90) stay eager and match stock too."""
    wide = dict(moe_megamoe_cuda_graph=None, hidden_size=128, ffn_hidden_size=128, moe_ffn_hidden_size=128)
    results = mcore_pool("nccl").run(cases.equivalence, wide, bf16=True, tol=3e-2)
    assert all(all(r["graphed"]) for r in results), results
    results = mcore_pool("nccl").run(cases.equivalence, dict(moe_megamoe_cuda_graph=None), tol=1e-4)
    assert not any(any(r["graphed"]) for r in results), results


def test_checkpoint_roundtrip_gpu(mcore_pool, tmp_path):
    mcore_pool("nccl").run(cases.checkpoint_roundtrip, str(tmp_path), dict(moe_shared_expert_intermediate_size=96))


def test_expert_bias_updates_match_stock_gpu(mcore_pool):
    mcore_pool("nccl").run(cases.expert_bias_training)


def test_expert_load_matches_routing_gpu(mcore_pool):
    mcore_pool("nccl").run(cases.expert_load, dict(recompute_granularity="selective", recompute_modules=["moe"]))


def test_spec_called_and_uncalled_gpu(mcore_pool):
    mcore_pool("nccl").run(cases.spec_paths)


@pytest.mark.parametrize("recipe", ["fp8", "mxfp8_mxfp4"])
def test_quantized_recipes_close_to_stock_gpu(mcore_pool, recipe):
    mcore_pool("nccl").run(cases.quantized_recipe, recipe)


def test_fp8_weights_quantized_once_per_step_gpu(mcore_pool):
    """H=I=128: the fp8 layer runs on the Triton backend here."""
    assert mcore_pool("nccl").run(cases.weight_transform_once_per_step) == [6, 6]


def test_bf16_forward_reads_parameter_storage_gpu(mcore_pool):
    assert mcore_pool("nccl").run(cases.forward_reads_parameters) == [True, True]


def test_hybrid_model_equivalence_gpu(mcore_pool):
    mcore_pool("nccl").run(cases.hybrid_equivalence, tol=1e-4)


def test_optimizer_checkpoint_both_ways_gpu(mcore_pool, tmp_path):
    mcore_pool("nccl").run(cases.optimizer_checkpoint_both_ways, str(tmp_path))
