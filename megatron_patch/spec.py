"""Layer specs that put MegaMoEMoELayer where Megatron's GPT specs put MoELayer.

From Python:
    spec = get_megamoe_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(config, spec, vocab_size=..., max_sequence_length=...)
Every MoE layer becomes a MegaMoEMoELayer when config.moe_megamoe_recipe is set; otherwise the
result is exactly Megatron's get_gpt_decoder_block_spec(...).

From Megatron-LM (`pretrain_gpt.py`, gpt_builders.py): `--spec megatron_patch.spec
get_megamoe_gpt_decoder_block_spec`. Megatron-LM imports that object and passes it to GPTModel
*without calling it*, so `get_megamoe_gpt_decoder_block_spec` is also a ModuleSpec (of a
transformer layer that picks its own spec from the config it is built with: dense or MoE per
moe_layer_freq, TE or local per config.transformer_impl, MoELayer swapped for MegaMoEMoELayer
when moe_megamoe_recipe is set). Config: a MegaMoETransformerConfig decides by its
`moe_megamoe_recipe`. Megatron-LM's argparse builds a plain TransformerConfig, which has no
`moe_megamoe_*` fields: choosing this spec then means MegaMoE, with the values taken from the
environment (MEGAMOE_RECIPE, default "bf16", "none" = stock; MEGAMOE_BACKEND, default "auto";
MEGAMOE_MAX_TOKENS_PER_RANK, default: fixed at the first forward; MEGAMOE_CUDA_GRAPH, default off)
and set on that config.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_decoder_layer_specs
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import BaseTransformerLayer, get_transformer_layer_offset
from megatron.core.utils import get_pg_rank

from .config import megamoe_enabled, validate_megamoe
from .moe_layer import MegaMoEMoELayer

__all__ = [
    "ensure_megamoe_fields",
    "get_megamoe_gpt_decoder_block_spec",
    "get_megamoe_gpt_layer_spec",
    "get_megamoe_hybrid_stack_spec",
    "get_megamoe_moe_module_spec",
    "hybrid_stack_spec_by_config",
    "moe_layer_by_config",
    "swap_moe_layers",
]


def _swap_mlp(mlp: Any) -> Any:
    """partial(MoELayer, ...) / ModuleSpec(MoELayer) -> the same with MegaMoEMoELayer."""
    if isinstance(mlp, functools.partial) and mlp.func is MoELayer:
        return functools.partial(MegaMoEMoELayer, *mlp.args, **mlp.keywords)
    if isinstance(mlp, ModuleSpec) and mlp.module is MoELayer:
        return dataclasses.replace(mlp, module=MegaMoEMoELayer)
    return mlp


def _swap_layer_spec(layer_spec: Any) -> Any:
    submodules = getattr(layer_spec, "submodules", None)
    mlp = getattr(submodules, "mlp", None)
    swapped = _swap_mlp(mlp)
    if swapped is mlp:
        return layer_spec
    # copies: Megatron's spec helpers may return shared objects
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(submodules, mlp=swapped))


def swap_moe_layers(spec):
    """A copy of a GPT block spec (TransformerBlockSubmodules) or layer spec (ModuleSpec) with
    every MoELayer replaced by MegaMoEMoELayer."""
    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(spec, layer_specs=[_swap_layer_spec(s) for s in spec.layer_specs])
    return _swap_layer_spec(spec)


def get_megamoe_moe_module_spec(
    config, use_te: Optional[bool] = True, num_experts: Optional[int] = None, moe_grouped_gemm: Optional[bool] = False
):
    """Megatron's get_moe_module_spec(use_te, num_experts, moe_grouped_gemm) (the MoE builder of
    HybridModel stack specs) with MoELayer -> MegaMoEMoELayer when config.moe_megamoe_recipe is set."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    spec = get_moe_module_spec(use_te=use_te, num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm)
    if not megamoe_enabled(config):
        return spec
    validate_megamoe(config)
    return _swap_mlp(spec)


def get_megamoe_hybrid_stack_spec(config, stack_spec: Optional[ModuleSpec] = None) -> ModuleSpec:
    """A HybridModel stack spec (default: megatron-core's `hybrid_stack_spec`, which needs
    Transformer Engine) whose MoE layers ('E' in the layer pattern) are MegaMoEMoELayer when
    config.moe_megamoe_recipe is set; the stack spec unchanged otherwise. Every other layer
    kind (Mamba, attention, MLP, ...) stays as the given spec builds it.

        model = HybridModel(config, get_megamoe_hybrid_stack_spec(config, my_stack_spec), vocab_size=...,
                            max_sequence_length=..., hybrid_layer_pattern="M*E...")
    """
    if stack_spec is None:
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

        stack_spec = hybrid_stack_spec
    if not megamoe_enabled(config):
        return stack_spec
    validate_megamoe(config)
    submodules = stack_spec.submodules
    return dataclasses.replace(
        stack_spec, submodules=dataclasses.replace(submodules, moe_layer=_swap_layer_spec(submodules.moe_layer))
    )


def moe_layer_by_config(*, config, submodules, **kwargs):
    """MoE-layer builder that decides when the layer is built: MegaMoEMoELayer if
    config.moe_megamoe_recipe is set (a plain TransformerConfig gets it from the environment, see
    ensure_megamoe_fields), Megatron's MoELayer otherwise. What the uncalled hybrid stack spec puts
    where Megatron's spec has `partial(MoELayer, submodules=...)`."""
    ensure_megamoe_fields(config)
    layer = MegaMoEMoELayer if megamoe_enabled(config) else MoELayer
    return layer(config=config, submodules=submodules, **kwargs)


