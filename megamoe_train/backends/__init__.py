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


def resolve_backend(name: str, device: torch.device) -> Backend:
    """'auto' picks the fastest backend that supports the device; the reference runs anywhere."""
    if name == "auto":
        return BACKENDS["reference"]
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend: unknown backend {name!r}; choose 'auto' or one of {sorted(BACKENDS)}") from None
