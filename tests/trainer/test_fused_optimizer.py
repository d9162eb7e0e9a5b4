"""The multi-tensor shims of megamoe_trainer.fused_optimizer against plain per-tensor math, and
fused AdamW (as use_fused_adam sets it) against torch's default AdamW, on fresh random tensors."""

from __future__ import annotations

import pytest
import torch

from megamoe_trainer import fused_optimizer as fo


def _tensors(seed, shapes=((7, 5), (300,), (3, 4, 9), (1,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) * (i + 1) for i, s in enumerate(shapes)]


def test_l2norm_is_the_norm_of_all_tensors():
    ts = _tensors(1)
    norm, per_tensor = fo._l2norm(0, None, [ts], False)
    expect = torch.cat([t.flatten() for t in ts]).norm()
    assert per_tensor is None and norm.shape == (1,)
    assert torch.allclose(norm[0], expect, rtol=1e-6)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_scale_in_place_and_copy(as_tensor):
    ts = _tensors(2)
    expect = [t * 0.37 for t in ts]
    scale = torch.tensor([0.37]) if as_tensor else 0.37
    fo._scale(0, None, [ts, ts], scale)  # in place, as megatron's clip does
    for a, b in zip(ts, expect):
        assert torch.equal(a, b)
    src = _tensors(3)
    dst = [torch.full_like(t, float("nan"), dtype=torch.bfloat16) for t in src]  # poisoned
    fo._scale(0, None, [src, dst], 1.0)  # main -> model params (fp32 -> bf16)
    for a, b in zip(dst, src):
        assert torch.equal(a, b.to(torch.bfloat16))


class _Holder:
    def __init__(self, opt):
        self.optimizer = opt


def test_fused_adamw_matches_default_adamw():
    ref_params = [torch.nn.Parameter(t) for t in _tensors(4)]
    params = [torch.nn.Parameter(t.clone()) for t in ref_params]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_params, **kw)
    opt = torch.optim.AdamW(params, **kw)
    assert fo.use_fused_adam(_Holder(opt)) == 1
    assert opt.param_groups[0]["fused"] is True
    for step in range(3):
        grads = _tensors(10 + step)
        for p, q, g in zip(ref_params, params, grads):
            p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
    for p, q in zip(ref_params, params):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (p - q).abs().max()
