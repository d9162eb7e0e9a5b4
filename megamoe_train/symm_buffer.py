"""The symmetric buffer: one allocation per (process group, config), mapped on every rank.

Each rank owns a buffer of identical layout (layout.py) and can read and write every peer's
buffer directly. The mapping and the barrier are the transport's (transport/): PyTorch
symmetric memory on CUDA (cuda_symmetric.py), on CPU a file in /dev/shm per rank that every
process of the group maps (shared_memory.py), so the very same pull/push protocol runs between
real processes. This module keeps the typed views (BufferRegions, SymmBuffer) and the registry
of buffers per (group, config, device) (get_symm_buffer).

The buffer holds only regions that peers read or write (layout.py); `buf.regions(rank)` gives
them as typed views. What the protocol remembers between calls on one buffer (the call epoch,
verdicts still to be read, the side stream) lives in `buf.call_state` (call_state.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from .call_state import BufferCallState
from .config import MegaMoEConfig
from .errors import MegaMoEPeerError
from .layout import BufferLayout, buffer_layout
from .transport import NUM_WAIT_SITES, StatusExchange, open_transport
from .transport.cuda_symmetric import allocation_bytes

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class BufferRegions:
    """One rank's buffer as typed views (names and order from layout.py / csrc/layout.cpp)."""

    status: torch.Tensor  # int32 [2, R, 4]: (verdict, call epoch, layer id, phase) per source, by call parity
    x: torch.Tensor  # [T, H] published input rows, recipe storage format
    x_scales: torch.Tensor | None  # [T, H / act_block] their scales (quantized recipes only)
    topk_idx: torch.Tensor  # int32 [T, K] published expert ids (-1: no row)
    topk_weights: torch.Tensor  # float32 [T, K]
    grad_y: torch.Tensor  # [T, H] published dY (compute dtype)
    partials: torch.Tensor  # [R (+1 shared), T, H] combine rows pushed home, one per (owner, token)
    topk_weight_grads: torch.Tensor  # float32 [T, K] d(topk weight) pushed home per slot


