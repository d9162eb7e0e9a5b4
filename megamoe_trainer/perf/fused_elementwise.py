"""Fused kernels for the elementwise parts of a megatron-core GPT step without Transformer Engine.

Megatron's fused RoPE needs Transformer Engine, so without it every attention layer applies
rotary embeddings to Q and K through `rope_utils._apply_rotary_pos_emb_bshd`: cos and sin of the
frequencies, a multiply, `_rotate_half` (chunk, negate, cat), a second multiply, an add and a cat,
each a pass over Q or K in HBM, and as many again in the backward. `use_compiled_rope()` routes
that function through `torch.compile`, which fuses the same formula into one kernel per direction
(the math and the rounding points are megatron's: the compiled graph is its function).

Megatron's vocab-parallel cross entropy without fusion runs ~10 passes over the fp32 logits; its
own fused variant (`cross_entropy_loss_fusion` with `cross_entropy_fusion_impl="native"`) needs no
Transformer Engine and is switched on in `model.transformer_config`.

Both compile on the first step (tens of seconds) and only on CUDA (`perf.fused_rope`,
`perf.fused_cross_entropy`).
"""

from __future__ import annotations

import torch

__all__ = ["use_compiled_rope", "compiled_rope_installed"]

_original = None


def use_compiled_rope() -> None:
    """Route megatron's unfused bshd RoPE through torch.compile (process-global, idempotent)."""
    global _original
    from megatron.core.models.common.embeddings import rope_utils

    if _original is not None:
        return
    _original = rope_utils._apply_rotary_pos_emb_bshd
    # dynamic=False: one graph per Q/K shape of the run (a recipe has one or two)
    rope_utils._apply_rotary_pos_emb_bshd = torch.compile(_original, dynamic=False)


def compiled_rope_installed() -> bool:
    return _original is not None
