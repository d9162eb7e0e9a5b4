"""The trainer's recipe takes its MegaMoE recipe and backend names from the one list in the core."""

import pytest

pytest.importorskip("megatron.core")


def test_recipe_and_backend_names_come_from_the_core():
    from megamoe_train.backends import NAMES
    from megamoe_train.precision import RECIPES as CORE_RECIPES
    from megamoe_trainer.recipe import MEGAMOE_RECIPES
    from megatron_patch.config import BACKENDS, RECIPES

    assert RECIPES == MEGAMOE_RECIPES == tuple(CORE_RECIPES)
    assert BACKENDS == ("auto", *NAMES) and "triton" in BACKENDS and "reference" in BACKENDS


def test_every_backend_name_passes_recipe_validation(tmp_path):
    from megamoe_trainer.recipe import load_recipe
    from megatron_patch.config import BACKENDS

    path = tmp_path / "r.yaml"
    path.write_text(
        "parallel: {world_size: 2, expert_parallel: 2, device: cpu}\n"
        "model: {hidden_size: 128, num_attention_heads: 4}\n"
        "moe: {num_experts: 8, topk: 2, ffn_hidden_size: 128}\n"
    )
    for backend in BACKENDS:
        assert load_recipe(str(path), [f"moe.megamoe_backend={backend}"]).moe.megamoe_backend == backend
