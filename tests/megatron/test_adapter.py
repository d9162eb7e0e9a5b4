"""The Megatron-core adapter against Megatron's own MoE layer, on CPU processes (gloo; EP=2, and EP=4 once)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import mcore_cases as cases  # noqa: E402

EQUIVALENCE_CASES = {
    "softmax-aux-z": {},
    "shared-seqaux-groups": dict(
        moe_shared_expert_intermediate_size=96,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_router_num_groups=2,
        moe_router_group_topk=1,
        moe_router_topk_scaling_factor=1.5,
    ),
    "moe-recompute": dict(recompute_granularity="selective", recompute_modules=["moe"]),
    "full-recompute": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "sigmoid-clamp": dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        activation_func_clamp_value=0.5,
        moe_shared_expert_intermediate_size=64,
    ),
}


@pytest.mark.parametrize("case", list(EQUIVALENCE_CASES))
def test_equivalence_with_stock_moe(mcore_pool, case):
    res = mcore_pool().run(cases.equivalence, EQUIVALENCE_CASES[case])
    for r in res:
        assert r["n_grads"] > 10


def test_equivalence_bf16(mcore_pool):
    """bf16 model (Float16Module, fp32 router) against stock bf16: same up to bf16 rounding."""
    res = mcore_pool().run(cases.equivalence, dict(moe_shared_expert_intermediate_size=96), bf16=True, tol=3e-2)
    for r in res:
        assert r["n_grads"] > 10


def test_equivalence_ep4(mcore_pool):
    """EP=4 on 4 CPU processes: 8 experts, 2 per rank, shared experts, aux + z-loss."""
    res = mcore_pool(world=4).run(cases.equivalence, dict(num_moe_experts=8, moe_shared_expert_intermediate_size=96))
    assert len(res) == 4 and all(r["n_grads"] > 10 for r in res)


def test_checkpoint_roundtrip_both_ways(mcore_pool, tmp_path):
    n = mcore_pool().run(cases.checkpoint_roundtrip, str(tmp_path), dict(moe_shared_expert_intermediate_size=96))
    assert n[0] == n[1] > 10


DDP_VARIANTS = {
    "plain": {},
    "distopt-overlap": dict(distributed_optimizer=True, overlap_grad_reduce=True),
    "distopt-overlap-param-gather": dict(
        distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
    ),
}


@pytest.mark.parametrize("ddp", list(DDP_VARIANTS))
def test_expert_bias_updates_match_stock(mcore_pool, ddp):
    res = mcore_pool().run(cases.expert_bias_training, **DDP_VARIANTS[ddp])
    assert res[0]["bias"] == res[1]["bias"]  # all-reduced counts: same bias on every rank


@pytest.mark.parametrize("recompute", [None, "selective", "full-uniform", "full-block"])
def test_expert_load_matches_routing(mcore_pool, recompute):
    """Counted once per forward, also when activation recompute runs the layer again in backward."""
    overrides = {
        None: None,
        "selective": dict(recompute_granularity="selective", recompute_modules=["moe"]),
        "full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    }[recompute]
    loads = mcore_pool().run(cases.expert_load, overrides)
    assert all(sum(map(sum, l)) > 0 for l in loads)


def test_spec_called_and_uncalled(mcore_pool):
    mcore_pool().run(cases.spec_paths)


def test_megakernel_backend_registration(mcore_pool):
    assert mcore_pool().run(cases.megakernel_backend) == [True, True]


@pytest.mark.parametrize("recipe", ["fp8", "mxfp8_mxfp4"])
def test_quantized_recipes_close_to_stock(mcore_pool, recipe):
    res = mcore_pool().run(cases.quantized_recipe, recipe)
    print(recipe, res)


def test_fp8_weights_quantized_once_per_step(mcore_pool):
    """Mixed-precision optimizer (writes through .data), DDP, full recompute, 2 micro-batches."""
    res = mcore_pool().run(cases.weight_transform_once_per_step)
    assert res == [6, 6]  # 2 layers x 3 steps


def test_bf16_forward_reads_parameter_storage(mcore_pool):
    assert mcore_pool().run(cases.forward_reads_parameters) == [True, True]


def test_hybrid_model_equivalence(mcore_pool):
    """HybridModel's MoE layers through get_megamoe_hybrid_stack_spec (attention + MoE layers from
    megatron-core's local modules; its TE / Mamba layers cannot be built without TE / mamba_ssm)."""
    res = mcore_pool().run(cases.hybrid_equivalence)
    assert all(r["n_grads"] > 10 for r in res)


def test_optimizer_checkpoint_both_ways(mcore_pool, tmp_path):
    n = mcore_pool().run(cases.optimizer_checkpoint_both_ways, str(tmp_path))
    assert n[0] == n[1] > 10


@pytest.mark.parametrize("ddp", ["plain", "distopt-overlap"])
def test_expert_main_grad_written_over_instead_of_zeroed(mcore_pool, ddp):
    """megatron_patch.grad_buffers: bit for bit the main_grads of zeroed buffers, NaN-poisoned."""
    assert mcore_pool().run(cases.expert_main_grad_overwrite, **DDP_VARIANTS[ddp]) == [True, True]


@pytest.mark.parametrize("bucket_size", [4096, 8192])
@pytest.mark.parametrize("recipe", [None, "bf16"])
def test_shared_expert_weights_gathered_before_read(mcore_pool, recipe, bucket_size):
    """Distributed optimizer with overlap_param_gather and buckets small enough that a shared expert's
    weights share no bucket with a module called before mega_moe (mcore_cases.shared_expert_param_gather)."""
    assert mcore_pool().run(cases.shared_expert_param_gather, recipe, bucket_size) == [True, True]
