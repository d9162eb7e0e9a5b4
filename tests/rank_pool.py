"""A pool of real processes, one per rank, joined in a process group (gloo on CPU, NCCL on GPUs), that runs test
functions on every rank. Starting processes is the slow part, so one pool serves many tests.

Results are waited for as long as the ranks live (`next_result`), not for a fixed time: a
busy machine only makes the ranks slower, a rank that dies fails the run as soon as the others
have answered (or had a short grace: they may wait for it forever), and a test that hangs is
ended by pytest-timeout (pyproject.toml).

Each rank leads a process group of its own, as the launcher's ranks do (megamoe_trainer.supervisor):
ending the pool ends every process a rank started (Megatron's checkpoint Manager, a forked writer),
also those whose rank died, and a rank ends its group when the test process is gone."""

from __future__ import annotations

import atexit
import os
import queue
import shutil
import tempfile
import traceback
import warnings

import torch.multiprocessing as mp

from megamoe_train.launch import free_port
from megamoe_trainer.supervisor import end_groups

STOP = "stop"
_POLL_S = 1.0  # how often a wait for results looks at the processes


class RankDied(AssertionError):
    """A rank process exited with a nonzero code before returning its result."""

    def __init__(self, what: str, rank: int, code: int):
        self.rank, self.code = rank, code
        super().__init__(f"{what}: rank {rank} exited with code {code} before returning its result")


def next_result(results, procs, what: str, timeout: float | None = None, dead: frozenset = frozenset()):
    """The next item of the `results` queue, waiting while the processes in `procs` live:
    RankDied for one that exits with a nonzero code (but those in `dead`, already reported);
    `timeout`: a limit in seconds, None for none."""
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        wait = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
        try:
            return results.get(timeout=wait)
        except queue.Empty:
            pass
        for rank, p in enumerate(procs):
            if rank not in dead and p.exitcode not in (None, 0):
                raise RankDied(what, rank, p.exitcode)
        if all(p.exitcode is not None for p in procs):
            raise AssertionError(f"{what}: every rank exited, results are missing")
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: ranks did not finish within {timeout}s")


def _worker(rank, world_size, port, backend, tasks, results, rank_tmp):
    from megamoe_trainer.supervisor import guard_rank

    guard_rank(rank_tmp)  # first: the group the pool ends holds all this rank starts
    import torch

    from megamoe_train.launch import init_rank

    torch.set_num_threads(1)
    init_rank(rank, world_size, port, backend)
    while True:
        task = tasks.get()
        if task == STOP:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(rank, world_size, *args, **kwargs)))
        except BaseException:  # report and keep serving
            results.put((rank, False, traceback.format_exc()))
    from megamoe_train.launch import finish_rank

    finish_rank()


class RankPool:
    def __init__(self, world_size: int, backend: str = "gloo", daemon: bool = True):
        """daemon=False lets ranks start processes of their own (Megatron's checkpoint writer does);
        close() must then be called (the fixtures do)."""
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.tmp = tempfile.mkdtemp(prefix="rank-pool-")  # the ranks' TMPDIR (guard_rank)
        self.closed = False
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, backend, self.tasks[r], self.results, os.path.join(self.tmp, f"r{r}")),
                daemon=daemon,
            )
            for r in range(world_size)
        ]
        # before multiprocessing's own exit handler (atexit runs the latest first), which would
        # wait forever for non-daemonic ranks of a pool nobody closed
        atexit.register(self.close, force=True)
        for p in self.procs:
            p.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, *args, timeout: float | None = None, **kwargs):
        """fn(rank, world_size, *args, **kwargs) on every rank; per-rank results in rank order.
        fn must be importable by name (a module-level function of a test module). Waits as long
        as the ranks live, or `timeout` seconds where given."""
        for q in self.tasks:
            q.put((fn, args, kwargs))
        out, errors, dead = [None] * self.world_size, [], set()
        for _ in range(self.world_size):
            # once a rank failed, its peers may wait forever inside a collective: give them a little time
            wait = 20 if errors else timeout
            try:
                rank, ok, value = next_result(self.results, self.procs, fn.__name__, wait, frozenset(dead))
            except RankDied as died:
                dead.add(died.rank)
                errors.append(f"--- rank {died.rank} ---\n{died}")
                continue
            except (TimeoutError, AssertionError):
                self.close(force=True)
                if errors:
                    break
                raise
            if ok:
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:  # a failed rank can leave its peers inside a collective: start afresh next time
            self.close(force=True)
            raise AssertionError(f"{fn.__name__} failed:\n" + "\n".join(sorted(errors)))
        return out

    def close(self, force: bool = False):
        """End the ranks (force: at once, else once they have stopped, 30 s at most) and their
        process groups. Once only: a rank's pid may lead another pool's group later."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if not force:
            for q in self.tasks:
                q.put(STOP)
            for p in self.procs:
                p.join(timeout=30)
        if not end_groups(self.procs):  # a warning: close() also runs while a failure is being raised
            warnings.warn("rank pool: processes of its ranks' groups outlived SIGKILL", RuntimeWarning, stacklevel=2)
        shutil.rmtree(self.tmp, ignore_errors=True)


os.environ.setdefault("OMP_NUM_THREADS", "1")
