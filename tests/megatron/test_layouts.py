"""MegaMoE layers in Megatron's parallel layouts against stock MoE layers, on CPU processes
(gloo): pipeline parallelism (1F1B and interleaved virtual stages), tensor + sequence
parallelism, both together, with expert parallelism 2 inside each stage (layout_cases)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import layout_cases as cases  # noqa: E402

# (world size, parallel_layout keywords, Megatron schedule, MoE layers per rank (4 in the model))
LAYOUTS = {
    "pp2-ep2-1f1b": (4, dict(pp=2, ep=2), "forward_backward_pipelining_without_interleaving", 2),
    "pp2-vp2-ep2-interleaved": (4, dict(pp=2, vp=2, ep=2), "forward_backward_pipelining_with_interleaving", 2),
    "tp2-sp-ep2": (4, dict(tp=2, ep=2), "forward_backward_no_pipelining", 4),
    "pp2-tp2-sp-ep2": (8, dict(pp=2, tp=2, ep=2), "forward_backward_pipelining_without_interleaving", 2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_stock(mcore_pool, tmp_path, layout):
    world, kw, schedule, moe_layers = LAYOUTS[layout]
    res = mcore_pool(world=world).run(cases.layout_training, kw, str(tmp_path))
    check_layout_results(res, schedule, moe_layers)


def check_layout_results(res, schedule, moe_layers):
    assert all(r["schedule"] == schedule and r["moe_layers"] == moe_layers for r in res), res
    last = [r for r in res if r["loss"][0]]  # the last pipeline stage reports the losses
    assert last and all(len(r["loss"]) == 2 for r in last)
    assert all(r["n_keys"] > 10 and r["checkpoint_keys"] > 10 for r in res)


def test_context_parallel_moe_layer_matches_stock(mcore_pool):
    """CP2 x EP2, the MoE layer alone (Megatron's attention needs Transformer Engine under CP)."""
    res = mcore_pool(world=4).run(cases.context_parallel_moe_layer)
    assert len(res) == 4
