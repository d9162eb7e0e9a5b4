"""Both transports implement the one interface the symmetric buffer uses (transport.base.Transport)."""

import inspect

import pytest
import torch

from megamoe_train import MegaMoEConfig, get_symm_buffer
from megamoe_train.transport import CudaSymmetricPeers, SharedMemoryPeers, Transport

METHODS = [name for name, v in vars(Transport).items() if inspect.isfunction(v) and not name.startswith("_")]


@pytest.mark.parametrize("cls", [SharedMemoryPeers, CudaSymmetricPeers])
def test_each_transport_has_the_interface_methods(cls):
    assert METHODS == ["barrier", "has_fault", "fault_error", "mark_failed", "close"]
    for name in METHODS:
        assert str(inspect.signature(getattr(cls, name))) == str(inspect.signature(getattr(Transport, name))), name


def cpu_buffer_transport_is_a_transport(rank, world):
    cfg = MegaMoEConfig(
        num_experts=4, hidden=32, intermediate=16, topk=2, num_max_tokens_per_rank=8, block_m=8, dtype=torch.float32
    )
    buf = get_symm_buffer(None, cfg, timeout_s=20)
    transport = buf._transport
    ok = isinstance(transport, SharedMemoryPeers) and isinstance(transport, Transport) and len(transport.peers) == world
    buf.destroy()
    return ok


def test_cpu_buffer_runs_on_the_shared_memory_transport(rank_pools):
    assert rank_pools(2).run(cpu_buffer_transport_is_a_transport) == [True, True]
