"""Run megatron-core 0.19 on CPU-only hosts (gloo): a small, isolated set of shims.

Megatron calls CUDA in places that have nothing to do with the math: the RNG tracker, the
alltoall dispatcher's side stream, grad buffers and optimizer state created on
`torch.cuda.current_device()`, hard-coded `device='cuda'`, and asserts on
`tensor.type() == 'torch.cuda.FloatTensor'`. `apply()` redirects all of these to the CPU so the
same model, DDP, optimizer and dist-checkpointing code runs between gloo processes.

It is only for CPU-only processes (tests, CPU demos): `apply()` does nothing when CUDA is
available, and it is idempotent. Everything it changes is process-global (monkeypatches on
`torch.cuda` and megatron) or, for the device rewrite, a TorchFunctionMode entered on the calling
thread for the life of the process; `remove_device_mode()` leaves that mode again.
Call it before building any Megatron object (before `model_parallel_cuda_manual_seed`).

What each shim fixes (megatron-core 0.19.2 paths):
1. RNG tracker (tensor_parallel/random.py): the "cuda" RNG states are the CPU generator's.
2. torch.cuda.Stream/Event/current_stream/... (moe/token_dispatcher.py alltoall side stream):
   inert stand-ins.
3. torch.cuda.current_device() (DDP grad buffers, router buffers): returns "cpu".
4. device='cuda' keywords, Tensor.cuda(), Tensor.to('cuda') (optimizer, clip_grads): kept on CPU;
   Tensor.type() reports 'torch.cuda.<X>' for the dtype asserts of the optimizers.
5. moe_utils.maybe_move_tensor_to_cpu: only converted CUDA tensors to numpy, so gloo's
   all_to_all_single received tensors as split sizes; it now always honours as_numpy.
6. Shim 4 is inactive inside loss.backward() (a TorchFunctionMode is off while it handles a
   call), where activation recompute re-runs layers: the causal-mask helper
   (transformer/utils.py get_default_causal_mask, device="cuda") is replaced directly.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["apply", "is_applied", "remove_device_mode"]

_applied = False
_device_mode: torch.overrides.TorchFunctionMode | None = None


def is_applied() -> bool:
    return _applied


def apply() -> bool:
    """Install the CPU shims once; no-op (returns False) where CUDA is available."""
    global _applied
    if _applied:
        return True
    if torch.cuda.is_available():
        return False
    _patch_rng_tracker()
    _patch_streams_and_device()
    _enter_device_mode()
    _patch_dispatcher_splits()
    _patch_backward_paths()
    _applied = True
    return True


def remove_device_mode() -> None:
    """Leave the device-rewriting TorchFunctionMode (the other shims stay)."""
    global _device_mode
    if _device_mode is not None:
        _device_mode.__exit__(None, None, None)
        _device_mode = None


# 1. RNG tracker -------------------------------------------------------------------------------
def _patch_rng_tracker():
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker.add = add


# 2./3. streams, events, current device ------------------------------------------------------
class _InertEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _InertStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _InertEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


_STREAM = _InertStream()


def _patch_streams_and_device():
    torch.cuda.Stream = _InertStream
    torch.cuda.Event = _InertEvent
    torch.cuda.current_stream = lambda device=None: _STREAM
    torch.cuda.default_stream = lambda device=None: _STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: "cpu"


# 4. hard-coded CUDA devices and type strings ------------------------------------------------
def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                name = "torch.cuda." + name[len("torch.") :]
            return name
        return func(*args, **kwargs)


def _enter_device_mode():
    global _device_mode
    _device_mode = _CudaToCpu()
    _device_mode.__enter__()


# 5. alltoall split sizes for gloo -----------------------------------------------------------
def _patch_dispatcher_splits():
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            tensor = tensor.detach().cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# 6. code that runs inside backward ----------------------------------------------------------
def _patch_backward_paths():
    # A TorchFunctionMode is switched off while it handles a call, so everything under
    # loss.backward() (activation recompute re-runs whole layers there) runs without shim 4.
    # The one hard-coded CUDA device on that path in the GPT model: the default causal mask.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask
