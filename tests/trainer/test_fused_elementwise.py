"""The trainer's fused elementwise paths: megatron's RoPE through torch.compile and megatron's
native fused cross entropy, against megatron's unfused functions on fresh random inputs (GPU),
and the recipe switches (CPU: off, since both compile for CUDA)."""

from __future__ import annotations

import pytest
import torch

from megamoe_trainer.model import transformer_config
from megamoe_trainer.perf import fused_elementwise
from megamoe_trainer.recipe import Recipe, runs_on_cuda

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_cross_entropy_fusion_only_on_cuda():
    r = Recipe()
    assert transformer_config(r, on_gpu=True).cross_entropy_loss_fusion
    assert not transformer_config(r).cross_entropy_loss_fusion  # CPU ranks, and the validator's config
    r.perf.fused_cross_entropy = False
    assert not transformer_config(r, on_gpu=True).cross_entropy_loss_fusion


def test_ranks_run_on_cuda_for_device_cuda_or_auto():
    r = Recipe()
    r.parallel.device = "cpu"
    assert not runs_on_cuda(r)
    for device in ("cuda", "auto"):
        r.parallel.device = device
        assert runs_on_cuda(r) == torch.cuda.is_available()


@pytest.mark.gpu
@needs_cuda
def test_compiled_rope_matches_megatron():
    from megatron.core.models.common.embeddings import rope_utils

    original = fused_elementwise._original or rope_utils._apply_rotary_pos_emb_bshd
    fused_elementwise.use_compiled_rope()
    fused_elementwise.use_compiled_rope()  # idempotent
    assert fused_elementwise.compiled_rope_installed()
    compiled = rope_utils._apply_rotary_pos_emb_bshd
    assert compiled is not original
    g = torch.Generator(device="cuda").manual_seed(3)
    s, b, h, d = 256, 2, 4, 64
    freqs = torch.rand(s, 1, 1, d, device="cuda", generator=g) * 50
    t = torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    gy = torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    out = {}
    for name, fn in (("megatron", original), ("compiled", compiled)):
        x = t.clone().requires_grad_()
        y = fn(x, freqs)
        y.backward(gy)
        out[name] = (y.detach(), x.grad)
    # the same formula; inductor keeps the intermediates in fp32 where eager rounds each op to bf16
    for a, b_ in zip(out["compiled"], out["megatron"]):
        assert not torch.isnan(a).any()
        assert _rel(a, b_) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_native_fused_cross_entropy_matches_unfused():
    import torch.distributed as dist
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if not dist.is_initialized():
        from megamoe_train.launch import free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    group = dist.new_group([0])
    g = torch.Generator(device="cuda").manual_seed(4)
    logits = torch.randn(64, 2, 1000, device="cuda", dtype=torch.bfloat16, generator=g) * 3
    labels = torch.randint(0, 1000, (64, 2), device="cuda", generator=g)
    out = {}
    for name, fn in (
        ("unfused", lambda x: vocab_parallel_cross_entropy(x, labels, tp_group=group)),
        ("fused", lambda x: fused_vocab_parallel_cross_entropy(x, labels, group)),
    ):
        x = logits.clone().requires_grad_()
        loss = fn(x)
        loss.sum().backward()
        out[name] = (loss.detach(), x.grad)
    for a, b_ in zip(out["fused"], out["unfused"]):
        assert _rel(a, b_) < 1e-2
