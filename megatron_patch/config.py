"""MegaMoETransformerConfig: Megatron's TransformerConfig plus the switch for the fused MoE layer.

Switch it on with `moe_megamoe_recipe` ("bf16", "fp8", "fp8_e4m3_wgrad" or "mxfp8_mxfp4"); None keeps Megatron's
stock MoE layer. `validate_megamoe(config)` rejects every setting mega_moe cannot reproduce
exactly, naming the setting; it also works on a plain TransformerConfig that has the
`moe_megamoe_*` attributes set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megamoe_train import MegaMoEConfig
from megamoe_train.backends import NAMES as _BACKEND_NAMES
from megamoe_train.backends import executor_choice, gpu_executor_supports
from megamoe_train.precision import RECIPES as _RECIPES

RECIPES = tuple(_RECIPES)  # "bf16", "fp8", "fp8_e4m3_wgrad", "mxfp8_mxfp4"
BACKENDS = ("auto", *_BACKEND_NAMES)  # every name mega_moe(backend=...) takes


class MegaMoEConfigError(ValueError):
    """A Megatron setting that the MegaMoE layer does not support."""


@dataclass
class MegaMoETransformerConfig(TransformerConfig):
    """TransformerConfig with the MegaMoE switch.

    moe_megamoe_recipe: None = Megatron's stock MoE layer; "bf16" / "fp8" / "fp8_e4m3_wgrad" / "mxfp8_mxfp4" = every
      MoE layer runs routed and shared experts through megamoe_train.mega_moe with that recipe.
    moe_megamoe_backend: mega_moe backend ("auto" picks the fastest available on the device).
    moe_megamoe_max_tokens_per_rank: most tokens one rank passes to one MoE layer call; sizes the
      symmetric buffer. None: fixed at the first forward to the largest token count any rank of
      the expert-parallel group passes (one all-reduce(max) then). In Megatron training every
      call has seq_length * micro_batch_size / context_parallel_size tokens per rank (divided
      again by tensor_model_parallel_size under sequence parallelism); see
      `max_tokens_per_rank(...)`. Set it explicitly if later calls can be larger (evaluation
      with a bigger micro batch, variable sequence lengths): a larger call raises
      MegaMoEInputError on every rank.
    moe_megamoe_cuda_graph: replay each MoE layer's mega_moe call from a CUDA graph captured at
      its first training call (megamoe_train.graphs): the host issues two graph launches instead
      of ~100 kernels and ops per call. Needs CUDA, the stacked expert parameters (the default
      MegaMoEExperts, not the megakernel backend), no activation recompute of the MoE layer, no
      pipeline parallelism and no repeated MTP layer (one forward in flight per layer), no shared
      experts under tensor parallelism (their weights are gathered per call), and the
      GPU executor (a call
      that resolves to the reference cannot be captured: True then raises at the first call).
      None: on wherever all of that holds (`cuda_graphs_enabled`), off elsewhere.
    moe_megamoe_fuse_wgrad_accumulation: the expert weight gradients go straight into the stacked
      parameters' `main_grad` (Megatron DDP's accumulator), added in the wgrad GEMM's epilogue on
      the GPU backend, and `grad_added_to_main_grad` tells DDP's hook to skip its own add (the
      convention of Megatron's gradient_accumulation_fusion, which needs APEX for dense layers;
      this one covers the MegaMoE experts only). Needs Megatron DDP (main_grad on the weights)
      and the stacked expert parameters; with moe_megamoe_cuda_graph the captured backward adds
      into main_grad (whose storage must stay put, as DDP's grad buffer does).
    """

    moe_megamoe_recipe: Optional[str] = None
    moe_megamoe_backend: str = "auto"
    moe_megamoe_max_tokens_per_rank: Optional[int] = None
    moe_megamoe_cuda_graph: Optional[bool] = False
    moe_megamoe_fuse_wgrad_accumulation: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.moe_megamoe_recipe is not None:
            validate_megamoe(self)


def megamoe_enabled(config) -> bool:
    return getattr(config, "moe_megamoe_recipe", None) is not None


def max_tokens_per_rank(
    seq_length: int,
    micro_batch_size: int,
    *,
    context_parallel_size: int = 1,
    tensor_model_parallel_size: int = 1,
    sequence_parallel: bool = False,
) -> int:
    """Tokens one rank passes to an MoE layer per micro batch in Megatron training."""
    tokens = seq_length * micro_batch_size // max(1, context_parallel_size)
    if sequence_parallel:
        tokens //= max(1, tensor_model_parallel_size)
    return tokens


def _get(config, name, default=None):
    return getattr(config, name, default)


def validate_megamoe(config) -> None:
    """Raise MegaMoEConfigError naming the first setting the MegaMoE layer cannot honour."""

    def bad(setting, why):
        raise MegaMoEConfigError(f"{setting}: {why} (MegaMoE layer, moe_megamoe_recipe={config.moe_megamoe_recipe!r})")

    recipe = config.moe_megamoe_recipe
    if recipe not in RECIPES:
        bad("moe_megamoe_recipe", f"must be one of {RECIPES} or None, got {recipe!r}")
    if _get(config, "moe_megamoe_backend", "auto") not in BACKENDS:
        bad("moe_megamoe_backend", f"must be one of {BACKENDS}, got {config.moe_megamoe_backend!r}")
    mt = _get(config, "moe_megamoe_max_tokens_per_rank")
    if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt <= 0):
        bad("moe_megamoe_max_tokens_per_rank", f"must be a positive int or None, got {mt!r}")
    E = config.num_moe_experts
    if not E:
        bad("num_moe_experts", "must be set: MegaMoE replaces MoE layers")
    ep = config.expert_model_parallel_size or 1
    if E % ep:
        bad("num_moe_experts", f"{E} is not divisible by expert_model_parallel_size={ep}")
    # Tensor parallelism: attention and dense layers split, each TP rank's sequence shard
    # dispatched through MegaMoE on its own (sequence parallelism); the experts are not split.
    tp = config.tensor_model_parallel_size or 1
    if (config.expert_tensor_parallel_size or 1) > 1:
        bad(
            "expert_tensor_parallel_size",
            f"must be 1, got {config.expert_tensor_parallel_size}: experts are not split (Megatron defaults it "
            "to tensor_model_parallel_size; set it to 1, and pass expert_tensor_parallel_size=1 to "
            "initialize_model_parallel)",
        )
    if tp > 1 and not config.sequence_parallel:
        bad(
            "sequence_parallel",
            f"must be True with tensor_model_parallel_size={tp}: each TP rank dispatches its own sequence "
            "shard (without it every TP rank would hold the same tokens)",
        )
    # token dropping / capacity
    if config.moe_expert_capacity_factor is not None:
        bad("moe_expert_capacity_factor", "token dropping is not supported; leave it None")
    if _get(config, "moe_expert_rank_capacity_factor") is not None and config.moe_token_dispatcher_type == "flex":
        # the flex dispatchers drop (hybridep) or refuse (ncclep) tokens past this per-rank budget
        bad(
            "moe_expert_rank_capacity_factor",
            "per-rank token budgets (dropping past them) are not supported; leave it None",
        )
    if config.moe_pad_expert_input_to_capacity:
        bad("moe_pad_expert_input_to_capacity", "not supported")
    if _get(config, "moe_token_dropping"):
        bad("moe_token_dropping", "not supported")
    if config.moe_router_padding_for_quantization:
        bad("moe_router_padding_for_quantization", "not supported: MegaMoE pads expert blocks itself")
    # expert MLP math must be SwiGLU without biases
    if not config.gated_linear_unit:
        bad("gated_linear_unit", "must be True (experts are SwiGLU)")
    if config.activation_func is not F.silu:
        name = getattr(config.activation_func, "__name__", repr(config.activation_func))
        bad("activation_func", f"must be torch.nn.functional.silu (SwiGLU), got {name}")
    if config.glu_linear_offset:
        bad("glu_linear_offset", f"must be 0, got {config.glu_linear_offset}")
    if config.add_bias_linear:
        bad(
            "add_bias_linear",
            "expert / shared-expert biases are not supported; set add_bias_linear=False (--disable-bias-linear)",
        )
    if config.moe_apply_probs_on_input:
        bad("moe_apply_probs_on_input", "not supported: MegaMoE applies the router weight after SwiGLU")
    if config.moe_latent_size:
        bad("moe_latent_size", "latent MoE projections are not supported")
    if _get(config, "moe_mlp_glu_interleave_size"):
        bad("moe_mlp_glu_interleave_size", "not supported: fc1 must be [gate; up]")
    if _get(config, "moe_single_grouped_weight"):
        bad("moe_single_grouped_weight", "not supported: per-expert weights are expected")
    # shared experts
    if config.moe_shared_expert_intermediate_size is not None:
        if config.moe_shared_expert_gate:
            bad("moe_shared_expert_gate", "shared-expert gate is not supported")
        if config.moe_shared_expert_overlap:
            bad(
                "moe_shared_expert_overlap",
                "not needed and not supported: shared experts are fused into the MegaMoE call",
            )
        if _get(config, "use_grouped_gemm_for_shared_expert"):
            bad("use_grouped_gemm_for_shared_expert", "not supported")
    # execution features that drive MoELayer through paths MegaMoE does not implement
    for name in ("overlap_moe_expert_parallel_comm", "overlap_dispatch_backward_with_experts_wgrad", "moe_paged_stash"):
        if _get(config, name):
            bad(name, "not supported")
    if _get(config, "transformer_impl") == "inference_optimized":
        bad("transformer_impl", "'inference_optimized' is not supported")
    megamoe_config(config)  # the recipe's shape rules, under Megatron's names
    conflict = _graph_conflict(config)
    if _get(config, "moe_megamoe_cuda_graph") and conflict:
        bad("moe_megamoe_cuda_graph", conflict)
    if _get(config, "cuda_graph_impl", "none") not in (None, "none"):
        bad(
            "cuda_graph_impl",
            f"CUDA-graph capture ({config.cuda_graph_impl!r}) of MegaMoE layers is not supported; use 'none'",
        )


# MegaMoEConfig field -> the Megatron setting it comes from
_SHAPE_SETTINGS = {
    "hidden": "hidden_size",
    "intermediate": "moe_ffn_hidden_size",
    "topk": "moe_router_topk",
    "num_experts": "num_moe_experts",
    "num_shared_experts": "moe_shared_expert_intermediate_size",
    "shared_intermediate": "moe_shared_expert_intermediate_size",
    "activation_clamp": "activation_func_clamp_value",
    "num_max_tokens_per_rank": "moe_megamoe_max_tokens_per_rank",
    "recipe": "moe_megamoe_recipe",
    "dtype": "params_dtype",
}


def _graph_conflict(config) -> Optional[str]:
    """Why a graphed MegaMoE layer cannot run under this config (it holds one forward in flight,
    megamoe_train.graphs), or None."""
    if (_get(config, "pipeline_model_parallel_size", 1) or 1) > 1:
        return "needs pipeline_model_parallel_size = 1 (a graphed layer holds one forward in flight)"
    if (_get(config, "tensor_model_parallel_size", 1) or 1) > 1 and _get(config, "moe_shared_expert_intermediate_size"):
        # a graph replays fixed inputs; the gathered shared weights are new tensors every call
        return (
            "cannot be combined with shared experts under tensor_model_parallel_size > 1 (their TP-split "
            "weights are all-gathered at every call)"
        )
    if _get(config, "recompute_granularity") is not None:
        return f"cannot be combined with activation recompute (recompute_granularity={config.recompute_granularity!r})"
    if _get(config, "mtp_use_repeated_layer") and (_get(config, "mtp_num_layers") or 0) > 1:
        # the one MTP layer (MoE where the decoder's last layer is) runs mtp_num_layers forwards before any backward
        return (
            "cannot be combined with a repeated MTP layer "
            f"(mtp_use_repeated_layer, mtp_num_layers={config.mtp_num_layers})"
        )
    return None


def cuda_graphs_enabled(config, mm_config: MegaMoEConfig, device: torch.device) -> bool:
    """Whether a MegaMoE layer of this config replays its calls of `mm_config` on `device` from
    CUDA graphs: moe_megamoe_cuda_graph as set (on CUDA), or where it is None, wherever that can
    work: the GPU executor runs the call, no pipeline parallelism, no activation recompute, no
    repeated MTP layer."""
    setting = _get(config, "moe_megamoe_cuda_graph")
    if device.type != "cuda":
        return False
    if setting is not None:
        return bool(setting)
    if _graph_conflict(config):
        return False
    return _get(config, "moe_megamoe_backend", "auto") in ("auto", "triton") and gpu_executor_supports(
        mm_config, device
    )


def megamoe_executor(config, device: torch.device, dtype: Optional[torch.dtype] = None) -> tuple[str, Optional[str]]:
    """(executor, why not the GPU executor) that a MegaMoE layer of this config runs on `device`:
    backends.executor_choice of its moe_megamoe_backend (the reason is None where it runs the GPU
    executor or was asked for another one). Raises where backend 'triton' cannot run it."""
    mm_config = megamoe_config(config, dtype=dtype or _get(config, "params_dtype") or torch.bfloat16)
    return executor_choice(_get(config, "moe_megamoe_backend", "auto"), mm_config, device)


def describe_megamoe_executor(config, device: torch.device, dtype: Optional[torch.dtype] = None) -> str:
    """One phrase for logs: 'triton', or 'reference (the GPU executor cannot: <reason>)'."""
    executor, reason = megamoe_executor(config, device, dtype)
    slow = reason is not None and device.type == "cuda"  # on CPU the reference is the only executor
    return f"{executor} (the GPU executor cannot: {reason})" if slow else executor


def megamoe_config(
    config, *, num_max_tokens_per_rank: Optional[int] = None, dtype: torch.dtype = torch.bfloat16
) -> MegaMoEConfig:
    """The MegaMoEConfig of a MoE layer built from Megatron's config: the one translation.

    config: a TransformerConfig (or anything with its field names) with `moe_megamoe_recipe` set.
    num_max_tokens_per_rank: the buffer's token capacity; None takes
    config.moe_megamoe_max_tokens_per_rank, or 1 when that is unset too (enough to check shapes;
    the layer passes the value it agreed on at its first forward). dtype: the activations' dtype.
    The expert width falls back to ffn_hidden_size as Megatron's own __post_init__ does.
    Raises MegaMoEConfigError naming the Megatron setting whose value MegaMoE cannot take.
    """
    shared = config.moe_shared_expert_intermediate_size
    tokens = num_max_tokens_per_rank or _get(config, "moe_megamoe_max_tokens_per_rank") or 1
    try:
        return MegaMoEConfig(
            num_experts=config.num_moe_experts,
            hidden=config.hidden_size,
            intermediate=config.moe_ffn_hidden_size or config.ffn_hidden_size,
            topk=config.moe_router_topk,
            num_max_tokens_per_rank=tokens,
            recipe=config.moe_megamoe_recipe,
            num_shared_experts=1 if shared else 0,
            shared_intermediate=shared or None,
            activation_clamp=config.activation_func_clamp_value,
            dtype=dtype,
        )
    except ValueError as e:
        field, _, why = str(e).partition(":")
        setting = _SHAPE_SETTINGS.get(field.strip(), field.strip())
        raise MegaMoEConfigError(
            f"{setting}: {why.strip()} (MegaMoE layer, moe_megamoe_recipe={config.moe_megamoe_recipe!r})"
        ) from None
