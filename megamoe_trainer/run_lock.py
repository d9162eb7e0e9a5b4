"""The run dir's lock: one `megamoe-train` invocation at a time per run dir.

RUN/run.lock is locked exclusively (`fcntl.flock`) by the launcher before it reads or writes
anything else there, and every rank it starts holds the same lock through an inherited file
descriptor: the kernel releases it only when the launcher and all its ranks have ended, however
they end. The file names its holder (PID, host, start time) while locked and is emptied by a
clean release, so a lock file that still names a holder when its lock is free was left by a run
that did not end cleanly: the next invocation takes it over and says so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time

__all__ = ["LOCK_NAME", "RunDirBusy", "RunDirLock"]

LOCK_NAME = "run.lock"
# after its launcher was killed, a run's ranks stop within moments (supervisor.guard_rank): wait
# that long for the lock before calling the run dir busy
_DEAD_HOLDER_WAIT_S = 30.0


class RunDirBusy(RuntimeError):
    """Another run holds the run dir."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(holder: dict) -> str:
    return f"megamoe-train PID {holder.get('pid')} on {holder.get('host')} (started {holder.get('started')})"


class RunDirLock:
    """The lock of `run_dir` (created if needed). `acquire()` takes it or raises RunDirBusy
    naming the holder; `fd` is the descriptor ranks inherit to co-hold it; `release()` empties
    the file (a clean end) and unlocks."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.fd: int | None = None

    def _read_holder(self, fd: int) -> dict | None:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 4096).decode(errors="replace").strip()
        if not text:
            return None
        try:
            holder = json.loads(text)
        except json.JSONDecodeError:
            return {"pid": None, "host": "?", "started": "?", "raw": text}
        return holder if isinstance(holder, dict) else {"pid": None, "host": "?", "started": "?"}

    def _try_lock(self, fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise

    def acquire(self, say=print) -> RunDirLock:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not self._try_lock(fd):
                holder = self._read_holder(fd) or {}
                pid, host = holder.get("pid"), holder.get("host")
                if not (isinstance(pid, int) and host == socket.gethostname() and not _alive(pid)):
                    raise RunDirBusy(
                        f"{os.path.dirname(self.path)} is in use by {_describe(holder)}: wait for it to end, "
                        "or give this run another run.dir"
                    )
                # its launcher is gone; its ranks are stopping (they end when their launcher does)
                say(f"[megamoe-train] waiting for the ranks of the ended {_describe(holder)} to stop", flush=True)
                deadline = time.monotonic() + _DEAD_HOLDER_WAIT_S
                while not self._try_lock(fd):
                    if time.monotonic() > deadline:
                        raise RunDirBusy(
                            f"{os.path.dirname(self.path)} is still locked by the ranks of the ended "
                            f"{_describe(holder)} after {_DEAD_HOLDER_WAIT_S:.0f} s: end them, then run again"
                        )
                    time.sleep(0.2)
            stale = self._read_holder(fd)
            if stale is not None:
                say(
                    f"[megamoe-train] taking over {self.path}: {_describe(stale)} ended without releasing it",
                    flush=True,
                )
            me = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "argv": sys.argv,
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return self

    def release(self):
        """A clean end: the file no longer names a holder, and the lock is free once every rank
        that inherited it has ended too."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunDirLock:
        return self.acquire() if self.fd is None else self

    def __exit__(self, *exc):
        self.release()