def hybrid_stack_spec_by_config(stack_spec: ModuleSpec) -> ModuleSpec:
    """A copy of a HybridModel stack spec whose MoE layer is chosen from the config at build time
    (moe_layer_by_config): usable without a config in hand, e.g. as Megatron-LM's `--spec`."""
    submodules = stack_spec.submodules
    moe_layer = submodules.moe_layer
    mlp = getattr(getattr(moe_layer, "submodules", None), "mlp", None)
    if not (isinstance(mlp, functools.partial) and mlp.func is MoELayer):
        raise ValueError(f"stack_spec: its moe_layer's mlp is not partial(MoELayer, ...): {mlp!r}")
    swapped = functools.partial(moe_layer_by_config, *mlp.args, **mlp.keywords)
    moe_layer = dataclasses.replace(moe_layer, submodules=dataclasses.replace(moe_layer.submodules, mlp=swapped))
    return dataclasses.replace(stack_spec, submodules=dataclasses.replace(submodules, moe_layer=moe_layer))


def _build_block_spec(config, use_transformer_engine: bool = False, **kwargs) -> TransformerBlockSubmodules:
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_transformer_engine, **kwargs)
    if not megamoe_enabled(config):
        return spec
    validate_megamoe(config)
    return swap_moe_layers(spec)


def get_megamoe_gpt_layer_spec(config, layer_number: int, use_transformer_engine: bool = False, **kwargs):
    """Spec of global layer `layer_number` (1-based) of Megatron's GPT decoder, MegaMoE-swapped
    when config.moe_megamoe_recipe is set."""
    specs = get_gpt_decoder_layer_specs(config, use_transformer_engine, **kwargs)
    spec = specs[layer_number - 1]
    return swap_moe_layers(spec) if megamoe_enabled(config) else spec


def _use_te(config) -> bool:
    if getattr(config, "transformer_impl", "local") != "transformer_engine":
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def ensure_megamoe_fields(config):
    """Give a plain TransformerConfig (Megatron-LM's argparse) the moe_megamoe_* fields, from the
    environment: MEGAMOE_RECIPE (default "bf16"; "none" = stock), MEGAMOE_BACKEND (default
    "auto"), MEGAMOE_MAX_TOKENS_PER_RANK (default unset), MEGAMOE_CUDA_GRAPH ("1" / "0" /
    "auto"; default off, as MegaMoETransformerConfig's). Fields already present are kept."""
    if not hasattr(config, "moe_megamoe_recipe"):
        recipe = os.environ.get("MEGAMOE_RECIPE", "bf16").strip()
        config.moe_megamoe_recipe = None if recipe.lower() in ("", "none") else recipe
    if not hasattr(config, "moe_megamoe_backend"):
        config.moe_megamoe_backend = os.environ.get("MEGAMOE_BACKEND", "auto")
    if not hasattr(config, "moe_megamoe_max_tokens_per_rank"):
        value = os.environ.get("MEGAMOE_MAX_TOKENS_PER_RANK")
        config.moe_megamoe_max_tokens_per_rank = int(value) if value else None
    if not hasattr(config, "moe_megamoe_cuda_graph"):  # absent would read as None: graphs wherever possible
        value = os.environ.get("MEGAMOE_CUDA_GRAPH", "0").strip().lower()
        choices = {"1": True, "true": True, "0": False, "false": False, "": False, "auto": None}
        if value not in choices:
            raise ValueError(f"MEGAMOE_CUDA_GRAPH must be 1, 0 or auto, got {value!r}")
        config.moe_megamoe_cuda_graph = choices[value]
    return config


class MegaMoEGPTLayer(BaseTransformerLayer):
    """Placeholder layer class for the non-called `--spec` path: building it builds (and returns)
    the GPT decoder layer Megatron would build at this position, MegaMoE-swapped."""

    def __new__(cls, config, submodules=None, layer_number: int = 1, vp_stage=None, pg_collection=None, **kwargs):
        ensure_megamoe_fields(config)
        pp_rank = None
        if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
            pp_rank = get_pg_rank(pg_collection.pp)
        offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
        spec = get_megamoe_gpt_layer_spec(
            config,
            layer_number + offset,
            use_transformer_engine=_use_te(config),
            normalization=getattr(config, "normalization", None),
            qk_l2_norm=getattr(config, "qk_l2_norm", False),
        )
        return build_module(
            spec, config=config, layer_number=layer_number, vp_stage=vp_stage, pg_collection=pg_collection, **kwargs
        )


@dataclasses.dataclass
class _BlockSpecFunction(ModuleSpec):
    """`get_megamoe_gpt_decoder_block_spec`: a function for Python callers, and a ModuleSpec of
    MegaMoEGPTLayer for Megatron-LM's `--spec`, which uses the imported object as is."""

    def __call__(self, config, use_transformer_engine: bool = False, **kwargs) -> TransformerBlockSubmodules:
        return _build_block_spec(config, use_transformer_engine=use_transformer_engine, **kwargs)


get_megamoe_gpt_decoder_block_spec = _BlockSpecFunction(module=MegaMoEGPTLayer)
get_megamoe_gpt_decoder_block_spec.__doc__ = """get_megamoe_gpt_decoder_block_spec(config, use_transformer_engine=False,
    normalization=None, qk_l2_norm=False, vp_stage=None, pp_rank=None) -> TransformerBlockSubmodules

Megatron's get_gpt_decoder_block_spec(...) with every MoELayer replaced by MegaMoEMoELayer when
config.moe_megamoe_recipe is set (stock spec otherwise). Also usable uncalled, as Megatron-LM's
`--spec megatron_patch.spec get_megamoe_gpt_decoder_block_spec` (see the module docstring)."""
