"""Checks of megamoe_trainer.perf.adam_kernel and the AdamW step that writes the model's bf16 params,
against torch's AdamW followed by megatron's fp32 -> bf16 copy, on fresh random tensors.

Run on CPU under Triton's interpreter (tests/trainer/test_adam_kernel.py does:
`TRITON_INTERPRET=1 python tests/adam_kernel_checks.py`) and called on CUDA by the same test
file's `gpu` tests."""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megamoe_trainer.perf import fused_optimizer as fo  # noqa: E402
from megamoe_trainer.perf.adam_kernel import BLOCK, adamw_update  # noqa: E402

SHAPES = ((7, 5), (BLOCK + 3,), (3, 4, 9), (1,), (2, BLOCK))  # partial blocks, one element, whole blocks
KW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _tensors(seed, device, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*s, generator=g) * (i + 1)).to(device) for i, s in enumerate(shapes)]


def _same_copy(copy, param):
    """The bf16 copy is param rounded to nearest even: exactly on CUDA; Triton's interpreter
    converts fp32 to bf16 by its own rule (last bit may differ), so within one bf16 ulp there."""
    want = param.detach().to(torch.bfloat16)
    if copy.is_cuda:
        return torch.equal(copy, want)
    return not copy.isnan().any() and bool(((copy.float() - want.float()).abs() <= want.float().abs() * 2.0**-7).all())


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _to_bf16(x, device):
    """x rounded to bf16 as the kernel stores it: to nearest even on CUDA; Triton's interpreter
    (CPU) converts fp32 to bf16 by truncation (checked: every element of a random draw)."""
    if device != "cpu":
        return x.to(torch.bfloat16)
    return (x.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def _round_moments(optimizer, dtype, device):
    """The reference for moments kept in `dtype`: torch's fp32 step, then its state rounded as the
    kernel stores it."""
    if dtype == torch.float32:
        return
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key].copy_(_to_bf16(state[key], device).float())


def _moment_tol(device, dtype):
    """Relative tolerance of moments and params against the reference: the fp32 math agrees to
    rounding (1e-6); bf16 moments are rounded from those fp32 values the same way, except where
    the two differ in a last bit that moves a rounding boundary (rare, one bf16 step there)."""
    if dtype == torch.float32:
        return 1e-6, 1e-6
    return 1e-4, 1e-5


def check_update_matches_torch(device, moments_dtype=torch.float32):
    """adamw_update over 4 steps, with and without a grad_scale, against torch AdamW (for-loop
    implementation, same formulas; with bf16 moments its state rounded after each step); the bf16
    copy is the rounded fp32 param, every element written (the copy starts NaN)."""
    tol_moments, tol_param = _moment_tol(device, moments_dtype)
    for use_scale in (False, True):
        ref_params = [torch.nn.Parameter(t) for t in _tensors(1, device)]
        ref = torch.optim.AdamW(ref_params, **KW, foreach=False)
        params = [t.detach().clone() for t in ref_params]
        moments = [(torch.zeros_like(p, dtype=moments_dtype), torch.zeros_like(p, dtype=moments_dtype)) for p in params]
        copies = [torch.full_like(p, float("nan"), dtype=torch.bfloat16) for p in params]
        for step in range(1, 5):
            grads = _tensors(10 + step, device)
            scale = torch.tensor([1.7], device=device) if use_scale else None
            for p, g in zip(ref_params, grads):
                p.grad = g / 1.7 if use_scale else g.clone()
            ref.step()
            _round_moments(ref, moments_dtype, device)
            for p, g, (m, v), c in zip(params, grads, moments, copies):
                versions = (p._version, c._version)
                adamw_update(
                    p,
                    g,
                    m,
                    v,
                    c,
                    step=step,
                    lr=KW["lr"],
                    beta1=KW["betas"][0],
                    beta2=KW["betas"][1],
                    eps=KW["eps"],
                    weight_decay=KW["weight_decay"],
                    grad_scale=scale,
                )
                # counted as in-place writes: caches keyed on versions (the fp8 expert weights) see them
                assert p._version > versions[0] and c._version > versions[1], "versions not bumped"
        for p, q, (m, v), c in zip(ref_params, params, moments, copies):
            st = ref.state[p]
            assert m.dtype == v.dtype == moments_dtype
            assert _rel(q, p) < tol_param, ("param", use_scale, moments_dtype, _rel(q, p))
            assert _rel(m, st["exp_avg"]) < tol_moments and _rel(v, st["exp_avg_sq"]) < tol_moments, (
                "moments",
                use_scale,
                moments_dtype,
                _rel(m, st["exp_avg"]),
                _rel(v, st["exp_avg_sq"]),
            )
            assert _same_copy(c, q), ("copy", use_scale)


