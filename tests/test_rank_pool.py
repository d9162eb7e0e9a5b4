"""The test processes' pool (tests/rank_pool.py) waits on its ranks, not on a clock: slow work
is waited for, a rank that dies fails the run, naming it."""

import os
import time

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
