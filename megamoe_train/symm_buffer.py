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
import struct
import time
import uuid
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from . import faults
from .config import MegaMoEConfig
from .errors import MegaMoEPeerError
from .faults import STATUS_OK, describe_failure_mark, describe_tag, name_ranks
from .layout import BufferLayout, buffer_layout
from .session import BufferSession

DEFAULT_TIMEOUT_S = 300.0


@dataclass
class StatusExchange:
    """A protocol call's status exchange, done by its first barrier: this rank's status word
    (verdict, then the call's name: epoch, layer id, phase) goes into its row of the call's slot
    (int32 [R, 4] at slot_offset in every rank's buffer) before it arrives; after the wait
    status_out gets a copy of this rank's slot and all_ok (bool scalar) says whether every word
    accepts its input (faults.STATUS_OK) and names this rank's call. compare_on_device (captured
    CUDA calls): the device barrier also traps on a mismatch or a rejected input."""

    slot_offset: int
    verdict: torch.Tensor  # int32 scalar, on the buffer's device
    name: tuple[int, int, int]
    status_out: torch.Tensor
    all_ok: torch.Tensor
    compare_on_device: bool = False

    def word(self) -> torch.Tensor:
        word = torch.tensor([0, *self.name], dtype=torch.int32, device=self.verdict.device)
        word[0] = self.verdict
        return word

    def slot(self, raw: torch.Tensor) -> torch.Tensor:
        """The slot in a rank's buffer (raw: its bytes), shaped like status_out."""
        nbytes = self.status_out.numel() * self.status_out.element_size()
        return raw[self.slot_offset : self.slot_offset + nbytes].view(torch.int32).view(self.status_out.shape)

    def finish(self, slot: torch.Tensor, rank: int):
        """status_out and all_ok from this rank's slot after the barrier (the device barrier's rule)."""
        self.status_out.copy_(slot)
        names_match = (self.status_out[:, 1:] == self.status_out[rank, 1:]).all()
        self.all_ok.copy_((self.status_out[:, 0] == STATUS_OK).all() & names_match)


# One rank's /dev/shm file: a header page the transport owns, then the buffer. Header int64 words:
_ARRIVED = 0  # barriers this rank has entered
_TAG = 1  # words 1, 2: the tag of its latest barriers, by parity of the count
_FAILED = 3  # the tag (+1) of the call in which this rank left the protocol; 0 while it is fine
_DESCRIPTION_LEN = 4  # bytes of the description (config, group size, bytes) at _DESCRIPTION_AT
_DESCRIPTION_AT = 64
_HEADER_BYTES = 4096


_TOKEN_TAG = 0x4D4D  # the p2p tag of the file name token (apart from the user's own sends)


def _agree_token(group, rank: int, timeout_s: float) -> str:
    """Rank 0's random file name stem, sent to each peer point to point, with a deadline that
    holds on every rank and names the ranks that did not take it."""
    world = dist.get_world_size(group)
    token = torch.zeros(16, dtype=torch.uint8)
    if rank == 0:
        token.copy_(torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8))
        works = {
            r: dist.isend(token, dst=dist.get_global_rank(group, r), group=group, tag=_TOKEN_TAG) for r in range(1, world)
        }
    else:
        works = {0: dist.irecv(token, src=dist.get_global_rank(group, 0), group=group, tag=_TOKEN_TAG)}
    deadline = time.monotonic() + timeout_s
    pending = []
    for r, work in works.items():  # a gloo send / recv honours the timeout of its wait
        left = max(deadline - time.monotonic(), 1e-3)
        try:
            work.wait(timeout=datetime.timedelta(seconds=left))
        except RuntimeError:
            pending.append(r)
    if pending:
        raise MegaMoEPeerError(
            f"SymmBuffer creation (rank {rank}): {name_ranks(pending)} did not join within {timeout_s}s"
        )
    return bytes(token.tolist()).hex()


# Barrier wait counters, one per protocol site (the protocol names them, protocol.WAIT_SITES):
# where a rank stood still tells which part of the step its peers were late in.
NUM_WAIT_SITES = 4


