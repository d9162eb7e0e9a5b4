"""Distributed-optimizer checkpoints between stock and MegaMoE expert layers, in each format
Megatron's DistributedOptimizer writes (megatron_patch/distopt_checkpoint.py): exact in both
directions, or DistOptCheckpointError. 4 CPU processes (gloo), EP=2 x expert-DP 2."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import distopt_cases as cases  # noqa: E402
from rank_pool import RankPool  # noqa: E402


@pytest.fixture(scope="module")
def pool():
    """4 ranks of their own: the cases set up EP=2 (mcore_pool's ranks have EP=world).
    Not daemonic: Megatron's dist-checkpoint writer starts a multiprocessing Manager."""
    p = RankPool(4, "gloo", daemon=False)
    yield p
    p.close()


@pytest.mark.parametrize(
    "fmt, bucket_size, bf16",
    [("dp_reshardable", None, True), ("dp_reshardable", 6000, False), ("fully_reshardable", None, True)],
    ids=["dp_reshardable-bf16", "dp_reshardable-fp32-buckets", "fully_reshardable-bf16"],
)
def test_checkpoint_moves_between_stock_and_megamoe(pool, tmp_path, fmt, bucket_size, bf16):
    """bf16 models: the fp32 master weights are the optimizer's own tensors; fp32 with small
    buckets: several grad buckets, whose bounds differ between the two layer kinds."""
    counts = pool.run(cases.across_kinds, str(tmp_path), fmt, bucket_size, bf16)
    assert all(c == counts[0] for c in counts) and counts[0][0] == counts[0][1] > 40, counts


@pytest.mark.parametrize("fmt", ["dp_zero_gather_scatter", "fully_sharded_model_space"])
def test_unsupported_format_is_refused(pool, tmp_path, fmt):
    messages = pool.run(cases.refused, str(tmp_path), fmt)
    print(messages[0])
