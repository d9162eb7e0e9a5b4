"""The errors a mega_moe call raises on every rank of its group, and the warning of its slow path."""

from __future__ import annotations


class MegaMoEInputError(ValueError):
    """Bad input on this rank or on a peer; the buffer stays usable for the next call."""


class MegaMoECallMismatchError(RuntimeError):
    """The ranks are not in the same call of a buffer (another layer, forward against backward,
    another sequence number). Raised by every rank at the same point; no rows were exchanged."""


class MegaMoEPeerError(RuntimeError):
    """A peer did not arrive within the buffer's timeout, failed between two barriers, or reached
    a barrier of another call. The buffer is unusable afterwards (get_symm_buffer makes a new one)."""


class MegaMoESlowPathWarning(UserWarning):
    """Backend 'auto' runs a call on a CUDA device through the reference executor (plain PyTorch,
    many times slower than the GPU kernels) because no GPU kernel serves its config."""
