"""SDPAttention (torch scaled_dot_product_attention) against Megatron's DotProductAttention:
same outputs and input gradients on fresh random inputs, causal / explicit mask, MHA and GQA,
default and explicit softmax scale; and the trainer's spec swaps it in everywhere."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from rank_pool import RankPool  # noqa: E402


@pytest.fixture(scope="module")
def pool():
    p = RankPool(1, "gloo", daemon=False)
    yield p
    p.close()


def _init():
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    from megatron_patch import cpu_compat

    cpu_compat.apply()
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)


def _config(**kw):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=2,
        hidden_size=96,
        num_attention_heads=6,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
    )
    base.update(kw)
    return TransformerConfig(**base)


def compare_with_megatron(rank, world, groups, explicit_mask, softmax_scale, layer_scaling):
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megamoe_trainer.perf.attention import SDPAttention

    _init()
    # on a GPU machine: CUDA tensors in bf16 (flash / efficient kernels), else CPU fp32
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype, tol = (torch.bfloat16, 2e-2) if dev.type == "cuda" else (torch.float32, 1e-5)
    cfg = _config(num_query_groups=groups, apply_query_key_layer_scaling=layer_scaling, bf16=dtype == torch.bfloat16)
    args = (cfg, 3, AttnMaskType.causal, "self")
    ref = DotProductAttention(*args, softmax_scale=softmax_scale)
    ours = SDPAttention(*args, softmax_scale=softmax_scale)
    g = torch.Generator().manual_seed(1000 + groups)
    s, b, h, d = 24, 3, 6, 16
    q = torch.randn(s, b, h, d, generator=g)
    k = torch.randn(s, b, groups, d, generator=g)
    v = torch.randn(s, b, groups, d, generator=g)
    dy = torch.randn(s, b, h * d, generator=g)
    q, k, v, dy = (t.to(dev, dtype) for t in (q, k, v, dy))
    mask = None
    if explicit_mask:  # Megatron's convention: True = masked out; causal plus a few padded keys
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        mask[:, -3:] = True
        mask[-3:, :] = False  # every query keeps at least one key
        mask = mask.expand(b, 1, s, s).to(dev)
    outs, grads = [], []
    for module in (ref, ours):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        y = module(qq, kk, vv, mask)
        y.backward(dy)
        outs.append(y.detach())
        grads.append([t.grad for t in (qq, kk, vv)])
    assert outs[1].shape == (s, b, h * d)
    err = lambda a, c: float((a.float() - c.float()).abs().max() / c.float().abs().max().clamp(min=1e-12))
    assert err(outs[1], outs[0]) < tol, err(outs[1], outs[0])
    for a, c in zip(grads[1], grads[0]):
        assert err(a, c) < tol, err(a, c)
    return True


def spec_swap(rank, world):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megamoe_trainer.perf.attention import SDPAttention, use_sdpa_core_attention

    _init()
    cfg = _config(num_moe_experts=4, moe_router_topk=2, moe_layer_freq=[0, 1])
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    swapped = use_sdpa_core_attention(spec)
    before = [s.submodules.self_attention.submodules.core_attention for s in spec.layer_specs]
    after = [s.submodules.self_attention.submodules.core_attention for s in swapped.layer_specs]
    assert before == [DotProductAttention] * 2 and after == [SDPAttention] * 2  # the original is not modified
    return True


@pytest.mark.parametrize(
    "groups,explicit_mask,softmax_scale,layer_scaling",
    [
        (6, False, None, False),  # multi-head, causal
        (2, False, None, False),  # grouped-query (3 heads per group)
        (3, True, 0.3, False),  # explicit boolean mask, explicit scale
        (6, False, None, True),  # apply_query_key_layer_scaling: the plain scale
    ],
)
def test_sdpa_matches_megatron_attention(pool, groups, explicit_mask, softmax_scale, layer_scaling):
    assert pool.run(compare_with_megatron, groups, explicit_mask, softmax_scale, layer_scaling) == [True]


def test_trainer_spec_uses_sdpa(pool):
    assert pool.run(spec_swap) == [True]
