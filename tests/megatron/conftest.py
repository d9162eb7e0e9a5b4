import pytest
from rank_pool import RankPool

# (the test modules skip themselves with pytest.importorskip("megatron.core") when it is absent)

_POOL: dict[tuple[str, int], RankPool] = {}


@pytest.fixture(scope="session")
def mcore_pool():
    """mcore_pool(backend="gloo", world=2): `world` processes (gloo on CPU; "nccl": one GPU each)
    with the CPU shims and Megatron's model-parallel state (EP=world), shared by every Megatron
    test. Separate from the rank_pools processes: the shims are process-global.
    Not daemonic: Megatron's dist-checkpoint writer starts a multiprocessing Manager."""

    def get(backend: str = "gloo", world: int = 2) -> RankPool:
        key = (backend, world)
        pool = _POOL.get(key)
        if pool is None or not pool.alive:
            _POOL[key] = RankPool(world, backend, daemon=False)
        return _POOL[key]

    yield get
    for pool in _POOL.values():
        pool.close()
    _POOL.clear()


@pytest.fixture(autouse=True, scope="module")
def _close_wide_pools():
    """Pools of more than 2 ranks end with the module that used them: their idle processes still
    take CPU time (seen 2026-12-03: 12 idle ranks held about one of CI's two cores for the rest of
    the run), and few modules need them."""
    yield
    for key in [k for k in _POOL if k[1] > 2]:
        _POOL.pop(key).close()
