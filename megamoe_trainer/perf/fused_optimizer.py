"""Multi-tensor gradient norm, clipping and Adam for megatron-core without Transformer Engine / Apex.

Without TE or Apex, megatron-core 0.19.2 falls back to per-tensor Python paths
(`megatron.core.utils.local_multi_tensor_*`, used by `optimizer/clip_grads.py` and
`optimizer/optimizer.py`):
- grad norm: one `torch.norm` per gradient, then `torch.tensor(list of CUDA scalars)`, which
  reads every norm back to the host (one sync per tensor), then `float(...)` once more;
- clipping: `dst.copy_(src * scale)` per gradient (two launches each), the scale a host float;
- main -> model params after Adam: the same per-tensor copy;
- Adam: `torch.optim.AdamW` with its default (foreach) implementation.

`install()` replaces the three fallbacks (module globals of those two megatron modules, only where
megatron fell back to the local ones) by torch's `_foreach_*` kernels, and provides the
"scale by a device tensor" op, so megatron's own `get_grad_norm_fp32` keeps the norm on the device
and clips with a device-side coefficient; and it makes `ChainedOptimizer.get_grad_norm` combine
the dense and expert optimizers' norms on the device: no host sync in norm or clip. `use_fused_adam(optimizer)`
switches megatron's torch AdamW param groups to `fused=True` (one fused kernel per chunk of
tensors); megatron's OptimizerConfig has no switch for it. Both are process-global / per-optimizer
and idempotent. Numerics: the same fp32 formulas (norm of norms, grad * min(1, clip/(norm+1e-6)),
AdamW), in fused kernels.

Clipping inside Adam: megatron clips by scaling every main gradient in place (a read and a write
of all fp32 gradients) right before the optimizer reads them once more. Where the parameters
clipped are exactly those of one fused torch Adam(W) with gradients, `install()`'s clip instead
hands the coefficient to that optimizer as `grad_scale` (1 / coefficient), which torch's fused
Adam divides every gradient by as it loads it (the hook AMP's GradScaler uses), and the value is
dropped after the step. Numerics: grad / (1 / c) instead of grad * c, within an ulp where c < 1
and exact where no clipping happens (c = 1). Anything else (decoupled grads, a host norm, a
partial parameter list, a non-fused optimizer) is clipped by megatron's function as before.

Adam writing the model's bf16 params (`use_adam_writing_model_params`, CUDA): megatron's bf16
optimizer steps torch's AdamW on fp32 main params, then copies every main param into its bf16
model param (a second pass over all of them). Switched, the AdamW's step runs
`adam_kernel.adamw_update` per parameter, which writes the bf16 value as it stores the fp32 one,
and megatron's copy after that step is skipped. The optimizer state stays torch's (`step`,
`exp_avg`, `exp_avg_sq`), so checkpoints are unchanged; the step count is also kept on the host
(read once from the state, again whenever the state tensor is replaced, e.g. by a load), so the
bias corrections cost no sync.
"""

from __future__ import annotations

import torch

__all__ = ["install", "installed", "use_fused_adam", "use_adam_writing_model_params", "writes_model_params"]

_installed = False
_original_clip = None


def _l2norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for amp_C.multi_tensor_l2norm: (total norm as a [1] fp32 device tensor, None)."""
    tensors = tensor_lists[0]
    norms = torch._foreach_norm(tensors)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms])) if len(norms) else torch.zeros(())
    return total.reshape(1), None


def _scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for amp_C.multi_tensor_scale: dst = src * scale (dtype cast on copy)."""
    src, dst = tensor_lists
    if not dst:
        return
    if isinstance(scale, torch.Tensor):
        scale = scale.reshape(())  # megatron passes a [1] tensor; foreach ops take a 0-dim one
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
        return
    torch._foreach_copy_(dst, src)
    if not (isinstance(scale, (int, float)) and scale == 1.0):
        torch._foreach_mul_(dst, scale)


def _applier(op, noop_flag_buffer, tensor_lists, *args):
    return op(2048 * 32, noop_flag_buffer, tensor_lists, *args)


def _chained_grad_norm(self):
    """ChainedOptimizer.get_grad_norm without a host sync: megatron 0.19.2 combines the norms of
    optimizers with different grad-stats groups (dense and expert) by `if norm` and math.sqrt,
    which read a device norm back to the host; the same sqrt of the sum of squares, on the device."""
    if len(self.chained_optimizers) == 1 or self.grads_states_parallel_group_is_shared():
        return _original_chained_grad_norm(self)
    norms = [opt.get_grad_norm() for opt in self.chained_optimizers]
    device = next((n.device for n in norms if isinstance(n, torch.Tensor)), None)
    if device is None:
        return _original_chained_grad_norm(self)
    parts = [
        n.reshape(()).float() if isinstance(n, torch.Tensor) else torch.full((), float(n or 0.0), device=device)
        for n in norms
    ]
    return torch.stack(parts).square().sum().sqrt()


