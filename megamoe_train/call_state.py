"""What the protocol keeps between calls on one symmetric buffer (one object per buffer)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PendingVerdict:
    """The status words of one call, copied to pinned memory without a host sync."""

    done: torch.cuda.Event
    status: torch.Tensor  # int32 [R, 4], host
    call: int


@dataclass
class BufferCallState:
    """call_count is the call epoch (forward and backward calls alike) every rank tags its status
    word and barriers with (all ranks must agree); pending holds verdicts of earlier calls not yet
    read on the host (device executors raise them at a later call); side_stream is where the
    shared experts overlap the routed path; call_stream is the stream of the latest call."""

    call_count: int = 0
    pending: list[PendingVerdict] = field(default_factory=list)
    side_stream: torch.cuda.Stream | None = None
    call_stream: torch.cuda.Stream | None = None

    def next_call(self) -> int:
        self.call_count += 1
        return self.call_count

    def defer(self, status: torch.Tensor, call: int):
        """Copy a device status to the host asynchronously; `ready()` returns it once arrived."""
        if torch.cuda.is_current_stream_capturing():
            return  # a captured graph replays the copy into memory nobody reads; skip it
        host = torch.empty(status.shape, dtype=status.dtype, pin_memory=True)
        host.copy_(status, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.pending.append(PendingVerdict(done, host, call))

    def ready(self) -> list[PendingVerdict]:
        """Verdicts that have reached the host, oldest first, each returned once."""
        out = []
        if torch.cuda.is_current_stream_capturing():
            return out
        while self.pending and self.pending[0].done.query():
            out.append(self.pending.pop(0))
        return out

    def follow_previous_call(self, stream: torch.cuda.Stream):
        """Calls on one buffer never overlap on the device: a call on another stream than the
        previous call's first waits for that stream (two streams would race on the regions).
        Skipped while capturing: torch.cuda.graph synchronizes the device before capture."""
        if torch.cuda.is_current_stream_capturing():
            return
        if self.call_stream is not None and stream != self.call_stream:
            stream.wait_stream(self.call_stream)
        self.call_stream = stream

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream(device=device)
        return self.side_stream
