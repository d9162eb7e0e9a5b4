"""The executors of the one protocol (protocol.py), by name: mega_moe(backend=...) picks one
here and runs protocol.forward / protocol.backward with it. What an executor does at each step
is backends/executor.py's contract. This package also hands weights.py (which every executor
reads) the weight-prep kernels (fp8, mxfp4), weights.supply_weight_kernels, so that it imports no backend."""

from __future__ import annotations

import warnings

from ..errors import MegaMoESlowPathWarning
from ..weights import supply_weight_kernels
from .executor import Executor
from .reference import ReferenceExecutor

BACKENDS: dict[str, Executor] = {"reference": ReferenceExecutor()}
NAMES = ("reference", "triton")


def _triton_executor() -> Executor:
    """The GPU executor (imported on first use: it needs triton and CUDA)."""
    if "triton" not in BACKENDS:
        from .triton_backend import TritonExecutor

        BACKENDS["triton"] = TritonExecutor()
    return BACKENDS["triton"]


def _weight_prep_kernels():
    """The weight-prep kernels (imported on first use: they need triton)."""
    from . import triton_weight_prep

    return triton_weight_prep


supply_weight_kernels(_weight_prep_kernels)


_warned_slow_paths: set[tuple] = set()


def gpu_executor_unsupported(config, device) -> str | None:
    """Why the GPU executor does not run calls of `config` on `device`; None where it does."""
    if device.type != "cuda":
        return f"it runs on CUDA devices only, not {device.type}"
    try:
        from .triton_backend import unsupported_reason
    except ImportError as e:  # no triton installed
        return f"its kernels cannot be imported ({type(e).__name__}: {e})"
    return unsupported_reason(config, device)


def gpu_executor_supports(config, device) -> bool:
    """Whether backend 'auto' runs the Triton GPU executor for calls of `config` on `device`."""
    return gpu_executor_unsupported(config, device) is None


def triton_supported(buffer) -> bool:
    return gpu_executor_supports(buffer.config, buffer.device)


def executor_choice(name: str, config, device) -> tuple[str, str | None]:
    """(executor name, why not the GPU executor) that backend `name` runs calls of `config` on
    `device` with; the reason is None where it runs the GPU executor or was asked for another one.
    For the adapter's and the trainer's reports, and for resolve_backend."""
    if name == "auto":
        reason = gpu_executor_unsupported(config, device)
        return ("triton", None) if reason is None else ("reference", reason)
    if name == "triton":
        reason = gpu_executor_unsupported(config, device)
        if reason is not None:
            raise ValueError(
                f"backend: 'triton' cannot run recipe {config.recipe!r} (hidden {config.hidden}, "
                f"intermediate {config.intermediate}) on {device}: {reason}; backend 'reference' runs anywhere"
            )
        return "triton", None
    if name not in NAMES:
        raise ValueError(f"backend: unknown backend {name!r}; choose 'auto' or one of {list(NAMES)}")
    return name, None


def resolve_backend(name: str, buffer) -> Executor:
    """'auto' picks the Triton GPU executor where it supports the buffer (sm90+, the recipes of
    precision.GPU_EXECUTOR_RECIPES), else the reference, which runs anywhere. On a CUDA device that
    fallback is many times slower, so it warns once per recipe, shape and reason
    (MegaMoESlowPathWarning); 'triton' raises where it cannot run the buffer's config."""
    config, device = buffer.config, buffer.device
    executor, reason = executor_choice(name, config, device)
    if reason is not None and device.type == "cuda":
        key = (config.recipe, config.hidden, config.intermediate, reason)
        if key not in _warned_slow_paths:
            _warned_slow_paths.add(key)
            warnings.warn(
                f"mega_moe: backend 'auto' runs recipe {config.recipe!r} (hidden {config.hidden}, intermediate "
                f"{config.intermediate}) on {device} through the reference executor (plain PyTorch, many times "
                f"slower): the GPU executor cannot, {reason}",
                MegaMoESlowPathWarning,
                stacklevel=3,
            )
    return executor_named(executor)


def executor_named(name: str) -> Executor:
    """The executor of that name (one of NAMES), as executor_choice names it."""
    return _triton_executor() if name == "triton" else BACKENDS[name]
