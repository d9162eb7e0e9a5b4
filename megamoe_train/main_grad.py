"""Gradient-accumulation fusion: expert weight gradients written straight into `main_grad`.

Megatron's DDP (like Transformer Engine) gives each parameter a `main_grad` (fp32, a view into
its grad buffer) and adds every micro-batch's `.grad` into it from a hook, unless the layer
already did and set `grad_added_to_main_grad = True`. mega_moe's wgrad GEMMs do that in their
epilogue (fuse_wgrad_accumulation).

One more flag, ours: `overwrite_main_grad = True` on a weight says its main_grad holds stale
values, not a running sum (the grad buffer was not zeroed for this step). The next backward
then writes the gradient over main_grad instead of adding to it and clears the flag, so a
later micro-batch of the step adds again. This saves the buffer's zeroing and the GEMM's read
of main_grad (8 bytes per expert weight per step). Whoever sets the flag (the Megatron
adapter's grad buffers, megatron_patch/grad_buffers.py) guarantees that the weight's next
backward is a fused mega_moe backward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class WgradTarget(NamedTuple):
    """Where an expert weight's gradient goes instead of being returned: added into `tensor`, or
    written over it (`overwrite`)."""

    tensor: torch.Tensor
    overwrite: bool = False

    def put(self, grad: torch.Tensor) -> None:
        """The unfused way: grad (any float dtype) into the target."""
        if self.overwrite:
            self.tensor.copy_(grad)
        else:
            self.tensor.add_(grad)


def wgrad_targets(*weights: torch.Tensor) -> tuple[WgradTarget, ...]:
    """The weights' main_grad targets for one backward. The overwrite requests stay until
    `overwrite_done`, called once the backward has run: a backward that raises before writing
    leaves them, so the retried micro-batch still writes over the stale main_grad."""
    return tuple(WgradTarget(w.main_grad, bool(getattr(w, "overwrite_main_grad", False))) for w in weights)


def overwrite_done(*weights: torch.Tensor) -> None:
    """The weights' gradients are in main_grad: later backwards of the step add to them."""
    for w in weights:
        w.overwrite_main_grad = False


def wants_overwrite(*weights: torch.Tensor) -> bool:
    """Whether the next backward of these weights writes over their main_grad (all or none)."""
    flags = {bool(getattr(w, "overwrite_main_grad", False)) for w in weights}
    if len(flags) > 1:
        raise ValueError("overwrite_main_grad must be set on all of a layer's expert weights or on none")
    return flags.pop()


def placeholder_grad(weight: torch.Tensor) -> torch.Tensor:
    """The gradient returned for a weight whose gradient went into weight.main_grad: Megatron's
    (and Transformer Engine's) convention: grad_added_to_main_grad = True tells the gradient hook
    not to add .grad again, so .grad is left uninitialized (zeros if zero_out_wgrad is set).
    A weight may carry the tensor to return (`placeholder`, graphs.py: one for both captured
    backward graphs of a layer rather than a weight-sized tensor in each)."""
    weight.grad_added_to_main_grad = True
    kept = getattr(weight, "placeholder", None)
    if kept is not None:
        return kept
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(weight.shape, dtype=weight.dtype, device=weight.device)
