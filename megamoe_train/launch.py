"""Start one process per rank with torch.distributed initialized (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import gc
import os
import socket
import sys
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world_size: int, port: int, backend: str = "gloo"):
    """Join the default process group of a single-host job."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    kwargs = {"device_id": torch.device("cuda", torch.cuda.current_device())} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)


def finish_rank():
    """Release this rank's MegaMoE buffers and its process group (collective).

    Garbage left in reference cycles (autograd graphs, saved contexts) is collected while the
    process group still exists: freed later, at interpreter exit, it aborted about one gloo rank
    in five ("terminate called without an active exception", SIGABRT) in our CPU runs."""
    from .symm_buffer import destroy_all_symm_buffers

    destroy_all_symm_buffers()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_finished_rank():
    """End a spawned rank whose work is done and released (finish_rank), skipping interpreter
    teardown: freeing NCCL state there still aborted a finished rank now and then
    ("terminate called without an active exception", SIGABRT; seen after complete training and
    profiling runs on 2x H200), which made a successful run report a failed rank.

    os._exit skips multiprocessing's exit handlers, so the rank's own child processes (e.g. the
    manager process behind Megatron's async checkpoint result queue) are ended here first: left
    running, they would hold the launcher's stdout open and keep it waiting."""
    for child in mp.active_children():
        child.terminate()
    for child in mp.active_children():
        child.join(timeout=5)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _entry(rank: int, fn: Callable, world_size: int, port: int, backend: str, args: tuple):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    init_rank(rank, world_size, port, backend)
    try:
        fn(rank, world_size, *args)
    finally:
        finish_rank()
    exit_finished_rank()


def spawn(fn: Callable, world_size: int, args: tuple = (), backend: str = "gloo"):
    """Run fn(rank, world_size, *args) on world_size new processes; raises if any rank fails."""
    mp.spawn(_entry, args=(fn, world_size, free_port(), backend, args), nprocs=world_size, join=True)