_original_chained_grad_norm = None


def _clip_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad: bool = False):
    """megatron's clip_grad_by_total_norm_fp32, the scaling deferred into fused Adam where it can be."""
    params = [p for p in parameters if p.grad is not None]
    adam = getattr(params[0], "_megamoe_fused_adam", None) if params else None
    if (
        adam is None
        or use_decoupled_grad
        or not isinstance(total_norm, torch.Tensor)
        or not all(group.get("fused") for group in adam.param_groups)
    ):
        return _original_clip(parameters, max_norm, total_norm, use_decoupled_grad)
    with_grads = {id(p) for group in adam.param_groups for p in group["params"] if p.grad is not None}
    if with_grads != {id(p) for p in params} or len(with_grads) != len(params):
        return _original_clip(parameters, max_norm, total_norm, use_decoupled_grad)
    coeff = (max_norm / (total_norm.reshape(()).float() + 1.0e-6)).clamp_max(1.0)
    adam.grad_scale = coeff.reciprocal()  # read by the next step, dropped after it (_drop_grad_scale)


def _drop_grad_scale(optimizer, args, kwargs):
    optimizer.__dict__.pop("grad_scale", None)


def installed() -> bool:
    return _installed


def install() -> bool:
    """Swap megatron's local multi-tensor fallbacks for foreach kernels; False if megatron uses
    TE / Apex kernels already (then nothing changes)."""
    global _installed
    if _installed:
        return True
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    if clip_grads.l2_norm_impl is not mcore_utils.local_multi_tensor_l2_norm:
        return False
    clip_grads.multi_tensor_applier = _applier
    clip_grads.l2_norm_impl = _l2norm
    clip_grads.multi_tensor_scale_impl = _scale
    clip_grads.multi_tensor_scale_tensor_impl = _scale  # makes get_grad_norm_fp32 keep the norm on the device
    if mcore_optimizer.multi_tensor_scale_impl is mcore_utils.local_multi_tensor_scale:
        mcore_optimizer.multi_tensor_applier = _applier
        mcore_optimizer.multi_tensor_scale_impl = _scale
    global _original_chained_grad_norm, _original_clip
    _original_chained_grad_norm = mcore_optimizer.ChainedOptimizer.get_grad_norm
    mcore_optimizer.ChainedOptimizer.get_grad_norm = _chained_grad_norm
    _original_clip = mcore_optimizer.clip_grad_by_total_norm_fp32  # optimizer.py's own name for it
    mcore_optimizer.clip_grad_by_total_norm_fp32 = _clip_by_total_norm
    _installed = True
    return True


def _torch_optimizers(optimizer):
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            yield inner


def use_fused_adam(optimizer) -> int:
    """Set fused=True on every torch Adam/AdamW param group under a megatron optimizer (call
    after building it and after loading a checkpoint, whose param groups may say otherwise).
    Moves existing `step` counters to the parameter's device, as fused Adam keeps them, and lets
    install()'s clip find each parameter's optimizer. Returns the number of param groups switched."""
    switched = 0
    for opt in _torch_optimizers(optimizer):
        if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        if not getattr(opt, "_megamoe_drops_grad_scale", False):
            opt.register_step_post_hook(_drop_grad_scale)
            opt._megamoe_drops_grad_scale = True
        for group in opt.param_groups:
            params = [p for p in group["params"]]
            if not params or any(not p.is_floating_point() for p in params):
                continue
            group["fused"] = True
            group["foreach"] = False
            for p in params:
                p._megamoe_fused_adam = opt
                state = opt.state.get(p)
                if state and "step" in state and state["step"].device != p.device:
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
            switched += 1
    return switched


