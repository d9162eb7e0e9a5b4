"""The CUDA transport's barrier: one Triton program over barrier words in every rank's buffer.

Each rank's symmetric allocation ends with a barrier area of WORDS int64 words per rank p:
the number of barriers p has entered (ARRIVED), the tags of p's latest two barriers by parity
(TAGS), and p's failure mark (FAILED: the tag + 1 of the call in which p left the protocol).
Rank p writes only its own words, into every rank's area; a rank polls only its own area.

barrier(tag), on rank r: n = r's count + 1; into every rank's area, r's tag of barrier n, then
(release, system scope) count n; then for each peer p, poll r's area (acquire) until p's count
reaches n. Then p's tag of barrier n must equal r's (else the ranks are out of step: barriers
never pair across calls). Polling ends early on p's failure mark, and at the deadline
(%globaltimer). The count is device memory, so a replayed CUDA graph advances it; a peer is at
most one barrier ahead (it cannot pass barrier n + 1 before r enters it), so two tag slots
suffice.

A protocol call's first barrier also carries its status exchange (one launch, no copy engine:
a peer-to-peer memcpy of the 16-byte word measured 56-106 us in the forward's timeline): before
arriving, r writes its status word (verdict, epoch, layer id, phase) into its row of the call's
status slot in every rank's buffer (the release of its count publishes it); after the wait it
copies its own slot out and says whether every word accepts its input and names r's call
(all_ok). In a captured call a mismatch or a rejected input also traps (every rank sees all
words, so every rank decides the same), since a replay runs no host code. The time spent
waiting (%globaltimer ns) is added to a counter in device memory: how long this rank stood
still for its peers, measured without a profiler.

On any fault the program writes the fault record (faults.py) into pinned host memory, writes its
failure mark into every rank's area (peers waiting on it stop at once, naming it, instead of
timing out) unless the fault is a status mismatch (which every rank detects itself), fences
(system scope) and traps:
the CUDA context is lost, loudly, rather than letting rows move between mismatched calls.

Under TRITON_INTERPRET=1 (CPU tests of this logic) the clock counts polls and the trap is the
interpreter's assertion error.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from . import faults
from .faults import STATUS_OK

WORDS = 4  # int64 words per rank in an area
ARRIVED, TAGS, FAILED = 0, 1, 3


def area_bytes(world: int) -> int:
    return WORDS * 8 * world


@triton.jit
def _now(polls, GLOBALTIMER: tl.constexpr, POLL_NS: tl.constexpr):
    if GLOBALTIMER:
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l,l", [polls], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        t = polls * POLL_NS
    return t


@triton.jit
def _fence_system(x, GLOBALTIMER: tl.constexpr):
    """fence.sc.sys: this thread's earlier writes are visible to the host and every GPU first."""
    if GLOBALTIMER:  # i.e. compiled for a GPU (the interpreter has no fences to make)
        tl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, 0;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(
    debug=True,
    do_not_specialize=[
        "area_offset",
        "me",
        "world",
        "tag",
        "timeout_ns",
        "record_addr",
        "wait_addr",
        "exchange",
        "slot_addr",
        "verdict_addr",
        "epoch",
        "layer",
        "phase",
        "status_out_addr",
        "ok_out_addr",
        "check_status",
    ],
)
def _barrier_kernel(
    peer_bases,
    area_offset,
    me,
    world,
    tag,
    timeout_ns,
    record_addr,
    wait_addr,
    exchange,
    slot_addr,
    verdict_addr,
    epoch,
    layer,
    phase,
    status_out_addr,
    ok_out_addr,
    check_status,
    GLOBALTIMER: tl.constexpr,
    POLL_NS: tl.constexpr,
    WORDS: tl.constexpr,
    ARRIVED: tl.constexpr,
    TAGS: tl.constexpr,
    FAILED: tl.constexpr,
    STATUS_OK: tl.constexpr,
    K_TIMED_OUT: tl.constexpr,
    K_PEER_FAILED: tl.constexpr,
    K_OUT_OF_STEP: tl.constexpr,
    K_CALL_MISMATCH: tl.constexpr,
    K_BAD_INPUT: tl.constexpr,
    R_KIND: tl.constexpr,
    R_RANK: tl.constexpr,
    R_TAG: tl.constexpr,
    R_PEER: tl.constexpr,
    R_VALUE: tl.constexpr,
    R_TIMEOUT_MS: tl.constexpr,
    R_MY_WORD: tl.constexpr,
    R_PEER_WORD: tl.constexpr,
):
    tag = tag.to(tl.int64)
    my_base = tl.load(peer_bases + me)
    mine = (my_base + area_offset).to(tl.pointer_type(tl.int64))
    status = slot_addr.to(tl.pointer_type(tl.int32))  # this call's status slot [R, 4] here
    slot_offset = slot_addr - my_base  # the same slot in every rank's buffer
    n = tl.load(mine + me * WORDS + ARRIVED, volatile=True) + 1
    parity = n % 2
    if exchange != 0:  # the status exchange: this rank's word into its row of every rank's slot
        verdict = tl.load(verdict_addr.to(tl.pointer_type(tl.int32)))
        for p in range(0, world):
            word = (tl.load(peer_bases + p) + slot_offset + me * 16).to(tl.pointer_type(tl.int32))
            tl.store(word, verdict)
            tl.store(word + 1, epoch)
            tl.store(word + 2, layer)
            tl.store(word + 3, phase)
    # Arrive: this rank's tag of barrier n, then its count (release: the word above goes with it),
    # into every rank's area (its own too).
    for p in range(0, world):
        words = (tl.load(peer_bases + p) + area_offset + me * WORDS * 8).to(tl.pointer_type(tl.int64))
        tl.store(words + TAGS + parity, tag)
        tl.atomic_xchg(words + ARRIVED, n, sem="release", scope="sys")
    # Wait for every peer (in rank order; the first fault ends the wait).
    polls = tl.full([], 0, tl.int64)
    start = _now(polls, GLOBALTIMER, POLL_NS)
    kind = tl.full([], 0, tl.int32)
    peer = tl.full([], 0, tl.int32)
    value = tl.full([], 0, tl.int64)
    for p in range(0, world):
        if kind == 0:
            seen = tl.atomic_add(mine + p * WORDS + ARRIVED, 0, sem="acquire", scope="sys")
            mark = tl.atomic_add(mine + p * WORDS + FAILED, 0, sem="acquire", scope="sys")
            late = (_now(polls, GLOBALTIMER, POLL_NS) - start) > timeout_ns
            while (seen < n) & (mark == 0) & (late == 0):
                polls += 1
                seen = tl.atomic_add(mine + p * WORDS + ARRIVED, 0, sem="acquire", scope="sys")
                mark = tl.atomic_add(mine + p * WORDS + FAILED, 0, sem="acquire", scope="sys")
                late = (_now(polls, GLOBALTIMER, POLL_NS) - start) > timeout_ns
            # A peer writes its count before its mark: read after the mark, the count tells
            # whether it had arrived here first (then its tag decides, e.g. out of step).
            seen = tl.atomic_add(mine + p * WORDS + ARRIVED, 0, sem="acquire", scope="sys")
            if seen >= n:
                theirs = tl.load(mine + p * WORDS + TAGS + parity, volatile=True)
                if theirs != tag:
                    kind = K_OUT_OF_STEP
                    peer = p
                    value = theirs
            elif mark != 0:
                kind = K_PEER_FAILED
                peer = p
                value = mark
            else:
                kind = K_TIMED_OUT
                peer = p
                value = seen
    tl.atomic_add(wait_addr.to(tl.pointer_type(tl.int64)), _now(polls, GLOBALTIMER, POLL_NS) - start)
    if exchange != 0:  # the exchange's results: this rank's slot, and whether all is well
        out = status_out_addr.to(tl.pointer_type(tl.int32))
        all_ok = kind == 0
        for p in range(0, world):
            for i in tl.static_range(0, 4):
                w = tl.load(status + p * 4 + i, volatile=True)
                tl.store(out + p * 4 + i, w)
                if i == 0:
                    all_ok &= w == STATUS_OK
                else:
                    all_ok &= w == tl.load(status + me * 4 + i, volatile=True)
        tl.store(ok_out_addr.to(tl.pointer_type(tl.int8)), all_ok.to(tl.int8))
    if check_status != 0:
        # A captured call: compare the status words (verdict, epoch, layer, phase) now, since a
        # replay runs no host code that could raise the mismatch later.
        for p in range(0, world):
            if kind == 0:
                differ = tl.load(status + p * 4 + 1, volatile=True) != tl.load(status + me * 4 + 1, volatile=True)
                differ |= tl.load(status + p * 4 + 2, volatile=True) != tl.load(status + me * 4 + 2, volatile=True)
                differ |= tl.load(status + p * 4 + 3, volatile=True) != tl.load(status + me * 4 + 3, volatile=True)
                verdict = tl.load(status + p * 4, volatile=True)
                if differ:
                    kind = K_CALL_MISMATCH
                    peer = p
                elif verdict != STATUS_OK:
                    kind = K_BAD_INPUT
                    peer = p
                    value = verdict.to(tl.int64)
    if kind != 0:
        record = record_addr.to(tl.pointer_type(tl.int64))
        tl.store(record + R_RANK, me.to(tl.int64))
        tl.store(record + R_TAG, tag)
        tl.store(record + R_PEER, peer.to(tl.int64))
        tl.store(record + R_VALUE, value)
        tl.store(record + R_TIMEOUT_MS, (timeout_ns // 1000000).to(tl.int64))
        if check_status != 0:
            for i in range(0, 3):
                tl.store(record + R_MY_WORD + i, tl.load(status + me * 4 + 1 + i, volatile=True).to(tl.int64))
                tl.store(record + R_PEER_WORD + i, tl.load(status + peer * 4 + 1 + i, volatile=True).to(tl.int64))
        if kind < K_CALL_MISMATCH:  # this rank leaves the protocol: peers waiting on it stop now
            for p in range(0, world):
                words = (tl.load(peer_bases + p) + area_offset + me * WORDS * 8).to(tl.pointer_type(tl.int64))
                tl.atomic_xchg(words + FAILED, tag + 1, sem="release", scope="sys")
        # The KIND word last, each behind a system-scope fence (plain stores: no atomics on host
        # memory): the host never sees a kind without its details, and the trap comes after both.
        _fence_system(kind, GLOBALTIMER)
        tl.store(record + R_KIND, kind.to(tl.int64))
        _fence_system(kind, GLOBALTIMER)
        tl.device_assert(kind == 0, "MegaMoE device barrier fault: see the fault record (stderr / MegaMoEPeerError)")
        if GLOBALTIMER:  # the assert compiles only in debug mode; the trap always
            tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r,r", [kind], dtype=tl.int32, is_pure=False, pack=1)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_barrier(
    peer_bases,
    area_offset: int,
    rank: int,
    world: int,
    tag: int,
    timeout_s: float,
    record,
    wait_ns,
    exchange=None,
    poll_ns: int = 1000,
):
    """Launch one barrier on the current stream (never waits on the host).

    peer_bases: int64 [R] tensor of every rank's buffer base address (device memory on CUDA);
    the barrier area starts at area_offset bytes past each base. record: this rank's fault
    record (int64 [RECORD_WORDS], pinned host memory). wait_ns: int64 [1] (device memory on
    CUDA), the time this barrier waits is added to it. exchange: a protocol call's status
    exchange, (slot_addr, verdict, (epoch, layer, phase), status_out, all_ok_out, compare):
    the address of the call's status slot in this rank's buffer (the slot lies at the same
    offset from every rank's base); this rank's verdict (int32 scalar,
    device) and call name go into its row of every rank's slot before it arrives; after the
    wait status_out (int32 [R, 4]) gets this rank's slot and all_ok_out (bool scalar) whether
    every word says STATUS_OK and names this rank's call; compare (captured calls): trap on a
    mismatch or a rejected input."""
    f = faults
    # Unused addresses are the record's (every address argument is a 64-bit value, so Triton
    # types it alike in every launch) and the flags runtime values: one compiled kernel, loaded
    # by the buffer's creation barrier, serves every barrier, so a graph capture never compiles
    # or loads a kernel.
    unused = record.data_ptr()
    slot_addr, verdict_addr, name, out_addr, ok_addr, compare = unused, unused, (0, 0, 0), unused, unused, False
    if exchange is not None:
        slot_addr, verdict, name, status_out, all_ok_out, compare = exchange
        verdict_addr, out_addr, ok_addr = verdict.data_ptr(), status_out.data_ptr(), all_ok_out.data_ptr()
    _barrier_kernel[(1,)](
        peer_bases,
        area_offset,
        rank,
        world,
        tag,
        int(timeout_s * 1e9),
        record.data_ptr(),
        wait_ns.data_ptr(),
        int(exchange is not None),
        slot_addr,
        verdict_addr,
        *name,
        out_addr,
        ok_addr,
        int(compare),
        GLOBALTIMER=not interpreted(),
        POLL_NS=poll_ns,
        WORDS=WORDS,
        ARRIVED=ARRIVED,
        TAGS=TAGS,
        FAILED=FAILED,
        STATUS_OK=STATUS_OK,
        K_TIMED_OUT=f.TIMED_OUT,
        K_PEER_FAILED=f.PEER_FAILED,
        K_OUT_OF_STEP=f.OUT_OF_STEP,
        K_CALL_MISMATCH=f.CALL_MISMATCH,
        K_BAD_INPUT=f.BAD_INPUT,
        R_KIND=f.KIND,
        R_RANK=f.RANK,
        R_TAG=f.TAG,
        R_PEER=f.PEER,
        R_VALUE=f.VALUE,
        R_TIMEOUT_MS=f.TIMEOUT_MS,
        R_MY_WORD=f.MY_WORD,
        R_PEER_WORD=f.PEER_WORD,
        num_warps=1,
    )
    if interpreted() and int(record[f.KIND]) != 0:  # the interpreter does not trap: stop here instead
        raise RuntimeError(f"device barrier trap (interpreted): {f.describe_fault(record.tolist())}")
