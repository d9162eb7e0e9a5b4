import pytest

from rank_pool import RankPool

# (the test modules skip themselves with pytest.importorskip("megatron.core") when it is absent)

_POOL: dict[int, RankPool] = {}


@pytest.fixture(scope="session")
def mcore_pool():
    """Two gloo processes with the CPU shims and Megatron's model-parallel state (EP=2), shared by
    every Megatron test. Separate from the rank_pools processes: the shims are process-global.
    Not daemonic: Megatron's dist-checkpoint writer starts a multiprocessing Manager."""

    def get() -> RankPool:
        pool = _POOL.get(2)
        if pool is None or not pool.alive:
            _POOL[2] = RankPool(2, "gloo", daemon=False)
        return _POOL[2]

    yield get
    for pool in _POOL.values():
        pool.close()
    _POOL.clear()
