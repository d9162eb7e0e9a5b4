"""The ranks of a `megamoe-train` run as processes: started by the launcher (`run_ranks`), and
ended with the run however it ends, leaving no process and no temporary file behind.

- Each rank leads a process group of its own (`guard_rank`), which the processes it starts join:
  megatron-core's checkpoint writer starts a multiprocessing Manager per rank (about 0.5 GB) and
  may fork writer processes. Ending a rank's group ends them all, even those whose rank was
  killed and which were handed to init.
- A rank that fails (raises, or is killed) ends the run: the launcher stops the other ranks'
  groups at once (SIGTERM, SIGKILL after a grace) and exits with EXIT_RANK_FAILED. Its error is
  the first rank's to fail: a peer blocked in a collective with it fails a moment later (gloo's
  "connection reset by peer"), and may be seen by the launcher in the same wake-up.
- SIGINT, SIGTERM or SIGHUP to the launcher stops every rank's group the same way; the launcher
  exits with 128 + the signal number once they have ended. Ranks are not in the launcher's
  process group, so a terminal's Ctrl-C reaches the launcher alone and the ranks stop through it.
- A launcher that is killed outright (SIGKILL) cannot stop anything: each rank watches its
  launcher (`parent_process().sentinel`) and ends its own group when it is gone.
- The ranks' temporary files (multiprocessing's pymp-* directories, which a killed Manager leaves
  behind) go to a directory of the run's own, removed at the end.
- Every rank co-holds the run dir's lock (run_lock), so the run dir is free only once all have
  ended.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import connection, reduction
from typing import Callable

import torch.multiprocessing as mp

__all__ = ["EXIT_RANK_FAILED", "RunEnd", "run_ranks", "guard_rank", "end_groups", "STOP_SIGNALS"]

EXIT_RANK_FAILED = 1
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_GRACE_S = 10.0  # from SIGTERM to SIGKILL when stopping the ranks
_SETTLE_S = 0.5  # after a first failure, for the rank that caused it to end too
_ERROR_FILE = "error.txt"  # a failed rank's traceback, in its temporary directory
# when it failed (CLOCK_MONOTONIC ns, one clock for all processes of the host): file times are
# too coarse (a kernel tick) to order a failure and the peer failure it causes
_FAILED_AT_FILE = "failed_at"
# a Manager's socket, TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, must fit AF_UNIX's 107 bytes; with
# a longer TMPDIR the ranks keep the default one (and a killed Manager may leave its pymp-* there)
_MAX_TMP_PATH = 107 - 32


@dataclass
class RunEnd:
    """How the ranks ended: the launcher's exit status, and the error line (None: success)."""

    code: int
    message: str | None = None


