"""`--spec megatron_patch.hybrid_spec megamoe_hybrid_stack_spec` for Megatron-LM's HybridModel
builder, which uses the imported object as the stack spec without calling anything:
megatron-core's `hybrid_stack_spec` (Transformer Engine layers) with each MoE layer chosen when it
is built, from the config (spec.moe_layer_by_config: MegaMoE when `moe_megamoe_recipe` is set, or
for Megatron-LM's plain config when MEGAMOE_RECIPE is not "none"). A module of its own because
building it imports megatron-core's hybrid layer specs, which `import megatron_patch` should not.
From Python, use `megatron_patch.get_megamoe_hybrid_stack_spec(config, stack_spec)`.
"""

from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

from .spec import hybrid_stack_spec_by_config

megamoe_hybrid_stack_spec = hybrid_stack_spec_by_config(hybrid_stack_spec)
