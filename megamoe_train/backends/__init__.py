"""The executors of the one protocol (protocol.py), by name: mega_moe(backend=...) picks one
here and runs protocol.forward / protocol.backward with it. What an executor does at each step
is backends/executor.py's contract. This package also hands weights.py (which every executor
reads) the fp8 weight-prep kernels, weights.supply_weight_kernels, so that it imports no backend."""

from __future__ import annotations

from ..precision import GPU_EXECUTOR_RECIPES
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
    """The fp8 weight-prep kernels (imported on first use: they need triton)."""
    from . import triton_weight_prep

    return triton_weight_prep


supply_weight_kernels(_weight_prep_kernels)


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


def resolve_backend(name: str, buffer) -> Executor:
    """'auto' picks the Triton GPU executor where it supports the buffer (sm90+, the recipes of
    precision.GPU_EXECUTOR_RECIPES), else the reference, which runs anywhere."""
    if name == "auto":
        return _triton_executor() if triton_supported(buffer) else BACKENDS["reference"]
    if name == "triton":
        if not triton_supported(buffer):
            raise ValueError(
                f"backend: 'triton' needs a CUDA sm90+ buffer with a recipe of {GPU_EXECUTOR_RECIPES}, "
                f"dtype bf16, hidden and "
                f"intermediate multiples of 128 and block_m 64 or 128; got {buffer.config.recipe!r} on {buffer.device}"
            )
        return _triton_executor()
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend: unknown backend {name!r}; choose 'auto' or one of {list(NAMES)}") from None
