"""Executors of the one protocol (protocol.py), by name. Each Backend's forward / backward is
the protocol run with that executor's row movement and expert math."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

from .. import protocol
from ..precision import GPU_EXECUTOR_RECIPES
from .reference import ReferenceExecutor


@dataclass(frozen=True)
class Backend:
    name: str
    forward: Callable
    backward: Callable
    checks_ids_on_device: bool = False  # False: ids are range-checked on the host before the call


def _backend(executor) -> Backend:
    return Backend(executor.name, partial(protocol.forward, executor), partial(protocol.backward, executor),
                   executor.checks_ids_on_device)


BACKENDS = {"reference": _backend(ReferenceExecutor())}
NAMES = ("reference", "triton")


def _triton_backend() -> Backend:
    """The GPU executor (imported on first use: it needs triton and CUDA)."""
    if "triton" not in BACKENDS:
        from .triton_backend import TritonExecutor

        BACKENDS["triton"] = _backend(TritonExecutor())
    return BACKENDS["triton"]


def triton_supported(buffer) -> bool:
    return gpu_executor_supports(buffer.config, buffer.device)


def gpu_executor_supports(config, device) -> bool:
    """Whether backend 'auto' runs the Triton GPU executor for calls of `config` on `device`."""
    if device.type != "cuda":
        return False
    try:
        from .triton_backend import supports_config
    except ImportError:  # no triton installed
        return False
    return supports_config(config, device)


def resolve_backend(name: str, buffer) -> Backend:
    """'auto' picks the Triton GPU executor where it supports the buffer (sm90+, the recipes of
    precision.GPU_EXECUTOR_RECIPES), else the reference, which runs anywhere."""
    if name == "auto":
        return _triton_backend() if triton_supported(buffer) else BACKENDS["reference"]
    if name == "triton":
        if not triton_supported(buffer):
            raise ValueError(
                f"backend: 'triton' needs a CUDA sm90+ buffer with a recipe of {GPU_EXECUTOR_RECIPES}, dtype bf16, hidden and "
                f"intermediate multiples of 128 and block_m 64 or 128; got {buffer.config.recipe!r} on {buffer.device}"
            )
        return _triton_backend()
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend: unknown backend {name!r}; choose 'auto' or one of {list(NAMES)}") from None
