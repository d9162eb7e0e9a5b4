import pytest

from rank_pool import RankPool

# (the test modules skip themselves with pytest.importorskip("megatron.core") when it is absent)

_POOL: dict[str, RankPool] = {}


@pytest.fixture(scope="session")
def mcore_pool():
    """mcore_pool(backend="gloo"): two processes (gloo on CPU; "nccl": one GPU each) with the CPU shims and Megatron's model-parallel state (EP=2), shared by
    every Megatron test. Separate from the rank_pools processes: the shims are process-global.
    Not daemonic: Megatron's dist-checkpoint writer starts a multiprocessing Manager."""

    def get(backend: str = "gloo") -> RankPool:
        pool = _POOL.get(backend)
        if pool is None or not pool.alive:
            _POOL[backend] = RankPool(2, backend, daemon=False)
        return _POOL[backend]

    yield get
    for pool in _POOL.values():
        pool.close()
    _POOL.clear()
