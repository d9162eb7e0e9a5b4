"""Issue 11 on GPUs (marked `gpu`, skipped without CUDA): call divergence under NCCL with both
executors, two streams sharing one buffer, 64-bit offsets in the reduce kernel; and the faults
that make the device barrier trap (graphs captured at different calls, bad ids in a replay, a
rank absent at creation or at a call, a rank failing mid-call), each rank in a child process."""

import os
import queue
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from test_gpu_triton import TRITON_BASE
from test_mega_moe_dist import make_problem

from megamoe_train import (
    MegaMoECallMismatchError,
    MegaMoEConfig,
    MegaMoELayer,
    MegaMoEPeerError,
    get_symm_buffer,
    mega_moe,
)
from megamoe_train.call_state import VERDICT_LAG

pytestmark = pytest.mark.gpu


def layers_in_different_orders(rank, world, backend):
    cfg = MegaMoEConfig(**TRITON_BASE)
    prob = make_problem(cfg, world, [64] * world, seed=4)
    dev = torch.device("cuda", torch.cuda.current_device())
    first, second = MegaMoELayer(cfg, device=dev, backend=backend), MegaMoELayer(cfg, device=dev, backend=backend)
    assert first.buffer is second.buffer
    x, idx, tw = (prob[k][rank].to(dev) for k in ("x", "idx", "w"))
    order = (first, second) if rank == 0 else (second, first)
    if backend == "reference":  # reads verdicts on the host: raises in the very call
        with pytest.raises(MegaMoECallMismatchError, match="different calls"):
            order[0](x, idx, tw)
    else:  # host-free: call n moves no rows; every rank raises it at the start of call n + VERDICT_LAG
        n = first.buffer.call_state.call_count + 1
        y = order[0](x, idx, tw)
        torch.cuda.synchronize()
        assert y.abs().max() == 0
        for _ in range(VERDICT_LAG - 1):  # calls in step between them run
            assert first(x, idx, tw).abs().max() > 0
        with pytest.raises(MegaMoECallMismatchError, match=rf"different calls.*\(call {n}\)"):
            first(x, idx, tw)
        assert first.buffer.call_state.call_count == n + VERDICT_LAG - 1  # the raising call took no epoch
        assert first(x, idx, tw).abs().max() > 0  # and the buffer serves the next call
    first.buffer.destroy()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_gpu_layer_order_divergence(rank_pools, backend):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    rank_pools(2, "nccl").run(layers_in_different_orders, backend)