class _AdamWWritingModelParams:
    """The step of one torch AdamW under megatron's bf16 optimizer, by adam_kernel.adamw_update."""

    def __init__(self, adam: torch.optim.Optimizer, model_params: dict, moments_dtype: torch.dtype = torch.float32):
        self.adam = adam
        self.model_params = model_params  # id(main param) -> its bf16 model param (fp32 params: absent)
        self.moments_dtype = moments_dtype  # exp_avg and exp_avg_sq as kept in the state
        self.host_steps: dict = {}  # id(main param) -> (the state's step tensor, its count)
        self.wrote_model_params = False

    @torch.no_grad()
    def step(self, closure=None):
        from .adam_kernel import adamw_update

        if closure is not None:
            raise ValueError("megamoe AdamW: closures are not supported")
        adam = self.adam
        grad_scale = getattr(adam, "grad_scale", None)
        if grad_scale is not None:
            grad_scale = grad_scale.reshape(1).float()
        unread = []
        for group in adam.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = adam.state[p]
                if not state:  # as torch's fused AdamW initializes it
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(
                        p, dtype=self.moments_dtype, memory_format=torch.preserve_format
                    )
                    state["exp_avg_sq"] = torch.zeros_like(
                        p, dtype=self.moments_dtype, memory_format=torch.preserve_format
                    )
                for key in ("exp_avg", "exp_avg_sq"):  # a load casts the state to the param's dtype: back, exactly
                    if state[key].dtype != self.moments_dtype:
                        state[key] = state[key].to(self.moments_dtype)
                known = self.host_steps.get(id(p))
                if known is None or known[0] is not state["step"]:
                    unread.append(p)
        if unread:  # once, and after a load replaced the state: one read of all counts
            counts = torch.stack([adam.state[p]["step"].reshape(()).float() for p in unread]).tolist()
            for p, c in zip(unread, counts):
                self.host_steps[id(p)] = (adam.state[p]["step"], int(c))
        steps = []
        for group in adam.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = adam.state[p]
                count = self.host_steps[id(p)][1] + 1
                self.host_steps[id(p)] = (state["step"], count)
                steps.append(state["step"])
                adamw_update(
                    p,
                    p.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    self.model_params.get(id(p)),
                    step=count,
                    lr=float(group["lr"]),
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    grad_scale=grad_scale,
                )
        if steps:
            torch._foreach_add_(steps, 1.0)
        _drop_grad_scale(adam, (), {})  # the hook torch's own step would have run
        self.wrote_model_params = True

    def copy_main_to_model(self, original):
        """megatron's main -> model copy, skipped right after this step wrote the model params."""

        def copy():
            if self.wrote_model_params:
                self.wrote_model_params = False
                return
            original()

        return copy


def _model_params_for_kernel(mo, adam) -> dict | None:
    """id(main param) -> its bf16 model param for every pair of megatron optimizer `mo`, where the
    kernel can step `adam` (torch's fused, decoupled-decay AdamW over contiguous fp32 CUDA params,
    contiguous model params of the same size); None where it cannot."""
    for group in adam.param_groups:
        if (
            not group.get("fused")
            or group.get("amsgrad")
            or group.get("maximize")
            or group.get("differentiable")
            or not group.get("decoupled_weight_decay", isinstance(adam, torch.optim.AdamW))
            or isinstance(group["lr"], torch.Tensor)
        ):
            return None
        for p in group["params"]:
            if p.device.type != "cuda" or p.dtype != torch.float32 or not p.is_contiguous():
                return None
    model_params = {}
    for model_group, main_group in zip(mo.float16_groups, mo.fp32_from_float16_groups):
        for model_param, main_param in zip(model_group, main_group):
            if not model_param.is_contiguous() or model_param.numel() != main_param.numel():
                return None
            model_params[id(main_param)] = model_param
    return model_params


def use_adam_writing_model_params(optimizer, moments_dtype: torch.dtype = torch.float32) -> int:
    """Under each megatron bf16 optimizer (Float16OptimizerWithFloat16Params) whose torch AdamW
    use_fused_adam switched and whose parameters are contiguous CUDA tensors: steps by the kernel
    that also writes the bf16 model params, and megatron's main -> model copy skipped after it.
    moments_dtype: exp_avg and exp_avg_sq kept in fp32 (torch's) or bf16 (adam_kernel.py); a
    state loaded from a checkpoint is converted at the next step.
    Idempotent; call after use_fused_adam. The switch is an attribute of the torch optimizer
    instance, so it survives a checkpoint load (torch's load_state_dict replaces only the state and
    the param groups, whose flags the step does not read). Returns the number of megatron
    optimizers switched by this call."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    switched = 0
    for mo in getattr(optimizer, "chained_optimizers", [optimizer]):
        if type(mo) is not Float16OptimizerWithFloat16Params or mo.is_stub_optimizer:
            continue  # the distributed optimizer copies into DDP's param buffer: not this path
        adam = mo.optimizer
        if "step" in adam.__dict__ or not isinstance(adam, torch.optim.Adam):
            continue
        model_params = _model_params_for_kernel(mo, adam)
        if model_params is None:
            continue
        stepper = _AdamWWritingModelParams(adam, model_params, moments_dtype)
        adam.step = stepper.step
        mo._copy_main_params_to_model_params = stepper.copy_main_to_model(mo._copy_main_params_to_model_params)
        switched += 1
    return switched


def writes_model_params(optimizer) -> bool:
    """Whether use_adam_writing_model_params switched any of `optimizer`'s megatron optimizers."""
    for mo in getattr(optimizer, "chained_optimizers", [optimizer]):
        step = getattr(getattr(mo, "optimizer", None), "step", None)
        if isinstance(getattr(step, "__self__", None), _AdamWWritingModelParams):
            return True
    return False
