"""The CUDA transport's device barrier (megamoe_train/device_barrier.py), its logic run on CPU by
Triton's interpreter in real processes sharing memory: ranks in step pass; ranks at barriers of
different calls, a missing rank, a rank that left the protocol, and (captured calls) ranks at
different calls or with a rejected input each leave a fault record naming the other rank, and
stop. On GPUs the same kernel runs compiled (tests/test_gpu_reliability.py). Skipped without
Triton (CI installs none)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import time

import pytest
import torch
import torch.multiprocessing as mp
from rank_pool import next_result


def _triton_version():
    # Not imported here: a rank process sets TRITON_INTERPRET before its first triton import.
    if importlib.util.find_spec("triton") is None:
        return None
    return tuple(int(v) for v in importlib.metadata.version("triton").split(".")[:2])


# Triton 3.6's interpreter cannot loop over a runtime scalar (range(0, world)); the compiled
# kernel does (it compiles for sm90 with 3.6 and 3.8).
pytestmark = pytest.mark.skipif((_triton_version() or (0, 0)) < (3, 8), reason="needs triton >= 3.8 (its interpreter)")

WORLD = 2
POLL_NS = 100_000  # the interpreter's clock: each poll counts as 100 us
SLOT_OFFSET = 4 * 8 * WORLD  # device_barrier.area_bytes(WORLD): the status slot follows the area


def _barrier_rank(rank, memories, records, waits, steps, results):
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported
    from megamoe_train import device_barrier, faults

    bases = torch.tensor([m.data_ptr() for m in memories], dtype=torch.int64)
    done, exchanged = [], []
    try:
        for step in steps[rank]:
            if step[0] == "sleep":
                time.sleep(step[1])
            elif step[0] == "zero_wait":
                waits[rank].zero_()
            elif step[0] == "mark_failed":  # what CudaSymmetricPeers.mark_failed writes, per rank
                for memory in memories:
                    memory[rank * device_barrier.WORDS + device_barrier.FAILED] = step[1] + 1
            elif step[0] == "barrier":
                _, tag, timeout_s = step
                device_barrier.device_barrier(
                    bases, 0, rank, WORLD, tag, timeout_s, records[rank], waits[rank], poll_ns=POLL_NS
                )
            else:  # ("exchange", tag, timeout_s, verdict, (epoch, layer, phase), compare)
                _, tag, timeout_s, verdict, name, compare = step
                status_out = torch.full((WORLD, 4), -7, dtype=torch.int32)
                all_ok = torch.zeros((), dtype=torch.bool)
                slot_addr = memories[rank].data_ptr() + SLOT_OFFSET
                exchange = (slot_addr, torch.tensor(verdict, dtype=torch.int32), name, status_out, all_ok, compare)
                device_barrier.device_barrier(
                    bases, 0, rank, WORLD, tag, timeout_s, records[rank], waits[rank], exchange, poll_ns=POLL_NS
                )
                exchanged.append((status_out.tolist(), bool(all_ok)))
            done.append(step[0])
        results.put((rank, done, exchanged, None, None))
    except BaseException as err:  # the interpreter's stand-in for the trap (or a bug: reported too)
        results.put(
            (rank, done, exchanged, f"{type(err).__name__}: {err}", faults.describe_fault(records[rank].tolist()))
        )


def run_ranks(steps):
    """Each rank's memory: its barrier area (area_offset 0), then one status slot [WORLD, 4] int32."""
    from megamoe_train.faults import RECORD_WORDS

    ctx = mp.get_context("spawn")
    memories = [torch.zeros(SLOT_OFFSET // 8 + WORLD * 2, dtype=torch.int64).share_memory_() for _ in range(WORLD)]
    records = [torch.zeros(RECORD_WORDS, dtype=torch.int64).share_memory_() for _ in range(WORLD)]
    waits = [torch.zeros(1, dtype=torch.int64).share_memory_() for _ in range(WORLD)]
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_barrier_rank, args=(r, memories, records, waits, steps, results)) for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    try:
        out = {}
        for _ in range(WORLD):
            rank, done, exchanged, err, fault = next_result(results, procs, "device barrier ranks")
            out[rank] = dict(
                done=done,
                exchanged=exchanged,
                error=err,
                fault=fault,
                record=records[rank].tolist(),
                wait_ns=int(waits[rank]),
            )
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return out, memories


def test_ranks_in_step_pass_and_count_barriers():
    three = [("barrier", 0, 30.0), ("barrier", 21, 30.0), ("barrier", 22, 30.0)]
    steps = {r: three for r in range(WORLD)}
    out, areas = run_ranks(steps)
    for r in range(WORLD):
        assert out[r]["error"] is None and out[r]["record"][0] == 0, out[r]
    from megamoe_train.device_barrier import ARRIVED, TAGS, WORDS

    for area in areas:  # both ranks' counts and latest tags, in every rank's area
        for r in range(WORLD):
            assert area[r * WORDS + ARRIVED] == 3
            assert sorted(area[r * WORDS + TAGS : r * WORDS + TAGS + 2].tolist()) == [21, 22]


def test_wait_counter_charges_the_rank_that_waited():
    # rank 1 arrives 0.5 s late at the second barrier: rank 0 polls meanwhile (each poll counts
    # POLL_NS on the interpreter's clock), rank 1 finds rank 0 there and waits no poll at all
    steps = {
        0: [("barrier", 21, 30.0), ("zero_wait",), ("barrier", 22, 30.0)],
        1: [("barrier", 21, 30.0), ("zero_wait",), ("sleep", 0.5), ("barrier", 22, 30.0)],
    }
    out, _ = run_ranks(steps)
    assert out[0]["error"] is None and out[1]["error"] is None
    assert out[0]["wait_ns"] >= 3 * POLL_NS, out[0]
    assert out[1]["wait_ns"] == 0, out[1]


def test_barriers_of_different_calls_stop_both_ranks():
    steps = {0: [("barrier", 21, 30.0), ("barrier", 22, 30.0)], 1: [("barrier", 21, 30.0), ("barrier", 25, 30.0)]}
    out, _ = run_ranks(steps)
    assert "rank 0 at barrier 2 of call 5 met rank 1 at barrier 1 of call 6" in out[0]["fault"], out[0]
    assert "rank 1 at barrier 1 of call 6 met rank 0 at barrier 2 of call 5" in out[1]["fault"], out[1]
    for r in range(WORLD):
        assert "out of step" in out[r]["error"] and out[r]["done"] == ["barrier"]


def test_missing_rank_times_out_naming_it():
    steps = {0: [("barrier", 21, 30.0), ("barrier", 22, 0.05)], 1: [("barrier", 21, 30.0)]}
    out, _ = run_ranks(steps)
    assert out[1]["error"] is None
    assert out[0]["fault"].startswith("rank 0: rank 1 did not reach barrier 2 of call 5 within 0.05s"), out[0]


def test_rank_that_left_the_protocol_stops_its_peer_at_once():
    # rank 0 waits with a long deadline; rank 1 leaves in call 5 (a host exception) and marks it
    steps = {
        0: [("barrier", 21, 30.0), ("barrier", 22, 1000.0)],
        1: [("barrier", 21, 30.0), ("sleep", 0.5), ("mark_failed", 20)],
    }
    out, _ = run_ranks(steps)
    assert "rank 1 failed in call 5 and left the protocol" in out[0]["fault"], out[0]


def _exchange(verdict, name, compare):
    return ("exchange", 21, 30.0, verdict, name, compare)


def test_status_exchange_gives_every_rank_all_words_and_the_verdict():
    # not captured: no trap; every rank gets both words and the same all-ok answer
    cases = [
        ((1, (5, 1, 10)), (1, (5, 1, 10)), True),
        ((1, (5, 1, 10)), (2, (5, 1, 10)), False),  # rank 1 rejected its input
        ((1, (5, 1, 10)), (1, (5, 2, 10)), False),
    ]  # rank 1 is in another layer's call
    for (v0, n0), (v1, n1), want in cases:
        out, _ = run_ranks({0: [_exchange(v0, n0, False)], 1: [_exchange(v1, n1, False)]})
        for r in range(WORLD):
            assert out[r]["error"] is None and out[r]["record"][0] == 0, out[r]
            ((status, all_ok),) = out[r]["exchanged"]
            assert status == [[v0, *n0], [v1, *n1]] and all_ok == want, (r, status, all_ok)


def test_exchanges_alternate_slots_and_plain_barriers_write_none():
    # a plain barrier between two exchanges leaves the slot as the first exchange wrote it
    steps = {
        r: [_exchange(1, (5, 1, 10), False), ("barrier", 22, 30.0), ("exchange", 25, 30.0, 1, (6, 1, 11), False)]
        for r in range(WORLD)
    }
    out, _ = run_ranks(steps)
    for r in range(WORLD):
        assert out[r]["error"] is None, out[r]
        first, second = out[r]["exchanged"]
        assert first == ([[1, 5, 1, 10]] * 2, True) and second == ([[1, 6, 1, 11]] * 2, True), out[r]


def test_captured_calls_compare_status_words_on_every_rank():
    # both ranks at barrier 1 of call 5, but rank 1's word names another layer
    steps = {0: [_exchange(1, (5, 1, 10), True)], 1: [_exchange(1, (5, 2, 10), True)]}
    out, _ = run_ranks(steps)
    assert "rank 0: forward of layer 1 (call 5); rank 1: forward of layer 2 (call 5)" in out[0]["fault"], out[0]
    assert "rank 1: forward of layer 2 (call 5); rank 0: forward of layer 1 (call 5)" in out[1]["fault"], out[1]
    for r in range(WORLD):
        assert "different calls" in out[r]["fault"]


def test_captured_call_with_a_rejected_input_stops_every_rank():
    steps = {0: [_exchange(1, (5, 1, 10), True)], 1: [_exchange(2, (5, 1, 10), True)]}  # rank 1: bad ids
    out, _ = run_ranks(steps)
    for r in range(WORLD):
        assert "rank 1 rejected its input" in out[r]["fault"], out[r]


def test_matching_status_words_pass():
    steps = {r: [_exchange(1, (5, 1, 10), True)] for r in range(WORLD)}
    out, _ = run_ranks(steps)
    for r in range(WORLD):
        assert out[r]["error"] is None and out[r]["record"][0] == 0, out[r]


def test_kernel_compiles_for_hopper():
    """The compiled (not interpreted) kernel, built for sm90 without a GPU: the deadline clock,
    system-scope acquire polls and release arrivals, the fences and the trap are all there."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from megamoe_train import device_barrier as db
    from megamoe_train import faults as f

    kernel = db._barrier_kernel
    signature = {
        "peer_bases": "*i64",
        "area_offset": "i32",
        "me": "i32",
        "world": "i32",
        "tag": "i32",
        "timeout_ns": "i64",
        "record_addr": "i64",
        "wait_addr": "i64",
        "exchange": "i32",
        "slot_addr": "i64",
        "verdict_addr": "i64",
        "epoch": "i32",
        "layer": "i32",
        "phase": "i32",
        "status_out_addr": "i64",
        "ok_out_addr": "i64",
        "check_status": "i32",
    }
    constants = dict(
        GLOBALTIMER=True,
        POLL_NS=1000,
        WORDS=db.WORDS,
        ARRIVED=db.ARRIVED,
        TAGS=db.TAGS,
        FAILED=db.FAILED,
        STATUS_OK=db.STATUS_OK,
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
    )
    signature.update(dict.fromkeys(constants, "constexpr"))
    src = ASTSource(
        fn=kernel, signature=signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()}
    )
    ptx = compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1, debug=True)).asm["ptx"]
    for needed in (
        "%globaltimer",
        "ld.global.sys.acquire",
        "atom.global.sys.release.exch",
        "fence.sc.sys",
        "trap;",
        "atom.global.gpu.acq_rel.add.u64",
    ):  # the wait counter
        assert needed in ptx, needed