def two_streams_one_buffer(rank, world):
    """Calls alternating between two streams on one buffer give the single-stream bits."""
    cfg = MegaMoEConfig(**TRITON_BASE)
    probs = [make_problem(cfg, world, [128] * world, seed=s) for s in (11, 12, 13, 14)]
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    layer = MegaMoELayer(cfg, device=dev, backend="triton")
    inputs = [tuple(p[k][rank].to(dev) for k in ("x", "idx", "w")) for p in probs]
    want = [layer(*args).clone() for args in inputs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    got = []
    for i, args in enumerate(inputs):
        streams[i % 2].wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(streams[i % 2]):
            got.append(layer(*args))
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    layer.buffer.destroy()


def test_gpu_two_streams_share_one_buffer_in_order(rank_pools):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    rank_pools(2, "nccl").run(two_streams_one_buffer)


def test_reduce_kernel_offsets_past_2_31():
    """partials [3, T, H] with T * H = 2^30: the shared row starts at element 2^31."""
    from megamoe_train.backends.triton_kernels import reduce_partials

    T, H, n = 32768, 32768, 64
    partials = torch.empty(3, T, H, dtype=torch.bfloat16, device="cuda")
    partials[:, :n].normal_()
    mask = torch.rand(n, 2, device="cuda") < 0.6
    out = reduce_partials(partials, mask, n, True, torch.bfloat16)
    want = partials[0, :n].float() * mask[:, :1] + partials[1, :n].float() * mask[:, 1:] + partials[2, :n].float()
    assert torch.equal(out, want.to(torch.bfloat16))


# ----------------------------------------------------------------------------- faults that trap
# A device barrier that meets a missing, failed or out-of-step rank (or, in a captured graph,
# ranks at different calls) records the fault in pinned host memory and traps: the process's
# CUDA context is lost. So these tests run each rank in a fresh child process of its own, which
# reports what it saw through a queue and leaves with os._exit (no teardown on a lost context).

SHORT_TIMEOUT_S = 3.0
MARGIN_S = 4.0  # kernel launch, the host's poll of the CUDA error, process scheduling


def _child(rank, world, port, fn, args, results):
    try:
        from megamoe_train.launch import init_rank

        init_rank(rank, world, port, "nccl")
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # the queue's feeder thread has sent the report
        os._exit(0)


def run_in_children(fn, *args, world=2, timeout=120):
    """fn(rank, world, *args) in `world` fresh processes joined by NCCL; per-rank results."""
    from megamoe_train.launch import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out, errors = [None] * world, []
    try:
        for _ in range(world):
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{fn.__name__}: ranks did not report within {timeout}s") from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError(f"{fn.__name__} failed:\n" + "\n".join(sorted(errors)))
    return out


def _until_trap(buf, started):
    """Wait for the device; returns (seconds from `started` until the CUDA error, the buffer's
    explanation of it). The trap's error surfaces at the synchronization."""
    with pytest.raises(RuntimeError) as cuda_error:
        torch.cuda.synchronize()
    elapsed = time.monotonic() - started
    assert not isinstance(cuda_error.value, MegaMoEPeerError)  # the raw CUDA error ...
    return elapsed, buf.device_fault()  # ... and what the fault record says about it


def _layer_inputs(cfg, rank, world, seed=4):
    prob = make_problem(cfg, world, [64] * world, seed=seed)
    dev = torch.device("cuda", torch.cuda.current_device())
    return tuple(prob[k][rank].to(dev) for k in ("x", "idx", "w"))


def graphs_captured_apart(rank, world, how):
    """Both ranks replay one captured forward together; rank 1 captured one more call before it
    (how="extra_capture": a graph it never replays, so its epochs run one ahead), or the ranks
    captured two layers sharing a buffer in other orders (how="layer_order": same epochs)."""
    cfg = MegaMoEConfig(**TRITON_BASE)
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = get_symm_buffer(None, cfg, timeout_s=20)
    layers = [MegaMoELayer(cfg, device=dev, backend="triton", buffer=buf) for _ in range(2)]
    args = _layer_inputs(cfg, rank, world)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for layer in layers:  # eager warm-up, in step
            layer(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if how == "extra_capture" and rank == 1:
        with torch.cuda.graph(torch.cuda.CUDAGraph()), torch.no_grad():
            layers[0](*args)
    order = layers if (how != "layer_order" or rank == 0) else layers[::-1]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        for layer in order:
            layer(*args)
    started = time.monotonic()
    graph.replay()
    elapsed, fault = _until_trap(buf, started)
    assert fault is not None, "no fault recorded"
    with pytest.raises(type(fault)):  # the next call raises it, naming the calls
        layers[0](*args)
    return type(fault).__name__, str(fault), elapsed


@pytest.mark.parametrize("how", ["extra_capture", "layer_order"])
def test_gpu_graphs_captured_at_different_calls_raise_on_both_ranks(how):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = run_in_children(graphs_captured_apart, how)
    for rank, (kind, text, elapsed) in enumerate(out):
        if how == "extra_capture":  # the baked barrier tags differ: out of step at the first barrier
            assert kind == "MegaMoEPeerError" and "out of step" in text, text
        else:  # same tags, other layers: the status words, compared on the device
            assert kind == "MegaMoECallMismatchError" and "different calls" in text and "captured" in text, text
            assert "layer 1" in text and "layer 2" in text, text
        assert f"rank {1 - rank}" in text, text
        assert elapsed < 20, elapsed  # at the first replay, not at a timeout


def bad_ids_in_a_replay(rank, world):
    """A captured forward replayed with an out-of-range expert id on rank 1: no host code runs to
    raise the deferred verdict, so both ranks' devices trap, naming rank 1."""
    cfg = MegaMoEConfig(**TRITON_BASE)
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = get_symm_buffer(None, cfg, timeout_s=20)
    layer = MegaMoELayer(cfg, device=dev, backend="triton", buffer=buf)
    x, idx, tw = _layer_inputs(cfg, rank, world)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        layer(x, idx, tw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        layer(x, idx, tw)
    graph.replay()  # good ids: passes
    torch.cuda.synchronize()
    assert buf.device_fault() is None
    if rank == 1:
        idx[3, 0] = cfg.num_experts  # out of range
    started = time.monotonic()
    graph.replay()
    elapsed, fault = _until_trap(buf, started)
    return type(fault).__name__, str(fault), elapsed


def test_gpu_bad_ids_in_a_replayed_graph_trap_on_both_ranks():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for kind, text, elapsed in run_in_children(bad_ids_in_a_replay):
        assert kind == "MegaMoEInputError" and "rank 1 rejected its input" in text, text
        assert elapsed < 20, elapsed


def absent_at_creation(rank, world, absent):
    cfg = MegaMoEConfig(**TRITON_BASE)
    if rank == absent:
        time.sleep(SHORT_TIMEOUT_S + MARGIN_S + 2)  # stays alive: rank 0 hosts the job's store
        return None
    started = time.monotonic()
    with pytest.raises(MegaMoEPeerError) as err:
        get_symm_buffer(None, cfg, timeout_s=SHORT_TIMEOUT_S)
    return str(err.value), time.monotonic() - started


@pytest.mark.parametrize("absent", [0, 1])
def test_gpu_absent_rank_at_creation_named_within_timeout(absent):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    text, elapsed = run_in_children(absent_at_creation, absent)[1 - absent]
    assert f"waiting for rank {absent}" in text, text
    assert elapsed < SHORT_TIMEOUT_S + MARGIN_S, elapsed


def absent_at_call(rank, world, absent):
    cfg = MegaMoEConfig(**TRITON_BASE)
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = get_symm_buffer(None, cfg, timeout_s=SHORT_TIMEOUT_S)
    layer = MegaMoELayer(cfg, device=dev, backend="triton", buffer=buf)
    args = _layer_inputs(cfg, rank, world)
    with torch.no_grad():
        layer(*args)  # one good call first
    torch.cuda.synchronize()
    if rank == absent:
        time.sleep(SHORT_TIMEOUT_S + MARGIN_S + 2)
        return None
    started = time.monotonic()
    with torch.no_grad():
        layer(*args)  # returns at once: the host never waits for the device
    elapsed, fault = _until_trap(layer.buffer, started)
    with pytest.raises(MegaMoEPeerError) as err:  # and the next call says why
        layer(*args)
    return str(fault), str(err.value), elapsed


@pytest.mark.parametrize("absent", [0, 1])
def test_gpu_absent_rank_at_call_named_within_timeout(absent):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    fault, raised, elapsed = run_in_children(absent_at_call, absent)[1 - absent]
    for text in (fault, raised):
        assert f"rank {absent} did not reach barrier 1 of call 2 within {SHORT_TIMEOUT_S:g}s" in text, text
    assert SHORT_TIMEOUT_S - 0.5 < elapsed < SHORT_TIMEOUT_S + MARGIN_S, elapsed


def rank_fails_mid_call(rank, world):
    from megamoe_train.backends.triton_backend import TritonExecutor

    cfg = MegaMoEConfig(**TRITON_BASE)
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = get_symm_buffer(None, cfg, timeout_s=60)  # long: rank 1's failure mark must stop rank 0
    layer = MegaMoELayer(cfg, device=dev, backend="triton", buffer=buf)
    args = _layer_inputs(cfg, rank, world)
    with torch.no_grad():
        layer(*args)
    torch.cuda.synchronize()
    if rank == 1:  # a host exception after the first barrier of call 2

        def broken(self, *a):
            raise MemoryError("injected host failure after the first barrier")

        TritonExecutor.experts_forward = broken
        with pytest.raises(MemoryError), torch.no_grad():
            layer(*args)
        with pytest.raises(MegaMoEPeerError, match="unusable"):  # this rank refuses the buffer too
            mega_moe(*args, layer.w1, layer.w2, buf)
        time.sleep(5)  # stay until rank 0 has reported
        return None
    started = time.monotonic()
    with torch.no_grad():
        layer(*args)
    elapsed, fault = _until_trap(layer.buffer, started)
    return str(fault), elapsed


def test_gpu_rank_failing_mid_call_stops_its_peer_naming_it():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    fault, elapsed = run_in_children(rank_fails_mid_call)[0]
    assert "rank 1 failed in call 2 and left the protocol" in fault, fault
    assert elapsed < 10, elapsed  # told by the failing rank, far before the 60 s timeout
