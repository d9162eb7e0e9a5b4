"""The symmetric buffer: one allocation per (process group, config), mapped on every rank.

Each rank owns a buffer of identical layout (layout.py) and can read and write every peer's
buffer directly. On CUDA the mapping is PyTorch symmetric memory (P2P over NVLink; multicast is
never used). On CPU each rank's buffer is a file in /dev/shm that every process of the group
maps, so the very same pull/push protocol runs between real processes.

The buffer holds only regions that peers read or write (layout.py); `buf.regions(rank)` gives
them as typed views. What the protocol remembers between calls on one buffer (the call epoch,
verdicts still to be read, the side stream) lives in `buf.session` (session.py).
"""

from __future__ import annotations

import datetime
import mmap
import os
import uuid
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from .config import MegaMoEConfig
from .layout import BufferLayout, buffer_layout
from .session import BufferSession

DEFAULT_TIMEOUT_S = 300.0


class _SharedMemoryPeers:
    """CPU transport: every rank's buffer is a /dev/shm file mapped into every process."""

    def __init__(self, nbytes: int, group, timeout_s: float):
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        token = [uuid.uuid4().hex if rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        paths = [f"/dev/shm/megamoe-{token[0]}-{r}" for r in range(world)]
        fd = os.open(paths[rank], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)  # zero-filled
        finally:
            os.close(fd)
        self.barrier()
        self.maps = []
        for path in paths:
            fd = os.open(path, os.O_RDWR)
            try:
                self.maps.append(mmap.mmap(fd, nbytes))
            finally:
                os.close(fd)
        self.barrier()
        os.unlink(paths[rank])  # every peer holds its mapping now; nothing is left behind on exit
        self.peers = [torch.frombuffer(m, dtype=torch.uint8) for m in self.maps]

    def barrier(self):
        # monitored_barrier names the missing rank when a peer does not arrive in time.
        dist.monitored_barrier(self.group, timeout=self.timeout, wait_all_ranks=True)

    def close(self):
        self.peers = []
        for m in self.maps:
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere; the OS frees it at exit
                pass
        self.maps = []


class _CudaSymmetricPeers:
    """CUDA transport: PyTorch symmetric memory (CUDA P2P backend)."""

    def __init__(self, nbytes: int, group, device: torch.device, timeout_s: float):
        from torch.distributed import _symmetric_memory as symm_mem

        self.timeout_ms = int(timeout_s * 1000)
        group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
        self.local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.local.zero_()
        self.handle = symm_mem.rendezvous(self.local, group_name)
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.peers = [
            self.local if r == rank else self.handle.get_buffer(r, (nbytes,), torch.uint8, 0) for r in range(world)
        ]
        ptrs = list(self.handle.buffer_ptrs)
        if ptrs[rank] != self.local.data_ptr():
            raise RuntimeError("symmetric memory: the local buffer does not start at its symmetric base address")
        # Base address of every rank's buffer, for kernels that address peers directly.
        self.base_ptrs = torch.tensor(ptrs, dtype=torch.int64, device=device)
        self.barrier()

    def barrier(self):
        # device-side barrier over the signal pads; traps (a loud CUDA error) after the timeout
        self.handle.barrier(channel=0, timeout_ms=self.timeout_ms)

    def close(self):
        self.peers = []
        self.base_ptrs = None
        self.handle = None
        self.local = None


@dataclass(frozen=True)
class BufferRegions:
    """One rank's buffer as typed views (names and order from layout.py / csrc/layout.cpp)."""

    status: torch.Tensor  # int32 [2, R, 4]: (verdict, call epoch, -, -) per source, by call parity
    x: torch.Tensor  # [T, H] published input rows, recipe storage format
    x_scales: torch.Tensor | None  # [T, H / act_block] their scales (quantized recipes only)
    topk_idx: torch.Tensor  # int32 [T, K] published expert ids (-1: no row)
    topk_weights: torch.Tensor  # float32 [T, K]
    grad_y: torch.Tensor  # [T, H] published dY (compute dtype)
    partials: torch.Tensor  # [R (+1 shared), T, H] combine rows pushed home, one per (owner, token)
    topk_weight_grads: torch.Tensor  # float32 [T, K] d(topk weight) pushed home per slot


class SymmBuffer:
    """Every rank's buffer of one layout: `regions(rank)` gives typed views of a rank's regions.

    Made by `get_symm_buffer`; all ranks of the group must create and destroy it together.
    """

    def __init__(self, group, config: MegaMoEConfig, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.group = group
        self.config = config
        self.device = torch.device(device)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = timeout_s
        self.layout: BufferLayout = buffer_layout(config, self.world_size)
        self.num_local_experts = config.experts_per_rank(self.world_size)
        names = {f.name for f in fields(BufferRegions)}
        if not set(self.layout.regions) <= names:
            raise RuntimeError(f"SymmBuffer: layout regions {sorted(self.layout.regions)} do not match BufferRegions")
        if self.device.type == "cuda":
            self._transport = _CudaSymmetricPeers(self.layout.nbytes, group, self.device, timeout_s)
        else:
            self._transport = _SharedMemoryPeers(self.layout.nbytes, group, timeout_s)
        self._regions = []
        for raw in self._transport.peers:
            views = dict.fromkeys(names)
            for name, reg in self.layout.regions.items():
                views[name] = raw[reg.offset : reg.offset + reg.nbytes].view(reg.dtype).view(reg.shape)
            self._regions.append(BufferRegions(**views))
        self.session = BufferSession()

    @property
    def alive(self) -> bool:
        return bool(self._regions)

    @property
    def nbytes(self) -> int:
        """Symmetric memory of one rank's buffer."""
        return self.layout.nbytes

    @property
    def nbytes_by_region(self) -> dict[str, int]:
        return self.layout.nbytes_by_region

    def regions(self, rank: int | None = None) -> BufferRegions:
        """Typed views of `rank`'s buffer (this rank's by default)."""
        if not self._regions:
            raise RuntimeError("SymmBuffer: used after destroy()")
        return self._regions[self.rank if rank is None else rank]

    def barrier(self):
        """Cross-rank barrier: all writes any rank made before it are visible after it."""
        self._transport.barrier()

    @property
    def peer_base_ptrs(self) -> torch.Tensor:
        """int64 [R] device tensor: base address of every rank's buffer (CUDA only). A region's
        row on rank r lives at peer_base_ptrs[r] + layout.regions[name].offset + row * row_bytes."""
        if not self._regions:
            raise RuntimeError("SymmBuffer: used after destroy()")
        ptrs = getattr(self._transport, "base_ptrs", None)
        if ptrs is None:
            raise RuntimeError("SymmBuffer.peer_base_ptrs: only CUDA symmetric memory has device addresses")
        return ptrs

    def destroy(self):
        """Free the buffer on every rank (collective)."""
        if not self._regions:
            return
        _BUFFERS.pop(_cache_key(self.group, self.config, self.device), None)
        self.barrier()  # no peer may still be reading or writing our memory
        self._regions = []
        self.session = BufferSession()
        self._transport.close()

    def __repr__(self):
        return (
            f"SymmBuffer(rank={self.rank}/{self.world_size}, device={self.device}, "
            f"bytes={self.nbytes}, recipe={self.config.recipe!r})"
        )


_BUFFERS: dict[tuple, SymmBuffer] = {}


def _resolve_group(group):
    return dist.group.WORLD if group is None else group


def _cache_key(group, config, device):
    return (id(group), config, torch.device(device))


def default_device(group) -> torch.device:
    """CUDA (the current device) for NCCL groups, CPU otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_symm_buffer(group, config: MegaMoEConfig, *, device=None, timeout_s: float = DEFAULT_TIMEOUT_S) -> SymmBuffer:
    """The symmetric buffer of (group, config), created on first use (collectively) and then reused."""
    if not dist.is_initialized():
        raise RuntimeError("get_symm_buffer: torch.distributed is not initialized")
    group = _resolve_group(group)
    device = torch.device(device) if device is not None else default_device(group)
    key = _cache_key(group, config, device)
    buf = _BUFFERS.get(key)
    if buf is None or not buf.alive:
        buf = SymmBuffer(group, config, device, timeout_s)
        _BUFFERS[key] = buf
    return buf


def destroy_all_symm_buffers():
    for buf in list(_BUFFERS.values()):
        buf.destroy()
