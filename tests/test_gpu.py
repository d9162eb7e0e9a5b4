"""GPU tests (marked `gpu`, skipped without CUDA): the protocol over NCCL and PyTorch symmetric
memory, one process per GPU, against the dense MoE oracle."""

import pytest
import torch
from test_mega_moe_dist import BASE, run_against_dense

pytestmark = pytest.mark.gpu


def _gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


WORLDS = [w for w in (1, 2, 4, 8) if w <= max(_gpus(), 1)]
GPU_BASE = dict(BASE, num_experts=16, hidden=256, intermediate=128, num_max_tokens_per_rank=300, block_m=64)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("recipe", ["bf16", "fp8", "mxfp8_mxfp4"])
def test_reference_over_symmetric_memory(rank_pools, world, recipe):
    cfg = dict(GPU_BASE, recipe=recipe)
    tokens = [300, 157, 0, 211, 64, 300, 5, 128][:world]
    rank_pools(world, "nccl").run(run_against_dense, cfg, tokens, seed=world, repeat=True, backend="reference")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("routing", ["masked", "one_expert", "skewed"])
def test_reference_routings_bf16(rank_pools, world, routing):
    cfg = dict(GPU_BASE, dtype=torch.bfloat16, num_shared_experts=1, activation_clamp=3.0)
    rank_pools(world, "nccl").run(
        run_against_dense, cfg, ([300, 99, 7, 250] * 2)[:world], seed=3, routing=routing, backend="reference"
    )