def check_fits(config: MegaMoEConfig, layout: BufferLayout, needed: int, free: int, device) -> None:
    """Raise a ValueError that says what drives the size when one rank's allocation of `needed`
    bytes (the layout's buffer and the transport's own area) exceeds the `free` bytes of `device`.
    CUDA only: on CPU the transport reserves each rank's /dev/shm file at its creation, and every
    rank raises where one rank's did not fit (transport/shared_memory.py)."""
    if needed <= free:
        return
    gib = 2**30
    largest = sorted(layout.regions.values(), key=lambda r: r.nbytes, reverse=True)[:3]
    regions = ", ".join(f"{r.name} {list(r.shape)} {r.dtype} {r.nbytes / gib:.2f} GiB" for r in largest)
    raise ValueError(
        f"SymmBuffer: the buffer needs {needed} bytes ({needed / gib:.2f} GiB) per rank on {device}, but "
        f"{free} bytes ({free / gib:.2f} GiB) are free. Its size is num_max_tokens_per_rank="
        f"{config.num_max_tokens_per_rank} times rows of hidden={config.hidden} values: x, grad_y and a combine "
        f"row per rank of the group ({layout.num_ranks}, + 1 with shared experts) for each token (layout.py); "
        f"the largest regions: {regions}. Lower num_max_tokens_per_rank (the most tokens one rank passes in a "
        "call) or free device memory"
    )


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
            # before the collective creation: on equal devices every rank stops here, where the
            # allocation's out-of-memory error would come with peers already past the agreement
            free, _ = torch.cuda.mem_get_info(self.device)
            check_fits(config, self.layout, allocation_bytes(self.layout.nbytes, self.world_size), free, self.device)
        description = f"{config!r} on {self.world_size} ranks, {self.layout.nbytes} bytes"
        self._transport = open_transport(self.layout.nbytes, group, self.device, timeout_s, description)
        self._failure: str | None = None
        self._regions = []
        for raw in self._transport.peers:
            views = dict.fromkeys(names)
            for name, reg in self.layout.regions.items():
                views[name] = raw[reg.offset : reg.offset + reg.nbytes].view(reg.dtype).view(reg.shape)
            self._regions.append(BufferRegions(**views))
        self.call_state = BufferCallState()

    @property
    def alive(self) -> bool:
        return bool(self._regions) and self._failure is None

    def check_usable(self):
        if not self._regions:
            raise RuntimeError("SymmBuffer: used after destroy()")
        if self._failure is None and self._transport.has_fault():
            self.raise_device_fault()
        if self._failure is not None:
            raise MegaMoEPeerError(
                f"SymmBuffer (rank {self.rank}): unusable since {self._failure}; get_symm_buffer makes a new one "
                "(collectively, on every rank)"
            )

    def fail(self, reason: str, tag: int = 0):
        """This rank leaves the protocol of this buffer (at call `tag // 4`): peers waiting at a
        barrier raise at once instead of timing out, and every later call here raises."""
        if self._failure is None:
            self._failure = reason
            _forget(self)
            self._transport.mark_failed(tag)

    def device_fault(self) -> Exception | None:
        """CUDA: the error a device barrier of this buffer recorded before it trapped (the
        missing, failed or out-of-step rank and the call; or, in a captured graph, the ranks'
        different calls), else None. The CUDA error of the trap itself (an 'unspecified launch
        failure' or a device-side assert) surfaces at the next synchronizing CUDA call, which may
        be anywhere in the program; this is the explanation."""
        return self._transport.fault_error() if self._transport.has_fault() else None

    def raise_device_fault(self, cause: BaseException | None = None):
        """Raise device_fault() (the buffer is unusable from then on); nothing if there is none."""
        fault = self.device_fault()
        if fault is None:
            return
        if self._failure is None:
            self._failure = str(fault)
            _forget(self)
        raise fault from cause

    @property
    def nbytes(self) -> int:
        """Symmetric memory of one rank's buffer."""
        return self.layout.nbytes

    @property
    def nbytes_by_region(self) -> dict[str, int]:
        return self.layout.nbytes_by_region

    def regions(self, rank: int | None = None) -> BufferRegions:
        """Typed views of `rank`'s buffer (this rank's by default)."""
        if not self._regions or self._failure is not None:
            self.check_usable()
        return self._regions[self.rank if rank is None else rank]

    def barrier(self, tag: int = 0, exchange: StatusExchange | None = None, wait_site: int = 0):
        """Cross-rank barrier: all writes any rank made before it are visible after it. `tag`
        names the protocol step (call * 4 + step). A peer at another tag, a failed peer or one
        missing past the timeout: on CPU MegaMoEPeerError here, and the buffer is unusable; on
        CUDA the device barrier records the fault and traps (`device_fault()` explains it).
        exchange: the status exchange this barrier carries (exchange_status). wait_site: the
        counter of peer_wait_ns_by_site this barrier's wait goes to (0 .. NUM_WAIT_SITES - 1)."""
        self.check_usable()
        if not 0 <= wait_site < NUM_WAIT_SITES:
            raise ValueError(f"SymmBuffer.barrier: wait_site must be in [0, {NUM_WAIT_SITES}), got {wait_site}")
        try:
            self._transport.barrier(tag, exchange, wait_site)
        except MegaMoEPeerError as err:
            self.fail(str(err), tag)
            raise

    def exchange_status(
        self,
        tag: int,
        parity: int,
        verdict: torch.Tensor,
        name: tuple[int, int, int],
        compare_on_device: bool = False,
        wait_site: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Barrier `tag` with the status exchange of a call (StatusExchange) in status slot
        `parity`: this rank's verdict (int32 scalar on the device) and call name (epoch, layer
        id, phase) to every rank. Returns (this rank's slot after the barrier, int32 [R, 4]; a
        bool scalar: every rank accepted its input and is in this rank's call). On CUDA one
        kernel launch; nothing is read on the host."""
        R = self.world_size
        region = self.layout.regions["status"]
        exchange = StatusExchange(
            slot_offset=region.offset + parity * R * region.row_bytes,
            verdict=verdict,
            name=name,
            status_out=torch.empty(R, 4, dtype=torch.int32, device=self.device),
            all_ok=torch.empty((), dtype=torch.bool, device=self.device),
            compare_on_device=compare_on_device,
        )
        self.barrier(tag, exchange, wait_site)
        return exchange.status_out, exchange.all_ok

    @property
    def peer_wait_ns(self) -> torch.Tensor:
        """int64 [1] on the buffer's device: nanoseconds this rank's barriers have waited for their
        peers since the buffer was made (device time, %globaltimer, on CUDA; host time on CPU).
        Grows when a peer arrives late: it has more rows to compute, or its host runs behind.
        The sum of peer_wait_ns_by_site's counters, read now (a new tensor, no host sync): take
        differences of two reads."""
        return self._transport.wait_ns.sum(0, keepdim=True)

    @property
    def peer_wait_ns_by_site(self) -> torch.Tensor:
        """int64 [NUM_WAIT_SITES]: peer_wait_ns split by the barrier site that waited (the protocol's
        WAIT_SITES names them: forward / backward, first / push barrier). The live counters."""
        return self._transport.wait_ns

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
        _forget(self)
        if self._failure is None and not self._transport.has_fault():  # a trapped barrier: no peer waits for us
            try:
                self.barrier()  # no peer may still be reading or writing our memory
            except MegaMoEPeerError:
                pass  # a peer failed or is gone; our mapping of its file stays valid until we close it
        self._regions = []
        self.call_state = BufferCallState()
        self._transport.close()

    def __repr__(self):
        return (
            f"SymmBuffer(rank={self.rank}/{self.world_size}, device={self.device}, "
            f"bytes={self.nbytes}, recipe={self.config.recipe!r})"
        )


_BUFFERS: dict[tuple, SymmBuffer] = {}


_LAYER_COUNTS: dict[int, int] = {}


def _forget(buf: SymmBuffer):
    key = _cache_key(buf.group, buf.config, buf.device)
    if _BUFFERS.get(key) is buf:
        del _BUFFERS[key]


def register_layer(group) -> int:
    """A layer id for the status words of its calls: layers of one group are numbered in the
    order they are built, which is the same program order on every rank, so ranks agree on the
    ids without communicating (layers of equal config share a buffer; the id tells them apart)."""
    key = id(_resolve_group(group))
    _LAYER_COUNTS[key] = _LAYER_COUNTS.get(key, 0) + 1
    return _LAYER_COUNTS[key]


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


def live_symm_buffers() -> list[SymmBuffer]:
    """The buffers get_symm_buffer made that are not destroyed, in the order they were made (the
    same program order on every rank)."""
    return [buf for buf in _BUFFERS.values() if buf.alive]


def destroy_all_symm_buffers():
    for buf in list(_BUFFERS.values()):
        buf.destroy()
