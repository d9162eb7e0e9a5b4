"""What the symmetric buffer (symm_buffer.py) asks of a transport, and the status exchange
that a transport's barrier carries.

A transport maps every rank's buffer into this process and runs the tagged cross-rank barrier
over it. Two implement it: shared_memory.py (CPU: /dev/shm files mapped by every process of the
group) and cuda_symmetric.py (CUDA: PyTorch symmetric memory and the device barrier). Both run
the same barrier over the same words (a count, two tags, a failure mark per rank), so the
protocol above them is one program on both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..faults import STATUS_OK

# Barrier wait counters, one per protocol site (the protocol names them, protocol.WAIT_SITES):
# where a rank stood still tells which part of the step its peers were late in.
NUM_WAIT_SITES = 4


@dataclass
class StatusExchange:
    """A protocol call's status exchange, done by its first barrier: this rank's status word
    (verdict, then the call's name: epoch, layer id, phase) goes into its row of the call's slot
    (int32 [R, 4] at slot_offset in every rank's buffer) before it arrives; after the wait
    status_out gets a copy of this rank's slot and all_ok (bool scalar) says whether every word
    accepts its input (faults.STATUS_OK) and names this rank's call. compare_on_device (captured
    CUDA calls): the device barrier also traps on a mismatch or a rejected input."""

    slot_offset: int
    verdict: torch.Tensor  # int32 scalar, on the buffer's device
    name: tuple[int, int, int]
    status_out: torch.Tensor
    all_ok: torch.Tensor
    compare_on_device: bool = False

    def word(self) -> torch.Tensor:
        word = torch.tensor([0, *self.name], dtype=torch.int32, device=self.verdict.device)
        word[0] = self.verdict
        return word

    def slot(self, raw: torch.Tensor) -> torch.Tensor:
        """The slot in a rank's buffer (raw: its bytes), shaped like status_out."""
        nbytes = self.status_out.numel() * self.status_out.element_size()
        return raw[self.slot_offset : self.slot_offset + nbytes].view(torch.int32).view(self.status_out.shape)

    def finish(self, slot: torch.Tensor, rank: int):
        """status_out and all_ok from this rank's slot after the barrier (the device barrier's rule)."""
        self.status_out.copy_(slot)
        names_match = (self.status_out[:, 1:] == self.status_out[rank, 1:]).all()
        self.all_ok.copy_((self.status_out[:, 0] == STATUS_OK).all() & names_match)


@runtime_checkable
class Transport(Protocol):
    """Every rank's buffer, mapped here, and the barrier between the ranks of the group.

    Made collectively (every rank of the group, the same nbytes and description; a rank with
    another description fails creation on every rank). A transport with device addresses (CUDA)
    also has `base_ptrs`, int64 [R] on the device: every rank's buffer base."""

    peers: list[torch.Tensor]  # uint8 [nbytes] per rank: every rank's buffer, by rank
    wait_ns: torch.Tensor  # int64 [NUM_WAIT_SITES]: time this rank's barriers waited for peers, per site

    def barrier(self, tag: int = 0, exchange: StatusExchange | None = None, wait_site: int = 0):
        """All writes any rank made before the barrier are visible after it; `tag` names the
        step (peers at another tag are out of step); `exchange` rides in it when given."""

    def has_fault(self) -> bool:
        """Whether a barrier recorded a fault for later (CUDA: a trapped device barrier)."""

    def fault_error(self) -> Exception | None:
        """The error of the recorded fault, if any."""

    def mark_failed(self, tag: int):
        """Tell the peers (waiting at a barrier) that this rank left the protocol in call `tag // 4`."""

    def close(self):
        """Release every rank's buffer here (after the facade's last barrier)."""
