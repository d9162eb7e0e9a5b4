"""What the protocol keeps between calls on one symmetric buffer (one object per buffer)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Call n's deferred verdict is raised at the start of call n + VERDICT_LAG, on every rank: a point
# fixed by the call epoch, which all ranks share, never by when this rank's copy of the status
# reached its host (that differs between ranks: raising "once arrived", one rank could raise a
# call earlier than its peer and leave the peer waiting in the next barrier). Forward and
# backward calls both count. The copy is enqueued behind call n's last barrier, so a call that
# starts before call n has finished on the device waits: the lag bounds how far the host may run
# ahead of the device in eager calls. At 2 that is one call (with a model's dense layers between),
# so a host pause of about one MoE call's GPU time would leave the device idle; 4 leaves three
# calls of slack, and a call reports bad ids at most four calls later (with one MoE layer, two
# training steps). Replayed CUDA graphs run no host code and never wait.
VERDICT_LAG = 4


@dataclass
class PendingVerdict:
    """The status words of one call on their way to the host: on CUDA a pinned copy made without
    a host sync, landed once `done` (an event recorded after the copy) has completed; on CPU the
    words themselves, already on the host (done None)."""

    done: torch.cuda.Event | None
    status: torch.Tensor  # int32 [R, 4], host
    call: int

    def wait(self):
        """Until the words are on the host (at once on CPU, and normally on CUDA: VERDICT_LAG)."""
        if self.done is not None:
            self.done.synchronize()


@dataclass
class BufferCallState:
    """call_count is the call epoch (forward and backward calls alike) every rank tags its status
    word and barriers with (all ranks must agree); pending holds verdicts of earlier calls not yet
    raised (executors that keep the host free raise call n's at call n + VERDICT_LAG, `due`);
    side_stream is where the shared experts overlap the routed path; call_stream is the stream of
    the latest call."""

    call_count: int = 0
    pending: list[PendingVerdict] = field(default_factory=list)
    side_stream: torch.cuda.Stream | None = None
    call_stream: torch.cuda.Stream | None = None

    def next_call(self) -> int:
        self.call_count += 1
        return self.call_count

    def defer(self, status: torch.Tensor, call: int):
        """Keep call `call`'s status words [R, 4] until `due`: on CUDA copied to the host
        asynchronously (no host sync), on CPU as they are (a tensor of this call's own)."""
        if status.device.type != "cuda":
            self.pending.append(PendingVerdict(None, status, call))
            return
        if torch.cuda.is_current_stream_capturing():
            return  # a captured graph replays the copy into memory nobody reads; skip it
        host = torch.empty(status.shape, dtype=status.dtype, pin_memory=True)
        host.copy_(status, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.pending.append(PendingVerdict(done, host, call))

    def due(self, last_call: int) -> list[PendingVerdict]:
        """The verdicts of calls <= last_call (call c - VERDICT_LAG at the start of call c), oldest
        first, each returned once and on the host (waiting for a copy not landed yet, which is
        rare). Newer ones stay pending even where their copy has landed: when a verdict is raised
        must not depend on this rank's timing. Nothing while a CUDA graph is being captured (no
        host wait is allowed there; the verdicts are due at the next eager call)."""
        out = []
        if self.pending and self.pending[0].done is not None and torch.cuda.is_current_stream_capturing():
            return out
        while self.pending and self.pending[0].call <= last_call:
            self.pending[0].wait()
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
