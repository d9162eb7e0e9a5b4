import pytest
import torch

from rank_pool import RankPool

_POOLS: dict[int, RankPool] = {}


@pytest.fixture(scope="session")
def rank_pools():
    """rank_pools(n) -> a RankPool of n processes, started once per test session."""

    def get(world_size: int) -> RankPool:
        pool = _POOLS.get(world_size)
        if pool is None or not pool.alive:
            _POOLS[world_size] = RankPool(world_size)
        return _POOLS[world_size]

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
