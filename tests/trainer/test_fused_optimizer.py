"""The multi-tensor shims of megamoe_trainer.perf.fused_optimizer against plain per-tensor math, and
fused AdamW (as use_fused_adam sets it) against torch's default AdamW, on fresh random tensors."""

from __future__ import annotations

import pytest
import torch

from megamoe_trainer.perf import fused_optimizer as fo


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


def _adam_pair(seed):
    """(reference AdamW, its params), (AdamW set up by use_fused_adam, its params): equal starts."""
    ref_params = [torch.nn.Parameter(t) for t in _tensors(seed)]
    params = [torch.nn.Parameter(t.clone()) for t in ref_params]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_params, **kw, fused=True)
    opt = torch.optim.AdamW(params, **kw)
    fo.use_fused_adam(_Holder(opt))
    return (ref, ref_params), (opt, params)


@pytest.mark.parametrize("max_norm_ratio", [0.3, 2.0])  # clipping, and a coefficient clamped to 1
def test_clip_deferred_into_fused_adam(max_norm_ratio):
    """install()'s clip hands the coefficient to fused Adam as grad_scale instead of scaling the
    gradients: the steps match megatron's clip (grads * c, then Adam) within an ulp's effect, bit
    for bit without clipping; the gradients are not touched by the clip; grad_scale is dropped
    after each step."""
    (ref, ref_params), (opt, params) = _adam_pair(20)
    for step in range(3):
        grads = _tensors(30 + step)
        for p, q, g in zip(ref_params, params, grads):
            p.grad, q.grad = g.clone(), g.clone()
        norm = torch.cat([g.flatten() for g in grads]).norm()
        max_norm = float(norm) * max_norm_ratio
        coeff = (max_norm / (norm + 1.0e-6)).clamp_max(1.0)
        for p in ref_params:  # megatron's clip: every gradient scaled in place
            p.grad.mul_(coeff)
        ref.step()
        fo._clip_by_total_norm(params, max_norm, norm.reshape(1))
        for q, g in zip(params, grads):
            assert torch.equal(q.grad, g)
        assert "grad_scale" in opt.__dict__
        opt.step()
        assert "grad_scale" not in opt.__dict__
    for p, q in zip(ref_params, params):
        if max_norm_ratio >= 1:
            assert torch.equal(p, q)
        else:
            assert torch.allclose(p, q, rtol=1e-6, atol=1e-7), (p - q).abs().max()


def test_clip_falls_back_to_megatron_where_it_cannot_defer(monkeypatch):
    """A parameter list that is not the optimizer's whole set with gradients, a host norm, or
    decoupled grads: megatron's clip runs and no grad_scale is left."""
    calls = []
    monkeypatch.setattr(fo, "_original_clip", lambda *args: calls.append(args))
    _, (opt, params) = _adam_pair(21)
    for p, g in zip(params, _tensors(40)):
        p.grad = g
    norm = torch.tensor([3.0])
    fo._clip_by_total_norm(params[:2], 1.0, norm)  # partial list
    fo._clip_by_total_norm(params, 1.0, 3.0)  # host norm
    fo._clip_by_total_norm(params, 1.0, norm, True)  # decoupled grads
    plain = [torch.nn.Parameter(t) for t in _tensors(41)]
    for p in plain:
        p.grad = torch.ones_like(p)
    fo._clip_by_total_norm(plain, 1.0, norm)  # parameters of no fused Adam
    assert len(calls) == 4 and "grad_scale" not in opt.__dict__
