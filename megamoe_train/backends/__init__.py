"""Backends of mega_moe. Each provides forward(buffer, ...) -> (y, saved) and
backward(buffer, saved, grad_y, ...) -> gradients with the reference backend's meaning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .reference import reference_backward, reference_forward


@dataclass(frozen=True)
class Backend:
    name: str
    forward: Callable
    backward: Callable
    checks_ids_on_device: bool = False  # False: ids are range-checked on the host before the call


BACKENDS = {"reference": Backend("reference", reference_forward, reference_backward)}
NAMES = ("reference", "triton")


def _triton_backend() -> Backend:
    """The GPU backend (imported on first use: it needs triton and CUDA)."""
    if "triton" not in BACKENDS:
        from .triton_backend import triton_backward, triton_forward

        BACKENDS["triton"] = Backend("triton", triton_forward, triton_backward, checks_ids_on_device=True)
    return BACKENDS["triton"]


def triton_supported(buffer) -> bool:
    if buffer.device.type != "cuda":
        return False
    try:
        from .triton_backend import supports
    except ImportError:  # no triton installed
        return False
    return supports(buffer)


def resolve_backend(name: str, buffer) -> Backend:
    """'auto' picks the Triton GPU backend where it supports the buffer (sm90+, bf16/fp8 recipes),
    else the reference, which runs anywhere."""
    if name == "auto":
        return _triton_backend() if triton_supported(buffer) else BACKENDS["reference"]
    if name == "triton":
        if not triton_supported(buffer):
            raise ValueError(
                f"backend: 'triton' needs a CUDA sm90+ buffer with recipe bf16/fp8, dtype bf16, hidden and "
                f"intermediate multiples of 128 and block_m 64 or 128; got {buffer.config.recipe!r} on {buffer.device}"
            )
        return _triton_backend()
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend: unknown backend {name!r}; choose 'auto' or one of {list(NAMES)}") from None
