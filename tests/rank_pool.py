"""A pool of real processes, one per rank, joined in a process group (gloo on CPU, NCCL on GPUs), that runs test
functions on every rank. Starting processes is the slow part, so one pool serves many tests."""

from __future__ import annotations

import os
import queue
import traceback

import torch.multiprocessing as mp

from megamoe_train.launch import free_port

STOP = "stop"


def _worker(rank, world_size, port, backend, tasks, results):
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
        port = free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, backend, self.tasks[r], self.results), daemon=daemon)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, *args, timeout: float = 180, **kwargs):
        """fn(rank, world_size, *args, **kwargs) on every rank; per-rank results in rank order.
        fn must be importable by name (a module-level function of a test module)."""
        for q in self.tasks:
            q.put((fn, args, kwargs))
        out, errors = [None] * self.world_size, []
        for _ in range(self.world_size):
            # once a rank failed, its peers may wait forever inside a collective: give them a little time
            wait = min(timeout, 20) if errors else timeout
            try:
                rank, ok, value = self.results.get(timeout=wait)
            except queue.Empty:
                self.close(force=True)
                if errors:
                    break
                raise TimeoutError(f"{fn.__name__}: ranks did not finish within {timeout}s") from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:  # a failed rank can leave its peers inside a collective: start afresh next time
            self.close(force=True)
            raise AssertionError(f"{fn.__name__} failed:\n" + "\n".join(sorted(errors)))
        return out

    def close(self, force: bool = False):
        if not force:
            for q in self.tasks:
                q.put(STOP)
            for p in self.procs:
                p.join(timeout=30)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


os.environ.setdefault("OMP_NUM_THREADS", "1")
