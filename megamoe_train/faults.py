"""How a rank describes a failure of the protocol: barrier tags, status words, and the fault
record a CUDA device barrier writes into pinned host memory before it traps.

A CUDA barrier that times out, meets a failed or out-of-step peer, or (inside a captured graph)
sees ranks at different calls cannot raise a Python error: the host is usually far ahead and a
replayed graph runs no host code at all. It writes what it saw into this rank's fault record,
a few int64 words of pinned host memory (a CPU load reads them, even after the trap poisoned
the CUDA context), and traps. The host turns the record into MegaMoEPeerError /
MegaMoECallMismatchError text (`describe_fault`): at the next use of the buffer, when the CUDA
error surfaces inside a mega_moe call, and on stderr at once from a watcher thread (the error
may surface in any later CUDA call of the program).
"""

from __future__ import annotations

import sys
import threading
import weakref

import torch

from .errors import MegaMoECallMismatchError, MegaMoEInputError, MegaMoEPeerError

# Status words (int32 [4] per rank and call: verdict, epoch, layer id, phase): the verdicts.
STATUS_OK, STATUS_BAD = 1, 2

# Fault record: int64 words.
KIND, RANK, TAG, PEER, VALUE, TIMEOUT_MS = 0, 1, 2, 3, 4, 5
MY_WORD, PEER_WORD = 6, 9  # (epoch, layer, phase) of this rank's and the peer's status word
RECORD_WORDS = 16

# Fault kinds (KIND word; 0 = no fault).
TIMED_OUT = 1  # PEER had entered VALUE barriers when TIMEOUT_MS ran out
PEER_FAILED = 2  # PEER's failure mark is VALUE = (tag of the call it left) + 1
OUT_OF_STEP = 3  # PEER is at barrier tag VALUE
CALL_MISMATCH = 4  # captured call: PEER's status word names another call (PEER_WORD)
BAD_INPUT = 5  # captured call: PEER's verdict VALUE rejected its input


def name_ranks(ranks) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def describe_tag(tag: int) -> str:
    """Barrier tags: 0 for the buffer's own barriers (creation, destroy), call * 4 + step for the
    protocol's (step 1 after the status exchange, step 2 before the reduction)."""
    return "a buffer barrier (creation / destroy)" if tag == 0 else f"barrier {tag % 4} of call {tag // 4}"


def describe_failure_mark(mark: int) -> str:
    """A failure mark is the tag (+1) of the call in which a rank left the protocol."""
    return "buffer creation" if mark == 1 else f"call {(mark - 1) // 4}"


def describe_word(epoch: int, layer: int, phase: int) -> str:
    """A status word's call name (phase 2n: forward call n; 2n + 1: the backward of forward call n)."""
    what = "forward" if phase % 2 == 0 else f"backward of forward call {phase // 2}"
    return f"{what} of layer {layer} (call {epoch})"


def describe_fault(record) -> str | None:
    """The message of a fault record (a sequence of RECORD_WORDS ints), None if it holds none."""
    w = [int(v) for v in record]
    kind, me, tag, peer, value = w[KIND], w[RANK], w[TAG], w[PEER], w[VALUE]
    where = f"(device barrier, rank {me} at {describe_tag(tag)})"
    if kind == 0:
        return None
    if kind == TIMED_OUT:
        return (
            f"rank {me}: rank {peer} did not reach {describe_tag(tag)} within {w[TIMEOUT_MS] / 1000:g}s "
            f"(absent, hung, or stuck in another collective; it had entered {value} barriers of this buffer)"
        )
    if kind == PEER_FAILED:
        return f"rank {peer} failed in {describe_failure_mark(value)} and left the protocol {where}"
    if kind == OUT_OF_STEP:
        return f"rank {me} at {describe_tag(tag)} met rank {peer} at {describe_tag(value)}: the ranks are out of step"
    mine, theirs = describe_word(*w[MY_WORD : MY_WORD + 3]), describe_word(*w[PEER_WORD : PEER_WORD + 3])
    if kind == CALL_MISMATCH:
        return (
            f"mega_moe (rank {me}, captured CUDA graph): the ranks are at different calls of this buffer "
            f"(rank {me}: {mine}; rank {peer}: {theirs}); "
            "every rank must capture and replay the layers sharing a buffer in the same order"
        )
    if kind == BAD_INPUT:
        return (
            f"mega_moe (rank {me}, captured CUDA graph, {mine}): rank {peer} rejected "
            "its input (an expert id outside [0, num_experts); use -1 to mask a slot); a replayed graph cannot "
            "raise later, so the device traps"
        )
    return f"rank {me}: unknown device fault {w}"


def fault_error(record) -> Exception | None:
    """The exception a fault record stands for (None if it holds none): a rejected input is a
    MegaMoEInputError, ranks at different calls a MegaMoECallMismatchError, every other fault
    a MegaMoEPeerError. Unlike their host-side namesakes, the buffer is lost with the context."""
    text = describe_fault(record)
    if text is None:
        return None
    kind = int(record[KIND])
    cls = {CALL_MISMATCH: MegaMoECallMismatchError, BAD_INPUT: MegaMoEInputError}.get(kind, MegaMoEPeerError)
    return cls(f"{text} (the device trapped: this process's CUDA context is lost)")


def new_record() -> torch.Tensor:
    """A zeroed fault record in pinned host memory (the device writes it through its unified
    address; the host reads it with plain loads)."""
    return torch.zeros(RECORD_WORDS, dtype=torch.int64, pin_memory=True)


# ----------------------------------------------------------------------------- watcher

_WATCHED: "weakref.WeakSet" = weakref.WeakSet()
_WATCHER: threading.Thread | None = None
_LOCK = threading.Lock()
POLL_S = 0.05


def watch(owner) -> None:
    """Report `owner.fault_record` on stderr as soon as a device writes it (owner: a CUDA buffer
    transport; held weakly). The trap's CUDA error may surface anywhere in the program; this
    line names the rank and call beside it."""
    global _WATCHER
    with _LOCK:
        _WATCHED.add(owner)
        if _WATCHER is None or not _WATCHER.is_alive():
            _WATCHER = threading.Thread(target=_watch_loop, name="megamoe-fault-watcher", daemon=True)
            _WATCHER.start()


def _watch_loop():
    import time

    reported = weakref.WeakSet()
    while True:
        time.sleep(POLL_S)
        for owner in list(_WATCHED):
            record = getattr(owner, "fault_record", None)
            if record is None or owner in reported or int(record[KIND]) == 0:
                continue
            reported.add(owner)
            sys.stderr.write(f"MegaMoE device fault: {describe_fault(record)}\n")
            sys.stderr.flush()
