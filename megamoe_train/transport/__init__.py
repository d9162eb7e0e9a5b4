"""The transports of the symmetric buffer, behind one interface (base.Transport): CPU shared
memory (shared_memory.py) and CUDA symmetric memory (cuda_symmetric.py)."""

from __future__ import annotations

import torch

from .base import NUM_WAIT_SITES, StatusExchange, Transport
from .cuda_symmetric import CudaSymmetricPeers
from .shared_memory import SharedMemoryPeers

__all__ = ["NUM_WAIT_SITES", "CudaSymmetricPeers", "SharedMemoryPeers", "StatusExchange", "Transport", "open_transport"]


def open_transport(nbytes: int, group, device: torch.device, timeout_s: float, description: str) -> Transport:
    """Every rank's buffer of nbytes (collective): CUDA symmetric memory on a CUDA device, /dev/shm
    files otherwise."""
    if device.type == "cuda":
        return CudaSymmetricPeers(nbytes, group, device, timeout_s, description)
    return SharedMemoryPeers(nbytes, group, timeout_s, description)
