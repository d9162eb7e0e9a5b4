import pytest
import torch

from megamoe_train import RECIPES, MegaMoEConfig

OK = dict(num_experts=8, hidden=256, intermediate=128, topk=2, num_max_tokens_per_rank=64)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_valid_configs(recipe):
    cfg = MegaMoEConfig(**OK, recipe=recipe)
    assert cfg.precision.name == recipe
    assert cfg.experts_per_rank(4) == 2


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(num_experts=0), "num_experts"),
        (dict(topk=9), "topk"),
        (dict(hidden=-1), "hidden"),
        (dict(num_max_tokens_per_rank=1.5), "num_max_tokens_per_rank"),
        (dict(recipe="int4"), "recipe"),
        (dict(recipe="fp8", hidden=200), "hidden"),
        (dict(recipe="fp8", intermediate=96), "intermediate"),
        (dict(recipe="mxfp8_mxfp4", hidden=48), "hidden"),
        (dict(intermediate=12), "intermediate"),
        (dict(block_m=24), "block_m"),
        (dict(dtype=torch.int32), "dtype"),
        (dict(shared_intermediate=64), "shared_intermediate"),
        (dict(num_shared_experts=-1), "num_shared_experts"),
        (dict(activation_clamp=0.0), "activation_clamp"),
        (dict(activation_clamp="1.5"), "activation_clamp"),  # float() takes it; clamp() did not
        (dict(activation_clamp="x"), "activation_clamp"),
        (dict(activation_clamp=float("nan")), "activation_clamp"),
        (dict(num_shared_experts=True), "num_shared_experts"),
    ],
)
def test_invalid_configs_name_the_field(change, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        MegaMoEConfig(**{**OK, **change})


def test_shared_width_and_group_divisibility():
    cfg = MegaMoEConfig(**OK, num_shared_experts=2, shared_intermediate=64)
    assert cfg.shared_width == 128
    assert MegaMoEConfig(**OK, num_shared_experts=1).shared_width == 128
    with pytest.raises(ValueError, match="num_experts"):
        cfg.experts_per_rank(3)
