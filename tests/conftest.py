import pytest
import torch
from rank_pool import RankPool

_POOLS: dict[tuple[int, str], RankPool] = {}


@pytest.fixture(scope="session")
def rank_pools():
    """rank_pools(n, backend="gloo") -> a RankPool of n processes, started once per test session."""

    def get(world_size: int, backend: str = "gloo") -> RankPool:
        key = (world_size, backend)
        pool = _POOLS.get(key)
        if pool is None or not pool.alive:
            _POOLS[key] = RankPool(world_size, backend)
        return _POOLS[key]

    yield get
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _close_wide_pools():
    """Pools of more than 2 ranks end with the module that used them: their idle processes still
    take CPU time (seen 2026-12-03: 12 idle ranks held about one of CI's two cores for the rest of
    the run), and few modules need them."""
    yield
    for key in [k for k in _POOLS if k[0] > 2]:
        _POOLS.pop(key).close()
