"""The CPU transport: every rank's buffer is a file in /dev/shm that every process of the group
maps, so the very same pull/push protocol runs between real processes. Barriers poll counters
in the files' headers (the words the CUDA device barrier keeps in device memory). The count and
the failure mark are stored with release and loaded with acquire semantics (`_C`): a peer that
sees them sees every row written before them, on weakly ordered CPUs (ARM) too."""

from __future__ import annotations

import ctypes
import datetime
import errno
import mmap
import os
import struct
import time
import uuid

import torch
import torch.distributed as dist

from .. import _C
from ..errors import MegaMoEPeerError
from ..faults import describe_failure_mark, describe_tag, name_ranks
from .base import NUM_WAIT_SITES, StatusExchange

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
            r: dist.isend(token, dst=dist.get_global_rank(group, r), group=group, tag=_TOKEN_TAG)
            for r in range(1, world)
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


def _agree_room(group, rank: int, file_bytes: int, free: int | None, timeout_s: float) -> None:
    """Every rank learns which ranks' /dev/shm had no room for their file (`free`: None where it
    fit, else the bytes that were free there) and raises the same error, instead of the peers of
    such a rank waiting out the timeout for its file."""
    world = dist.get_world_size(group)
    mine = torch.tensor([-1 if free is None else free], dtype=torch.int64)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise MegaMoEPeerError(
            f"SymmBuffer creation (rank {rank}): the group's check of /dev/shm room did not complete within "
            f"{timeout_s}s ({e})"
        ) from e
    short = {r: int(t) for r, t in enumerate(gathered) if int(t) >= 0}
    if short:
        where = ", ".join(f"rank {r}: {f} bytes ({f / 2**30:.2f} GiB) free" for r, f in short.items())
        raise ValueError(
            f"SymmBuffer creation (rank {rank}): /dev/shm has no room for a rank's buffer file of {file_bytes} "
            f"bytes ({file_bytes / 2**30:.2f} GiB) on {where}. Every rank of the group keeps one such file there. "
            "Its size is num_max_tokens_per_rank times rows of hidden values (layout.py): lower "
            "num_max_tokens_per_rank, or give /dev/shm more room (a container's --shm-size)"
        )


class SharedMemoryPeers:
    """CPU transport: every rank's buffer is a /dev/shm file mapped into every process. Barriers
    poll counters in the files' headers with a deadline, so the timeout holds on every rank and
    names the missing ranks; each barrier carries a tag (the call and step) that peers compare."""

    def __init__(self, nbytes: int, group, timeout_s: float, description: str):
        self.timeout_s = timeout_s
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.arrived = 0
        self.wait_ns = torch.zeros(NUM_WAIT_SITES, dtype=torch.int64)  # host time barriers waited for peers, per site
        self.maps, self.headers, self.peers = [], [], []
        self.arrived_at, self.failed_at = [], []  # addresses of each rank's _ARRIVED and _FAILED words
        token = _agree_token(group, self.rank, timeout_s)
        paths = [f"/dev/shm/megamoe-{token}-{r}" for r in range(self.world)]
        try:
            free = self._create(paths[self.rank], nbytes, description)
            _agree_room(group, self.rank, _HEADER_BYTES + nbytes, free, timeout_s)
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

    def _create(self, path: str, nbytes: int, description: str) -> int | None:
        """Write the file under a temporary name, then rename: a peer sees it whole or not at all.
        Its pages are reserved here: a sparse file on a /dev/shm without room would fail only at
        a later write, with SIGBUS. Returns None, or where /dev/shm has no room the bytes it had
        free (the file removed), for `_agree_room` to raise on every rank."""
        text = description.encode()
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, _HEADER_BYTES + nbytes)  # zero-filled
            if hasattr(os, "posix_fallocate"):  # Linux; elsewhere the file stays sparse
                try:
                    os.posix_fallocate(fd, 0, _HEADER_BYTES + nbytes)
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        os.ftruncate(fd, 0)  # what it took, back before measuring the room
                        free = os.statvfs(os.path.dirname(tmp))
                        _unlink(tmp)
                        return free.f_bavail * free.f_frsize
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # else a file system without it: sparse
                        raise
            os.pwrite(fd, struct.pack("q", len(text)), _DESCRIPTION_LEN * 8)
            os.pwrite(fd, text[: _HEADER_BYTES - _DESCRIPTION_AT], _DESCRIPTION_AT)
            os.rename(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        finally:
            os.close(fd)
        return None

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
        starts = [_address(m) for m in maps]
        self.arrived_at = [a + 8 * _ARRIVED for a in starts]
        self.failed_at = [a + 8 * _FAILED for a in starts]

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
        # The tag may be a plain store: the count's release store below publishes it (with this
        # rank's rows) and peers read it only after their acquire load has seen the count.
        me[_TAG + n % 2] = tag
        _C.store_release_i64(self.arrived_at[self.rank], n)
        pending = [r for r in range(self.world) if r != self.rank]
        deadline, polls, start = None, 0, time.monotonic_ns()
        while pending:
            waiting = []
            for r in pending:
                # a peer is at most one barrier ahead: slot n % 2 is still barrier n's
                if _C.load_acquire_i64(self.arrived_at[r]) >= n:
                    peer_tag = self.headers[r][_TAG + n % 2]
                    if peer_tag != tag:
                        raise MegaMoEPeerError(
                            f"rank {self.rank} at {describe_tag(tag)} met rank {r} at {describe_tag(peer_tag)}: "
                            "the ranks are out of step"
                        )
                elif failed := _C.load_acquire_i64(self.failed_at[r]):
                    raise MegaMoEPeerError(
                        f"rank {r} failed in {describe_failure_mark(failed)} and left the protocol "
                        f"(rank {self.rank} was waiting at "
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
        if self.failed_at and not _C.load_acquire_i64(self.failed_at[self.rank]):
            _C.store_release_i64(self.failed_at[self.rank], tag + 1)

    def close(self):
        self.peers = []
        self.arrived_at, self.failed_at = [], []  # unmapped below: never to be touched again
        for h in self.headers:
            h.release()
        self.headers = []
        for m in self.maps:
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere; the OS frees it at exit
                pass
        self.maps = []


def _address(m: mmap.mmap) -> int:
    """Where a mapping starts. The ctypes view is dropped at once: its buffer export would keep
    close() from unmapping the file."""
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def _unlink(path: str):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