def check_update_without_copy_and_bad_input(device):
    p, g = _tensors(2, device, ((33,), (33,)))
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    before = p.clone()
    adamw_update(p, g, m, v, None, step=1, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
    # first step: m = 0.1 g, v = 0.05 g^2, bias-corrected to g and g^2: p -= lr * g / (|g| + eps)
    expect = before - 1e-2 * g / (g.abs() + 1e-8)
    assert _rel(p, expect) < 1e-6, _rel(p, expect)
    for bad, kwargs in (
        ("grad", dict(grad=g.double())),
        ("grad", dict(grad=g.bfloat16())),
        ("exp_avg_sq", dict(exp_avg_sq=v.half())),
        ("model_copy", dict(model_copy=torch.zeros(32, device=device))),
        ("step", dict(step=0)),
    ):
        args = dict(param=p, grad=g, exp_avg=m, exp_avg_sq=v, model_copy=None, step=2)
        args.update(kwargs)
        try:
            adamw_update(**args, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
        except ValueError as e:
            assert bad in str(e), (bad, e)
        else:
            raise AssertionError(f"bad {bad} was accepted")


def check_optimizer_step_matches_torch_and_copy(device, moments_dtype=torch.float32):
    """The stepper fo installs under megatron's bf16 optimizer, driven directly: two param groups
    (decay / no decay), one fp32 param without a model copy, the clip's grad_scale, an lr change,
    and a state_dict round trip (the step counts re-read from the new state; torch's load casts
    the moments to the params' fp32, the next step keeps them in moments_dtype again) against
    torch's fused AdamW plus megatron's copy (with bf16 moments its state rounded after each step)."""
    _, tol_param = _moment_tol(device, moments_dtype)
    ref_params = [torch.nn.Parameter(t) for t in _tensors(3, device)]
    params = [torch.nn.Parameter(t.detach().clone()) for t in ref_params]
    model = [torch.full_like(p, float("nan"), dtype=torch.bfloat16) for p in params[:-1]]  # last: an fp32 param

    def groups(ps):
        return [{"params": ps[:3], "weight_decay": 0.1}, {"params": ps[3:], "weight_decay": 0.0}]

    ref = torch.optim.AdamW(groups(ref_params), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    adam = torch.optim.AdamW(groups(params), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    stepper = fo._AdamWWritingModelParams(adam, {id(p): c for p, c in zip(params, model)}, moments_dtype)
    adam.step = stepper.step
    copied = []
    copy = stepper.copy_main_to_model(lambda: copied.append(1))
    for step in range(1, 6):
        grads = _tensors(20 + step, device)
        scale = torch.tensor(1.3, device=device) if step % 2 else None
        for p, q, g in zip(ref_params, params, grads):
            p.grad, q.grad = (g / 1.3 if scale is not None else g.clone()), g.clone()
        if step == 3:
            for gr, g2 in zip(ref.param_groups, adam.param_groups):
                gr["lr"] = g2["lr"] = 1e-3
        if scale is not None:
            adam.grad_scale = scale  # as the clip leaves it: 1 / coefficient
        ref.step()
        _round_moments(ref, moments_dtype, device)
        adam.step()
        assert "grad_scale" not in adam.__dict__
        assert all(adam.state[q][k].dtype == moments_dtype for q in params for k in ("exp_avg", "exp_avg_sq"))
        copy()  # skipped after the kernel's step
        if step == 4:  # a checkpoint round trip replaces the state tensors (and their step counts)
            adam.load_state_dict(adam.state_dict())
            assert all(adam.state[q]["exp_avg"].dtype == torch.float32 for q in params)  # torch's cast
    assert not copied
    copy()  # not right after a step: megatron's copy runs
    assert copied == [1]
    for p, q in zip(ref_params, params):
        assert _rel(q, p) < max(2e-6, tol_param), (moments_dtype, _rel(q, p))
        assert float(adam.state[q]["step"]) == 5.0
    for q, c in zip(params, model):
        assert _same_copy(c, q)


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    for moments_dtype in (torch.float32, torch.bfloat16):
        check_update_matches_torch(device, moments_dtype)
        check_optimizer_step_matches_torch_and_copy(device, moments_dtype)
    check_update_without_copy_and_bad_input(device)
    print("adam kernel checks passed")


if __name__ == "__main__":
    main()
