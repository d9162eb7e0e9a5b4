"""The test processes' pool (tests/rank_pool.py) waits on its ranks, not on a clock: slow work
is waited for, a rank that dies fails the run, naming it; a failed run leaves no process its ranks
started (each rank's process group is ended)."""

import multiprocessing
import os
import subprocess
import sys
import time

import psutil
import pytest
from rank_pool import RankPool


def _work(rank, world, seconds):
    time.sleep(seconds)
    return rank


def _die_on_rank_1(rank, world):
    if rank == 1:
        os._exit(3)
    return rank  # rank 0 answers: the run reports rank 1's exit


def test_a_rank_that_dies_fails_the_run_at_once():
    pool = RankPool(2)
    try:
        assert pool.run(_work, 0.5) == [0, 1]
        # told by rank 1's exit, not after a fixed wait
        with pytest.raises(AssertionError, match="_die_on_rank_1: rank 1 exited with code 3"):
            pool.run(_die_on_rank_1)
    finally:
        pool.close(force=True)


def _start_child_then_fail(rank, world, pid_dir, how):
    """Each rank starts a sleeping child (in its process group), then rank 1 fails."""
    if how == "raises":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]).pid
    else:  # the way Megatron's checkpoint writer forks (the pool is not daemonic)
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
        child.start()
        child = child.pid
    with open(os.path.join(pid_dir, f"child{rank}"), "w") as f:
        f.write(str(child))
    if rank == 1:
        if how == "raises":
            raise RuntimeError("rank 1 fails")
        os._exit(3)  # its child is handed to init, still in the rank's group
    return rank


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _left_in_group(pgid: int) -> list[int]:
    left = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p.pid)
        except (OSError, psutil.Error):
            continue
    return left


@pytest.mark.parametrize("how", ["raises", "exits"])
def test_a_failed_run_ends_every_process_its_ranks_started(tmp_path, how):
    pool = RankPool(2, daemon=(how == "raises"))  # multiprocessing forks only from non-daemonic ranks
    ranks = [p.pid for p in pool.procs]
    try:
        with pytest.raises(AssertionError, match="_start_child_then_fail"):
            pool.run(_start_child_then_fail, str(tmp_path), how)
    finally:
        pool.close(force=True)
    children = [int((tmp_path / f"child{r}").read_text()) for r in range(2)]
    assert not [pid for pid in children if _running(pid)]
    assert not [pid for pgid in ranks for pid in _left_in_group(pgid)]
