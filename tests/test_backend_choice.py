"""Which executor each backend name runs, and that no call on a CUDA device falls to the reference
executor silently: backend 'auto' warns once per recipe, shape and reason, 'triton' raises, and
the reason names what the GPU executor lacks. The device is a CUDA device whose capability is
monkeypatched (these run on CPU; nothing touches the GPU)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from megamoe_train import MegaMoEConfig, MegaMoESlowPathWarning
from megamoe_train import backends as B

pytest.importorskip("triton", reason="the GPU executor's checks import triton_backend")

CUDA = torch.device("cuda", 0)


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA device of compute capability 9.0, and the 'warned once' record cleared."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(B, "_warned_slow_paths", set())
    monkeypatch.setattr(B, "_triton_executor", lambda: SimpleNamespace(name="triton"))


def config(recipe="fp8", hidden=256, intermediate=384, dtype=torch.bfloat16):
    return MegaMoEConfig(
        num_experts=8,
        hidden=hidden,
        intermediate=intermediate,
        topk=2,
        num_max_tokens_per_rank=16,
        recipe=recipe,
        dtype=dtype,
    )


def buffer(cfg, device=CUDA):
    return SimpleNamespace(config=cfg, device=device)


@pytest.mark.parametrize("recipe", ["bf16", "fp8", "fp8_e4m3_wgrad", "mxfp8_mxfp4"])
def test_gpu_recipes_run_the_gpu_executor(hopper, recipe):
    cfg = config(recipe)
    assert B.executor_choice("auto", cfg, CUDA) == ("triton", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert B.resolve_backend("auto", buffer(cfg)).name == "triton"


FP32 = torch.float32  # a compute dtype the GPU executor's kernels do not take


def test_auto_warns_once_per_recipe_and_shape_and_names_the_reason(hopper):
    cfg = config("fp8", dtype=FP32)
    executor, reason = B.executor_choice("auto", cfg, CUDA)
    assert executor == "reference" and "float32" in reason and "bf16" in reason
    with pytest.warns(MegaMoESlowPathWarning, match=r"'fp8'.*hidden 256, intermediate 384.*reference"):
        assert B.resolve_backend("auto", buffer(cfg)).name == "reference"
    with warnings.catch_warnings():  # the same recipe, shape and reason again: silent
        warnings.simplefilter("error")
        B.resolve_backend("auto", buffer(cfg))
    with pytest.warns(MegaMoESlowPathWarning, match="intermediate 512"):  # another shape warns again
        B.resolve_backend("auto", buffer(config("fp8", intermediate=512, dtype=FP32)))


def test_auto_warns_for_a_shape_the_kernels_cannot_tile(hopper):
    cfg = config("bf16", hidden=200)
    with pytest.warns(MegaMoESlowPathWarning, match="multiples of 128"):
        assert B.resolve_backend("auto", buffer(cfg)).name == "reference"


def test_auto_warns_below_hopper(monkeypatch, hopper):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.warns(MegaMoESlowPathWarning, match=r"compute capability 8\.0"):
        B.resolve_backend("auto", buffer(config("fp8")))


def test_triton_raises_where_it_cannot_run(hopper):
    with pytest.raises(ValueError, match=r"'triton' cannot run recipe 'bf16'.*float32"):
        B.resolve_backend("triton", buffer(config("bf16", dtype=FP32)))


def test_cpu_runs_the_reference_without_a_warning():
    cfg = config("mxfp8_mxfp4")
    cpu = torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert B.resolve_backend("auto", buffer(cfg, cpu)).name == "reference"
    assert B.executor_choice("reference", cfg, cpu) == ("reference", None)
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        B.executor_choice("fast", cfg, cpu)
