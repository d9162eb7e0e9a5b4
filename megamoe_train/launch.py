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


def _parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_local_cpus(device: int) -> set[int]:
    """The CPUs on the GPU's NUMA node (sysfs `local_cpulist` of its PCI device), within the ones
    this process may use; all of those where the kernel does not say."""
    allowed = os.sched_getaffinity(0)
    p = torch.cuda.get_device_properties(device)
    path = f"/sys/bus/pci/devices/{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0/local_cpulist"
    try:
        with open(path) as f:
            local = _parse_cpulist(f.read()) & allowed
    except (OSError, ValueError):
        local = set()
    return local or set(allowed)


def rank_cpus(rank: int, world_size: int) -> list[int]:
    """This rank's share of its GPU's local CPUs: the ranks of this host whose GPUs have the same
    local CPUs split them into equal contiguous parts, in rank order (one rank per GPU)."""
    count = torch.cuda.device_count()
    local = [sorted(gpu_local_cpus(r % count)) for r in range(world_size)]
    mine = local[rank]
    sharing = [r for r in range(world_size) if local[r] == mine]
    per = max(1, len(mine) // len(sharing))
    start = sharing.index(rank) * per
    return mine[start : start + per] or mine


def place_rank(rank: int, world_size: int, backend: str, pin_cpus: bool = False):
    """Threads (and on GPUs, cores) for this rank's process. With pin_cpus on NCCL, the process
    runs only on its share of the CPUs near its GPU: two ranks' hosts then never compete for a core
    or migrate across NUMA nodes, and a late host shows as its peers' barrier wait. Otherwise the
    intra-op threads are split evenly between the ranks."""
    cpus = None
    if pin_cpus and backend == "nccl" and hasattr(os, "sched_setaffinity"):
        cpus = rank_cpus(rank, world_size)
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus) if cpus else max(1, (os.cpu_count() or 1) // world_size))


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
    init_rank(rank, world_size, port, backend)
    place_rank(rank, world_size, backend)
    try:
        fn(rank, world_size, *args)
    finally:
        finish_rank()
    exit_finished_rank()


def spawn(fn: Callable, world_size: int, args: tuple = (), backend: str = "gloo"):
    """Run fn(rank, world_size, *args) on world_size new processes; raises if any rank fails."""
    mp.spawn(_entry, args=(fn, world_size, free_port(), backend, args), nprocs=world_size, join=True)