class _SharedMemoryPeers:
    """CPU transport: every rank's buffer is a /dev/shm file mapped into every process. Barriers
    poll counters in the files' headers with a deadline, so the timeout holds on every rank and
    names the missing ranks; each barrier carries a tag (the call and step) that peers compare."""

    def __init__(self, nbytes: int, group, timeout_s: float, description: str):
        self.timeout_s = timeout_s
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.arrived = 0
        self.wait_ns = torch.zeros(NUM_WAIT_SITES, dtype=torch.int64)  # host time barriers waited for peers, per site
        self.maps, self.headers, self.peers = [], [], []
        token = _agree_token(group, self.rank, timeout_s)
        paths = [f"/dev/shm/megamoe-{token}-{r}" for r in range(self.world)]
        try:
            self._create(paths[self.rank], nbytes, description)
            self._map_all(paths)
            self.barrier(0)  # every rank mapped every file
            _unlink(paths[self.rank])  # mapped everywhere: nothing is left behind on exit
            self._compare(description)
        except BaseException:
            self.mark_failed(0)
            self.close()
            for path in paths:  # peers' files too: a peer that died before its cleanup leaves none
                _unlink(path)
                _unlink(path + ".tmp")
            raise
        self.peers = [torch.frombuffer(m, dtype=torch.uint8)[_HEADER_BYTES:] for m in self.maps]

    def _create(self, path: str, nbytes: int, description: str):
        """Write the file under a temporary name, then rename: a peer sees it whole or not at all."""
        text = description.encode()
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, _HEADER_BYTES + nbytes)  # zero-filled
            os.pwrite(fd, struct.pack("q", len(text)), _DESCRIPTION_LEN * 8)
            os.pwrite(fd, text[: _HEADER_BYTES - _DESCRIPTION_AT], _DESCRIPTION_AT)
            os.rename(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        finally:
            os.close(fd)

    def _map_all(self, paths):
        deadline = time.monotonic() + self.timeout_s
        maps = [None] * self.world
        while True:
            for r, path in enumerate(paths):
                if maps[r] is None:
                    try:
                        fd = os.open(path, os.O_RDWR)
                    except FileNotFoundError:
                        continue
                    try:
                        maps[r] = mmap.mmap(fd, os.fstat(fd).st_size)
                    finally:
                        os.close(fd)
            missing = [r for r in range(self.world) if maps[r] is None]
            if not missing:
                break
            if time.monotonic() > deadline:
                self.maps = [m for m in maps if m is not None]
                raise MegaMoEPeerError(
                    f"SymmBuffer creation (rank {self.rank}): {name_ranks(missing)} did not create their buffer "
                    f"within {self.timeout_s}s (absent, or failed before)"
                )
            time.sleep(1e-3)
        self.maps = maps
        self.headers = [memoryview(m)[:_HEADER_BYTES].cast("q") for m in maps]

    def _compare(self, description: str):
        texts = []
        for h, m in zip(self.headers, self.maps):
            n = min(h[_DESCRIPTION_LEN], _HEADER_BYTES - _DESCRIPTION_AT)
            texts.append(m[_DESCRIPTION_AT : _DESCRIPTION_AT + n].decode())
        differ = [r for r in range(self.world) if texts[r] != texts[0]]
        if differ:
            raise ValueError(
                f"SymmBuffer creation (rank {self.rank}): {name_ranks(differ)} built their buffer from another "
                f"config than rank 0 (every rank must pass the same config): "
                + "; ".join(f"rank {r}: {texts[r]}" for r in [0, *differ])
            )

    def barrier(self, tag: int = 0, exchange: StatusExchange | None = None, wait_site: int = 0):
        """Host barrier over the files' headers, with the status exchange's steps around it when
        given (the device barrier's, in torch ops: the word into every rank's slot before
        arriving, this rank's slot and the all-ok verdict after)."""
        if exchange is not None:
            word = exchange.word()
            for peer in self.peers:
                exchange.slot(peer)[self.rank].copy_(word)
        self._wait_for_peers(tag, wait_site)
        if exchange is not None:
            exchange.finish(exchange.slot(self.peers[self.rank]), self.rank)

    def _wait_for_peers(self, tag: int, wait_site: int = 0):
        me = self.headers[self.rank]
        self.arrived += 1
        n = self.arrived
        me[_TAG + n % 2] = tag
        me[_ARRIVED] = n  # after the tag: x86 keeps stores in order, and a peer reads the count first
        pending = [r for r in range(self.world) if r != self.rank]
        deadline, polls, start = None, 0, time.monotonic_ns()
        while pending:
            waiting = []
            for r in pending:
                h = self.headers[r]
                if h[_ARRIVED] >= n:  # a peer is at most one barrier ahead: slot n % 2 is still barrier n's
                    if h[_TAG + n % 2] != tag:
                        raise MegaMoEPeerError(
                            f"rank {self.rank} at {describe_tag(tag)} met rank {r} at {describe_tag(h[_TAG + n % 2])}: "
                            "the ranks are out of step"
                        )
                elif h[_FAILED]:
                    raise MegaMoEPeerError(
                        f"rank {r} failed in {describe_failure_mark(h[_FAILED])} and left the protocol (rank {self.rank} was waiting at "
                        f"{describe_tag(tag)})"
                    )
                else:
                    waiting.append(r)
            pending = waiting
            if pending:
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now > deadline:
                    raise MegaMoEPeerError(
                        f"rank {self.rank}: {name_ranks(pending)} did not reach {describe_tag(tag)} within "
                        f"{self.timeout_s}s (absent, hung, or stuck in another collective)"
                    )
                polls += 1
                time.sleep(0 if polls < 200 else 1e-4)
        self.wait_ns[wait_site] += time.monotonic_ns() - start

    def has_fault(self) -> bool:
        return False  # CPU barriers raise where they fail; nothing is recorded for later

    def fault_error(self) -> Exception | None:
        return None

    def mark_failed(self, tag: int):
        """Tell the peers (waiting at a barrier) that this rank left the protocol in call `tag // 4`."""
        if self.headers and not self.headers[self.rank][_FAILED]:
            self.headers[self.rank][_FAILED] = tag + 1

    def close(self):
        self.peers = []
        for h in self.headers:
            h.release()
        self.headers = []
        for m in self.maps:
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere; the OS frees it at exit
                pass
        self.maps = []


def _unlink(path: str):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


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


class _CudaSymmetricPeers:
    """CUDA transport: PyTorch symmetric memory (CUDA P2P backend) and our own device barrier
    (device_barrier.py) over a barrier area at the end of every rank's allocation: tagged with
    the call and step, a deadline on every rank, a failure mark per rank, and a fault record in
    pinned host memory that names the rank and call when it traps (faults.py)."""

    def __init__(self, nbytes: int, group, device: torch.device, timeout_s: float, description: str):
        from torch.distributed import _symmetric_memory as symm_mem

        from .device_barrier import area_bytes

        self.timeout_s = timeout_s
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device = device
        self.local = self.handle = self.base_ptrs = None
        self.peers, self.areas = [], []
        self.fault_record = None
        self.wait_ns = torch.zeros(NUM_WAIT_SITES, dtype=torch.int64, device=device)  # device time barriers waited, per site
        _agree_description(group, self.rank, description, timeout_s)
        self.area_offset = -(-nbytes // 256) * 256
        total = self.area_offset + area_bytes(self.world)
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
        from .device_barrier import device_barrier

        exchange_args = None
        if exchange is not None:
            exchange_args = (self.local.data_ptr() + exchange.slot_offset, exchange.verdict, exchange.name,
                             exchange.status_out, exchange.all_ok, exchange.compare_on_device)
        device_barrier(self.base_ptrs, self.area_offset, self.rank, self.world, tag, self.timeout_s,
                       self.fault_record, self.wait_ns[wait_site:wait_site + 1], exchange_args)

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
        from .device_barrier import FAILED, WORDS

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
        description = f"{config!r} on {self.world_size} ranks, {self.layout.nbytes} bytes"
        if self.device.type == "cuda":
            self._transport = _CudaSymmetricPeers(self.layout.nbytes, group, self.device, timeout_s, description)
        else:
            self._transport = _SharedMemoryPeers(self.layout.nbytes, group, timeout_s, description)
        self._failure: str | None = None
        self._regions = []
        for raw in self._transport.peers:
            views = dict.fromkeys(names)
            for name, reg in self.layout.regions.items():
                views[name] = raw[reg.offset : reg.offset + reg.nbytes].view(reg.dtype).view(reg.shape)
            self._regions.append(BufferRegions(**views))
        self.session = BufferSession()

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

    def exchange_status(self, tag: int, parity: int, verdict: torch.Tensor, name: tuple[int, int, int],
                        compare_on_device: bool = False, wait_site: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Barrier `tag` with the status exchange of a call (StatusExchange) in status slot
        `parity`: this rank's verdict (int32 scalar on the device) and call name (epoch, layer
        id, phase) to every rank. Returns (this rank's slot after the barrier, int32 [R, 4]; a
        bool scalar: every rank accepted its input and is in this rank's call). On CUDA one
        kernel launch; nothing is read on the host."""
        R = self.world_size
        region = self.layout.regions["status"]
        exchange = StatusExchange(
            slot_offset=region.offset + parity * R * region.row_bytes, verdict=verdict, name=name,
            status_out=torch.empty(R, 4, dtype=torch.int32, device=self.device),
            all_ok=torch.empty((), dtype=torch.bool, device=self.device), compare_on_device=compare_on_device)
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
        self.session = BufferSession()
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


def destroy_all_symm_buffers():
    for buf in list(_BUFFERS.values()):
        buf.destroy()
