"""Core attention through `torch.nn.functional.scaled_dot_product_attention`, for megatron-core
models built without Transformer Engine.

Megatron's local spec uses `DotProductAttention`, which materializes the [b*heads, s, s] score
matrix (baddbmm, masked softmax, bmm) and repeats K/V for grouped-query attention. `SDPAttention`
keeps that module's constructor, attributes and forward signature (it is a subclass; only
`forward` differs) and hands the math to torch's fused kernels (flash / memory-efficient
attention on CUDA), with K/V groups read in place (`enable_gqa`). qk-layernorm, rotary embeddings
and the projections stay in `SelfAttention`, around this module.

`use_sdpa_core_attention(spec)` swaps it into a GPT block or layer spec.
"""

from __future__ import annotations

import dataclasses

import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

__all__ = ["SDPAttention", "use_sdpa_core_attention"]


class SDPAttention(DotProductAttention):
    """DotProductAttention's interface; the forward is one scaled_dot_product_attention call.

    Supported: causal or no mask (or an explicit boolean mask, True = masked out, as Megatron's),
    multi-head and grouped-query attention, any softmax scale, attention dropout (drawn under
    Megatron's RNG tracker like DotProductAttention's). Not supported (raise at construction):
    sliding-window attention and non-vanilla softmax types.
    """

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__(
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        if self.config.softmax_type != "vanilla":
            raise ValueError(f"SDPAttention: softmax_type={self.config.softmax_type!r} is not supported (vanilla only)")
        if self.scale_mask_softmax.window_size is not None:
            raise ValueError("SDPAttention: sliding-window attention is not supported")
        # DotProductAttention divides the scale by layer_number under apply_query_key_layer_scaling
        # and multiplies it back inside its fp32 softmax: the product is the plain scale.
        self.sdpa_scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        self.dropout_p = self.attention_dropout.p

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        """query [sq, b, heads, d], key / value [sk, b, groups, d] -> [sq, b, heads * d]."""
        if packed_seq_params is not None:
            raise ValueError("SDPAttention: packed sequences are not supported")
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention_bias is not supported")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b, heads, d = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, d]
        causal = mask_type == AttnMaskType.causal and attention_mask is None
        mask = None
        if attention_mask is not None and mask_type != AttnMaskType.no_mask:
            mask = ~attention_mask  # Megatron: True = masked out; SDPA: True = attend
        dropout_p = self.dropout_p if self.training else 0.0
        kwargs = dict(
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=causal,
            scale=self.sdpa_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        if dropout_p > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * d)  # [sq, b, heads * d]


def _swap_layer(layer_spec):
    attn = getattr(getattr(layer_spec, "submodules", None), "self_attention", None)
    sub = getattr(attn, "submodules", None)
    if sub is None or getattr(sub, "core_attention", None) is not DotProductAttention:
        return layer_spec
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(sub, core_attention=SDPAttention))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=attn))


def use_sdpa_core_attention(spec):
    """A copy of a GPT block spec (TransformerBlockSubmodules) or layer spec with Megatron's local
    DotProductAttention replaced by SDPAttention (Transformer Engine specs are left as they are)."""
    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(spec, layer_specs=[_swap_layer(s) for s in spec.layer_specs])
    return _swap_layer(spec)