class _InheritedFd:
    """A file descriptor a spawned process receives as the same open file (the run dir's lock)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _InheritedFd, (reduction.DupFd(self.fd).detach(),)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _end_group(pgid: int, sig: int):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (a zombie, ended and waiting for init to reap
    it, does not count)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    import psutil  # a dependency of megatron-core's checkpoint writer

    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):
            continue
    return False


def end_groups(procs: list, timeout: float = 60.0) -> bool:
    """SIGKILL to the group of each started process in `procs` (led by it once it ran
    `guard_rank`: whatever is left of it, its Managers and writers included) and to the process
    itself (in case it had not made its group yet); wait for the processes, then until the groups
    are empty, `timeout` seconds at most. Returns whether they are."""
    procs = [p for p in procs if p.pid is not None]
    for p in procs:
        _end_group(p.pid, signal.SIGKILL)
        if p.exitcode is None:
            p.kill()
    for p in procs:
        p.join()
    deadline = time.monotonic() + timeout  # killed processes handed to init end within moments
    while any(_group_alive(p.pid) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_group_alive(p.pid) for p in procs)


def guard_rank(rank_tmp: str):
    """In a rank, first: lead a process group of its own (what ending the rank's group ends),
    keep temporary files in `rank_tmp`, and end the group when the launcher is gone."""
    os.setpgid(0, 0)
    os.makedirs(rank_tmp, exist_ok=True)
    if len(rank_tmp) <= _MAX_TMP_PATH:
        os.environ["TMPDIR"] = rank_tmp  # the processes this rank starts inherit it
        tempfile.tempdir = None

    parent = mp.parent_process()
    if parent is None:
        return

    def watch():
        connection.wait([parent.sentinel])  # readable once the launcher has ended
        shutil.rmtree(rank_tmp, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(rank_tmp))  # the last rank removes the run's directory
        except OSError:
            pass
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="megamoe-train launcher watch", daemon=True).start()


def _rank_process(rank: int, target: Callable, args: tuple, lock: _InheritedFd | None, run_tmp: str):
    """A rank: `lock` is only held (its descriptor stays open for the process's life, so the run
    dir stays locked while this rank runs)."""
    rank_tmp = os.path.join(run_tmp, f"r{rank}")
    guard_rank(rank_tmp)
    try:
        target(rank, *args)
    except BaseException:
        failed_at = time.monotonic_ns()
        text = traceback.format_exc()
        with open(os.path.join(rank_tmp, _ERROR_FILE), "w") as f:
            f.write(text)
        with open(os.path.join(rank_tmp, _FAILED_AT_FILE + ".part"), "w") as f:
            f.write(str(failed_at))
        os.rename(f.name, os.path.join(rank_tmp, _FAILED_AT_FILE))  # whole once it is there
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_RANK_FAILED)  # the launcher ends this rank's group (and the other ranks)


class _Signals:
    """The stop signals of the launcher, noted and made to wake `wait` (a self-pipe)."""

    def __init__(self):
        self.received: list[int] = []
        self.read, self.write = socket.socketpair()
        self.read.setblocking(False)
        self.write.setblocking(False)
        self.previous = {}

    def __enter__(self):
        self.previous_wakeup = signal.set_wakeup_fd(self.write.fileno(), warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            self.previous[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, number, frame):
        self.received.append(number)

    def drain(self):
        try:
            while self.read.recv(512):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self.previous_wakeup)
        self.read.close()
        self.write.close()


class _Ranks:
    def __init__(self, procs: list, run_tmp: str):
        self.procs, self.run_tmp = procs, run_tmp

    def live(self) -> list:
        return [p for p in self.procs if p.exitcode is None]

    def stop(self, signals: _Signals | None = None):
        """End every rank's group: SIGTERM, then SIGKILL after the grace (at once on a second
        signal), and wait for the rank processes."""
        for p in self.procs:
            _end_group(p.pid, signal.SIGTERM)
            if p.exitcode is None:
                p.terminate()  # a rank that had not made its group yet
        seen = len(signals.received) if signals is not None else 0
        deadline = time.monotonic() + _GRACE_S
        while self.live() and time.monotonic() < deadline:
            if signals is not None and len(signals.received) > seen:
                break
            connection.wait([p.sentinel for p in self.live()] + ([signals.read] if signals else []), timeout=0.5)
            if signals is not None:
                signals.drain()
        self.kill_all()

    def kill_all(self):
        """SIGKILL to every rank's group (whatever is left of it: the ranks' Managers and writers),
        then wait until the groups are empty."""
        return end_groups(self.procs)

    def failed(self) -> list[tuple[int, object]]:
        """The ranks that have failed: ended with an error, or raised and still ending (their
        failure time is on record before their sockets close, which is what peers fail on)."""
        return [
            (rank, p)
            for rank, p in enumerate(self.procs)
            if p.exitcode not in (None, 0) or os.path.exists(os.path.join(self.run_tmp, f"r{rank}", _FAILED_AT_FILE))
        ]

    def first_failed(self, failed: list[tuple[int, object]]) -> tuple[int, object]:
        """The failed rank to report: one that died without raising (killed, its peers failing
        after it) before any that raised, and among those that raised the earliest."""

        def failed_at(item):
            path = os.path.join(self.run_tmp, f"r{item[0]}", _FAILED_AT_FILE)
            try:
                with open(path) as f:
                    return (1, int(f.read()), item[0])
            except (OSError, ValueError):
                return (0, 0, item[0])

        return min(failed, key=failed_at)

    def failure(self, p, rank: int) -> str:
        path = os.path.join(self.run_tmp, f"r{rank}", _ERROR_FILE)
        if os.path.isfile(path):
            with open(path) as f:
                text = f.read().rstrip()
            print(text, file=sys.stderr, flush=True)
            last = text.splitlines()[-1] if text else "unknown error"
            return f"rank {rank} failed: {last}"
        if p.exitcode < 0:
            return f"rank {rank} was killed by {_signal_name(-p.exitcode)}"
        return f"rank {rank} exited with code {p.exitcode}"


def run_ranks(target: Callable, world: int, args: tuple, lock_fd: int | None = None) -> RunEnd:
    """target(rank, *args) in `world` spawned processes, supervised as the module says."""
    ctx = mp.get_context("spawn")
    run_tmp = tempfile.mkdtemp(prefix="megamoe-")
    lock = _InheritedFd(lock_fd) if lock_fd is not None else None
    procs = []
    try:
        with _Signals() as signals:
            for rank in range(world):
                p = ctx.Process(target=_rank_process, args=(rank, target, args, lock, run_tmp), name=f"rank {rank}")
                p.start()
                procs.append(p)
                if signals.received:
                    break
            ranks = _Ranks(procs, run_tmp)
            while not signals.received and ranks.live():
                # a rank's sentinel is also held by the writers it forks: look at exit codes too
                connection.wait([p.sentinel for p in ranks.live()] + [signals.read], timeout=1.0)
                signals.drain()
                failed = ranks.failed()
                if failed:
                    # a rank whose failure caused this one may not have ended yet: a moment for it
                    if ranks.live():
                        connection.wait([p.sentinel for p in ranks.live()], timeout=_SETTLE_S)
                    rank, p = ranks.first_failed(ranks.failed())
                    message = ranks.failure(p, rank)
                    ranks.stop(signals)
                    return RunEnd(EXIT_RANK_FAILED, message)
            if signals.received:
                number = signals.received[0]
                print(f"[megamoe-train] {_signal_name(number)}: stopping the ranks", file=sys.stderr, flush=True)
                ranks.stop(signals)
                return RunEnd(
                    128 + number,
                    f"stopped by {_signal_name(number)}; every rank has ended (a new invocation resumes from the "
                    "latest checkpoint)",
                )
            ranks.kill_all()  # what finished ranks left running
            return RunEnd(0)
    finally:
        if procs and _Ranks(procs, run_tmp).kill_all():
            _stop_resource_tracker()
        shutil.rmtree(run_tmp, ignore_errors=True)


def _stop_resource_tracker():
    """End multiprocessing's resource tracker, which spawning the ranks started and which the
    ranks' processes shared: otherwise it outlives the launcher for a moment (it ends when the
    last process holding its pipe has). Private API, hence the guard."""
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is not None:
        try:
            stop()
        except Exception:
            pass
