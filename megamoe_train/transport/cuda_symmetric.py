"""The CUDA transport: PyTorch symmetric memory (P2P over NVLink; multicast is never used) and
the device barrier (device_barrier.py) over a barrier area at the end of every rank's
allocation. Ranks agree on the buffer's description through the job's c10d store first."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .. import faults
from ..errors import MegaMoEPeerError
from ..faults import name_ranks
from .base import NUM_WAIT_SITES, StatusExchange

_CREATIONS: dict[str, int] = {}  # buffer creations per group name: the key of the next agreement


def _agree_description(group, rank: int, description: str, timeout_s: float):
    """Every rank's buffer description equals rank 0's (CUDA creation; the CPU transport compares
    the descriptions in its files' headers instead). Each rank posts its description in the
    job's c10d store and polls for its peers' with a deadline of its own, so the timeout holds
    on every rank (a collective would wait for the process group's timeout) and names the ranks
    that never posted. Creations of one group happen in the same order on every rank, so their
    sequence number keys the agreement without communication."""
    world = dist.get_world_size(group)
    name = getattr(group, "group_name", None) or str(id(group))
    seq = _CREATIONS.get(name, 0) + 1
    _CREATIONS[name] = seq
    store = dist.distributed_c10d._get_default_store()
    prefix = f"megamoe-buffer/{name}/{seq}/"
    keys = [f"{prefix}{r}" for r in range(world)]
    store.set(keys[rank], description)
    deadline = time.monotonic() + timeout_s
    missing = [r for r in range(world) if r != rank]
    while missing:
        missing = [r for r in missing if not store.check([keys[r]])]
        if missing and time.monotonic() > deadline:
            gave_up = f"rank {rank} gave up waiting for {name_ranks(missing)} after {timeout_s}s"
            break
        time.sleep(0 if not missing else 2e-3)
    # One outcome for every rank, decided once (compare_set): a rank that arrives after a peer
    # gave up fails too instead of going on to allocate alone.
    outcome = store.compare_set(prefix + "outcome", "", "joined" if not missing else gave_up).decode()
    if outcome != "joined":
        late = "" if missing else " (this rank arrived after that)"
        raise MegaMoEPeerError(f"SymmBuffer creation (rank {rank}): {outcome}{late}; absent, or failed before")
    texts = [description if r == rank else store.get(keys[r]).decode() for r in range(world)]
    differ = [r for r in range(world) if texts[r] != texts[0]]
    if differ:
        raise ValueError(
            f"SymmBuffer creation (rank {rank}): {name_ranks(differ)} built their buffer from another config than "
            "rank 0 (every rank must pass the same config): " + "; ".join(f"rank {r}: {texts[r]}" for r in [0, *differ])
        )


def allocation_bytes(nbytes: int, world: int) -> int:
    """Bytes of one rank's allocation for a buffer of nbytes: the buffer, then the barrier area at
    the next 256-byte boundary."""
    from ..device_barrier import area_bytes

    return _area_offset(nbytes) + area_bytes(world)


def _area_offset(nbytes: int) -> int:
    return -(-nbytes // 256) * 256


class CudaSymmetricPeers:
    """CUDA transport: PyTorch symmetric memory (CUDA P2P backend) and our own device barrier
    (device_barrier.py) over a barrier area at the end of every rank's allocation: tagged with
    the call and step, a deadline on every rank, a failure mark per rank, and a fault record in
    pinned host memory that names the rank and call when it traps (faults.py)."""

    def __init__(self, nbytes: int, group, device: torch.device, timeout_s: float, description: str):
        from torch.distributed import _symmetric_memory as symm_mem

        self.timeout_s = timeout_s
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device = device
        self.local = self.handle = self.base_ptrs = None
        self.peers, self.areas = [], []
        self.fault_record = None
        self.wait_ns = torch.zeros(
            NUM_WAIT_SITES, dtype=torch.int64, device=device
        )  # device time barriers waited, per site
        _agree_description(group, self.rank, description, timeout_s)
        self.area_offset = _area_offset(nbytes)
        total = allocation_bytes(nbytes, self.world)
        try:
            group_name = group.group_name
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(group_name)
            self.local = symm_mem.empty(total, dtype=torch.uint8, device=device)
            self.local.zero_()
            # zeroed before any peer can learn the address (its first barrier writes our area)
            torch.cuda.current_stream(device).synchronize()
            self.handle = symm_mem.rendezvous(self.local, group_name)
            raw = [
                self.local if r == self.rank else self.handle.get_buffer(r, (total,), torch.uint8, 0)
                for r in range(self.world)
            ]
            ptrs = list(self.handle.buffer_ptrs)
            if ptrs[self.rank] != self.local.data_ptr():
                raise RuntimeError("symmetric memory: the local buffer does not start at its symmetric base address")
            # Base address of every rank's buffer, for kernels that address peers directly.
            self.base_ptrs = torch.tensor(ptrs, dtype=torch.int64, device=device)
            self.peers = [b[:nbytes] for b in raw]
            self.areas = [b[self.area_offset :].view(torch.int64) for b in raw]
            self.fault_record = faults.new_record()
            self._fault_kind = self.fault_record.numpy()[faults.KIND :]  # a plain load per check
            self._mark_stream = torch.cuda.Stream(device=device)
            faults.watch(self)
            self.barrier(0)
            if not torch.cuda.is_current_stream_capturing():
                torch.cuda.current_stream(device).synchronize()  # a peer missing here raises now, at creation
        except BaseException as err:
            fault = self.fault_error()
            self.close()
            if fault is not None:
                raise fault from err
            raise

    def barrier(self, tag: int = 0, exchange: StatusExchange | None = None, wait_site: int = 0):
        """Device barrier (one Triton program on the current stream; the host never waits), with
        the status exchange in the same launch when given (device_barrier.py)."""
        from ..device_barrier import device_barrier

        exchange_args = None
        if exchange is not None:
            exchange_args = (
                self.local.data_ptr() + exchange.slot_offset,
                exchange.verdict,
                exchange.name,
                exchange.status_out,
                exchange.all_ok,
                exchange.compare_on_device,
            )
        device_barrier(
            self.base_ptrs,
            self.area_offset,
            self.rank,
            self.world,
            tag,
            self.timeout_s,
            self.fault_record,
            self.wait_ns[wait_site : wait_site + 1],
            exchange_args,
        )

    def fault_error(self) -> Exception | None:
        """The error of a fault this rank's device barrier recorded before it trapped, if any."""
        return None if self.fault_record is None else faults.fault_error(self.fault_record.tolist())

    def has_fault(self) -> bool:
        return self.fault_record is not None and self._fault_kind[0] != 0

    def mark_failed(self, tag: int):
        """Tell the peers that this rank left the protocol in call `tag // 4`: its failure mark
        goes into every rank's barrier area, from a stream of its own (this rank's stream may
        hold a barrier that waits for them); peers at a barrier stop and trap, naming it."""
        if not self.areas or self.has_fault():
            return  # a trapped rank's barrier already wrote its mark (and the context is lost)
        from ..device_barrier import FAILED, WORDS

        try:
            with torch.cuda.stream(self._mark_stream):
                for area in self.areas:
                    area[self.rank * WORDS + FAILED].fill_(tag + 1)
            self._mark_stream.synchronize()
        except RuntimeError:
            pass  # the CUDA context is lost: peers time out at their barrier instead, naming this rank

    def close(self):
        if self.local is not None and not self.has_fault():
            try:  # no barrier of ours may still read the memory we free
                torch.cuda.synchronize(self.device)
            except RuntimeError:
                pass
        self.peers, self.areas = [], []
        self.base_ptrs = None
        self.handle = None
        self.local = None
