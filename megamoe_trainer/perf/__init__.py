"""The general training speed-ups of `megamoe-train`: none of them is MoE work. Each stands in for a
Transformer Engine or Apex feature that a machine without those packages lacks (docs/perf.md
names which), and one recipe section, `perf`, switches them:

| `perf.` key | module | stands in for |
| --- | --- | --- |
| `fused_optimizer` | `fused_optimizer.py` | TE's / Apex's multi-tensor norm and scale, `FusedAdam` |
| `adam_writes_model_params` | `adam_kernel.py` | TE's `FusedAdam` with master weights (and bf16 moments) |
| `attention` | `attention.py` | TE's fused `DotProductAttention` |
| `fused_rope`, `fused_cross_entropy` | `fused_elementwise.py` | TE's fused RoPE and cross entropy |
| `fused_router_topk` | `router_topk.py` | TE's fused router (`moe_router_fusion`) |
| `dense_wgrad_fusion` | `dense_wgrad.py` | Apex's `fused_weight_gradient_mlp_cuda` |
| `manual_gc`, `gc_every` | `host_gc.py` | Megatron-LM's `--manual-gc` |

The functions below are the trainer's only calls into this package, in the order a rank makes
them: `install` (process-global patches, before the model is built), `core_attention` (the
layer spec), `tune_optimizer` (after the optimizer is built) and `after_checkpoint_load`,
`host_gc` (the training loop), and `describe` (the run's first line). The MoE-specific speed-ups
(CUDA graphs, fused expert wgrads, expert main_grads written over) are the adapter's
(`megatron_patch`), switched in `moe`.

Importing this package imports neither megatron-core nor Triton: the modules load on first use.
"""

from __future__ import annotations

__all__ = ["install", "core_attention", "tune_optimizer", "after_checkpoint_load", "host_gc", "describe"]


def install(perf, device: str) -> None:
    """The process-global patches of megatron-core `perf` asks for, before the model is built
    (Megatron's linear layers look for the wgrad extension in their constructors)."""
    if device == "cuda" and perf.fused_rope:
        from .fused_elementwise import use_compiled_rope

        use_compiled_rope()
    if perf.dense_wgrad_fusion:
        from .dense_wgrad import use_dense_wgrad_fusion

        use_dense_wgrad_fusion()
    if device == "cuda" and perf.fused_router_topk:
        from .router_topk import use_fused_router_topk

        use_fused_router_topk()
    if perf.fused_optimizer:
        from .fused_optimizer import install as install_fused_multi_tensor_ops

        install_fused_multi_tensor_ops()


def core_attention(perf, spec):
    """The GPT block spec with SDPA core attention unless perf.attention is 'megatron'."""
    if perf.attention == "sdpa":
        from .attention import use_sdpa_core_attention

        return use_sdpa_core_attention(spec)
    return spec


def tune_optimizer(perf, optimizer, moments_dtype: str = "fp32") -> None:
    """Fused AdamW on megatron's optimizer, and the AdamW kernel that writes the bf16 params
    (keeping its moments in `moments_dtype`, the recipe's train.adam_moments_dtype) where
    perf asks for them."""
    if not perf.fused_optimizer:
        return
    import torch

    from .fused_optimizer import use_adam_writing_model_params, use_fused_adam

    use_fused_adam(optimizer)
    if perf.adam_writes_model_params:
        bf16_moments = moments_dtype == "bf16"
        switched = use_adam_writing_model_params(optimizer, torch.bfloat16 if bf16_moments else torch.float32)
        if bf16_moments and not switched:
            raise RuntimeError(
                "train.adam_moments_dtype=bf16: the AdamW kernel that keeps bf16 moments cannot step "
                "this run's optimizer (it needs CUDA fp32 main params under megatron's bf16 optimizer)"
            )


def after_checkpoint_load(perf, optimizer) -> None:
    """A checkpoint load replaces the optimizer's param groups with the writer's flags: fused
    AdamW again (the AdamW kernel's switch is on the optimizer instance and survives the load)."""
    if perf.fused_optimizer:
        from .fused_optimizer import use_fused_adam

        use_fused_adam(optimizer)


def host_gc(perf):
    """The training loop's garbage-collection timer, collecting by hand with perf.manual_gc
    (create it after the model and the data exist: manual mode freezes what is alive then)."""
    from .host_gc import HostGC

    return HostGC(perf.manual_gc, perf.gc_every)


def describe(optimizer, moments_dtype: str = "fp32") -> str:
    """The run's first line's note on the optimizer step ('' where the AdamW kernel is off)."""
    from .fused_optimizer import writes_model_params

    if not writes_model_params(optimizer):
        return ""
    return f"AdamW kernel writes the bf16 params{' (moments in bf16)' if moments_dtype == 'bf16' else ''} | "
