"""Megatron-core adapter of MegaMoE-Train: switch Megatron's MoE layers to the fused mega_moe path.

    from megatron_patch import MegaMoETransformerConfig, get_megamoe_gpt_decoder_block_spec
    config = MegaMoETransformerConfig(..., moe_megamoe_recipe="bf16")   # None = stock MoE
    model = GPTModel(config, get_megamoe_gpt_decoder_block_spec(config), ...)

Megatron-LM: `--spec megatron_patch.spec get_megamoe_gpt_decoder_block_spec`. HybridModel:
`get_megamoe_hybrid_stack_spec(config, stack_spec)`.
On CPU-only hosts call `megatron_patch.cpu_compat.apply()` first. The general speed-ups that
stand in for Transformer Engine / Apex on machines without them (fused router top-k, dense wgrad
fusion, ...) are the trainer's, not the adapter's: `megamoe_trainer/perf/`.
"""

from __future__ import annotations

from . import cpu_compat
from .config import (
    MegaMoEConfigError,
    MegaMoETransformerConfig,
    cuda_graphs_enabled,
    describe_megamoe_executor,
    max_tokens_per_rank,
    megamoe_config,
    megamoe_executor,
    validate_megamoe,
)
from .distopt_checkpoint import DistOptCheckpointError
from .distopt_checkpoint import install as _install_distopt_checkpoints
from .experts import MegaMoEExperts, invalidate_expert_weight_caches
from .megakernel import register_megakernel_backend
from .moe_layer import MegaMoEMoELayer, get_expert_load, get_peer_wait_ns, routing_to_topk
from .norms import SequenceParallelTorchNorm, sequence_parallel_norms
from .spec import (
    get_megamoe_gpt_decoder_block_spec,
    get_megamoe_gpt_layer_spec,
    get_megamoe_hybrid_stack_spec,
    get_megamoe_moe_module_spec,
)

_install_distopt_checkpoints()  # DistributedOptimizer checkpoints of MegaMoE expert weights

__all__ = [
    "DistOptCheckpointError",
    "MegaMoEConfigError",
    "MegaMoEExperts",
    "MegaMoEMoELayer",
    "MegaMoETransformerConfig",
    "SequenceParallelTorchNorm",
    "cpu_compat",
    "cuda_graphs_enabled",
    "describe_megamoe_executor",
    "get_expert_load",
    "get_peer_wait_ns",
    "get_megamoe_gpt_decoder_block_spec",
    "get_megamoe_gpt_layer_spec",
    "get_megamoe_hybrid_stack_spec",
    "get_megamoe_moe_module_spec",
    "invalidate_expert_weight_caches",
    "max_tokens_per_rank",
    "megamoe_config",
    "megamoe_executor",
    "register_megakernel_backend",
    "routing_to_topk",
    "sequence_parallel_norms",
    "validate_megamoe",
]
