"""Failures across ranks (issue 11), on real CPU processes (gloo + /dev/shm buffers, reference
executor): ranks that diverge in which call they are in, ranks that are absent or fail between
barriers, bad tensor layouts and configs that differ. Each must raise on every rank, within the
configured timeout, and leave nothing behind."""

from __future__ import annotations

import contextlib
import glob
import time

import pytest
import torch
from dense_moe import dense_moe
from rank_pool import RankPool
from test_mega_moe_dist import BASE, make_problem, rel_err

from megamoe_train import MegaMoEConfig, MegaMoEInputError, MegaMoELayer, get_symm_buffer, mega_moe

SHORT_TIMEOUT_S = 2  # the buffers' timeout in the tests where a rank goes missing


def _rank_inputs(rank, world, seed=5, tokens=12):
    cfg = MegaMoEConfig(**BASE)
    prob = make_problem(cfg, world, [tokens] * world, seed=seed)
    E_l = cfg.num_experts // world
    mine = slice(rank * E_l, (rank + 1) * E_l)
    return cfg, prob, prob["w1"][mine], prob["w2"][mine]


# ----------------------------------------------------------------------------- which call


def layers_called_in_different_orders(rank, world):
    cfg, prob, _, _ = _rank_inputs(rank, world)
    torch.manual_seed(0)
    first, second = MegaMoELayer(cfg), MegaMoELayer(cfg)  # same config: one shared buffer
    assert first.buffer is second.buffer
    order = (first, second) if rank == 0 else (second, first)
    with pytest.raises(RuntimeError, match="different calls") as err:
        order[0](prob["x"][rank], prob["idx"][rank], prob["w"][rank])
    assert "layer" in str(err.value)
    for layer in (first, second):
        layer.buffer.destroy()


def test_layer_order_divergence_raises_on_every_rank(rank_pools):
    rank_pools(2).run(layers_called_in_different_orders)


def one_rank_skips_backward(rank, world):
    cfg, prob, _, _ = _rank_inputs(rank, world)
    torch.manual_seed(0)
    layer = MegaMoELayer(cfg)
    x = prob["x"][rank].clone().requires_grad_()
    y = layer(x, prob["idx"][rank], prob["w"][rank])
    with pytest.raises(RuntimeError, match="different calls") as err:
        if rank == 0:
            (y * prob["gy"][rank]).sum().backward()
        else:  # rank 1 skips its backward and goes on with the next forward
            layer(x.detach(), prob["idx"][rank], prob["w"][rank])
    assert "backward" in str(err.value) and "forward" in str(err.value)
    layer.buffer.destroy()


def test_skipped_backward_raises_on_every_rank(rank_pools):
    rank_pools(2).run(one_rank_skips_backward)


def skipped_backward_keeps_the_overwrite_request(rank, world):
    """A fused backward that raises (its peer skipped it) writes nothing into main_grad and keeps
    the weights' overwrite request (main_grad.py), so the retried micro-batch still writes over
    the stale main_grad instead of adding to it."""
    cfg, prob, w1, w2 = _rank_inputs(rank, world)
    buf = get_symm_buffer(None, cfg)
    w1, w2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    for w in (w1, w2):
        w.main_grad = torch.full(w.shape, 7.0)
        w.overwrite_main_grad = True
    x = prob["x"][rank].clone().requires_grad_()
    y = mega_moe(x, prob["idx"][rank], prob["w"][rank], w1, w2, buf, fuse_wgrad_accumulation=True)
    with pytest.raises(RuntimeError, match="different calls"):
        if rank == 0:
            (y * prob["gy"][rank]).sum().backward()
        else:  # rank 1 skips its backward and goes on with the next forward
            mega_moe(x.detach(), prob["idx"][rank], prob["w"][rank], w1.detach(), w2.detach(), buf)
    for name, w in (("w1", w1), ("w2", w2)):
        assert w.overwrite_main_grad is True, name
        assert torch.equal(w.main_grad, torch.full(w.shape, 7.0)), name
    buf.destroy()


def test_failed_backward_keeps_the_overwrite_request(rank_pools):
    rank_pools(2).run(skipped_backward_keeps_the_overwrite_request)


def same_order_still_matches(rank, world):
    """Two layers on one buffer, called in the same order everywhere, forward and backward."""
    cfg, prob, w1, w2 = _rank_inputs(rank, world, seed=9)
    layers = [MegaMoELayer(cfg) for _ in range(2)]
    for layer in layers:
        with torch.no_grad():
            layer.w1.copy_(w1)
            layer.w2.copy_(w2)
    x = prob["x"][rank].clone().requires_grad_()
    ys = [layer(x, prob["idx"][rank], prob["w"][rank]) for layer in layers]
    sum((y * prob["gy"][rank]).sum() for y in ys).backward()
    y_ref = dense_moe(prob["x"][rank], prob["idx"][rank], prob["w"][rank], prob["w1"], prob["w2"], cfg)
    for y in ys:
        assert rel_err(y, y_ref) < 1e-5
    layers[0].buffer.destroy()


def test_layers_sharing_a_buffer_in_the_same_order(rank_pools):
    rank_pools(2).run(same_order_still_matches)


# ----------------------------------------------------------------------------- absent and failing ranks


def absent_at_creation(rank, world, absent):
    cfg = MegaMoEConfig(**BASE)
    if rank == absent:
        time.sleep(SHORT_TIMEOUT_S + 1.5)
        return None
    start = time.monotonic()
    with pytest.raises((TimeoutError, RuntimeError)) as err:
        get_symm_buffer(None, cfg, timeout_s=SHORT_TIMEOUT_S)
    elapsed = time.monotonic() - start
    assert f"rank {absent}" in str(err.value) or f"ranks [{absent}]" in str(err.value), str(err.value)
    return elapsed


@contextlib.contextmanager
def no_new_shm_files():
    """The block leaves no /dev/shm buffer file behind. A snapshot comparison: a concurrent job
    creating buffers on this machine at the same time would be reported too."""
    before = set(glob.glob("/dev/shm/megamoe-*"))
    yield
    left = set(glob.glob("/dev/shm/megamoe-*")) - before
    assert not left, left


@pytest.mark.parametrize("absent", [0, 1])
def test_absent_rank_at_creation_times_out_on_every_rank(absent):
    with no_new_shm_files():
        pool = RankPool(2)
        try:
            elapsed = pool.run(absent_at_creation, absent)
        finally:
            pool.close(force=True)  # the ranks' gloo group saw an unfinished collective
    assert elapsed[1 - absent] < SHORT_TIMEOUT_S + 2


def absent_at_call(rank, world, absent):
    cfg, prob, w1, w2 = _rank_inputs(rank, world)
    buf = get_symm_buffer(None, cfg, timeout_s=SHORT_TIMEOUT_S)
    mega_moe(prob["x"][rank], prob["idx"][rank], prob["w"][rank], w1, w2, buf)  # one good call first
    if rank == absent:
        time.sleep(SHORT_TIMEOUT_S + 1.5)
        return None
    start = time.monotonic()
    with pytest.raises((TimeoutError, RuntimeError)) as err:
        mega_moe(prob["x"][rank], prob["idx"][rank], prob["w"][rank], w1, w2, buf)
    assert f"rank {absent}" in str(err.value) or f"ranks [{absent}]" in str(err.value), str(err.value)
    return time.monotonic() - start


@pytest.mark.parametrize("absent", [0, 1])
def test_absent_rank_at_call_times_out_on_every_rank(absent):
    pool = RankPool(2)
    try:
        elapsed = pool.run(absent_at_call, absent)
    finally:
        pool.close(force=True)
    assert elapsed[1 - absent] < SHORT_TIMEOUT_S + 2


def fail_rank_1_in(rank, world, owner, name: str):
    """Rank 1's `owner.name` raises MemoryError during one mega_moe call: rank 0 must be told by
    rank 1's failure mark (within 5 s, not the timeout), and the buffer then refuses further calls
    on every rank instead of pairing barriers out of phase. Returns (cfg, prob, w1, w2)."""
    cfg, prob, w1, w2 = _rank_inputs(rank, world)
    buf = get_symm_buffer(None, cfg, timeout_s=10)
    original = getattr(owner, name)

    def broken(*args, **kwargs):
        raise MemoryError(f"injected failure in {name}")

    if rank == 1:
        setattr(owner, name, broken)
    start = time.monotonic()
    try:
        with pytest.raises((MemoryError, RuntimeError)) as err:
            mega_moe(prob["x"][rank], prob["idx"][rank], prob["w"][rank], w1, w2, buf)
    finally:
        setattr(owner, name, original)
    elapsed = time.monotonic() - start
    if rank == 0:
        assert "rank 1 failed" in str(err.value), str(err.value)
        assert elapsed < 5, elapsed  # told by the failing rank, not by the timeout
    with pytest.raises(RuntimeError, match="unusable"):
        mega_moe(prob["x"][rank], prob["idx"][rank], prob["w"][rank], w1, w2, buf)
    return cfg, prob, w1, w2


def rank_fails_between_barriers(rank, world):
    from megamoe_train.backends.reference import ReferenceExecutor

    cfg, prob, w1, w2 = fail_rank_1_in(rank, world, ReferenceExecutor, "experts_forward")
    # a fresh buffer works again
    buf = get_symm_buffer(None, cfg, timeout_s=10)
    y = mega_moe(prob["x"][rank], prob["idx"][rank], prob["w"][rank], w1, w2, buf)
    y_ref = dense_moe(prob["x"][rank], prob["idx"][rank], prob["w"][rank], prob["w1"], prob["w2"], cfg)
    assert rel_err(y, y_ref) < 1e-5
    buf.destroy()


def test_rank_failing_between_barriers_fails_its_peers(rank_pools):
    rank_pools(2).run(rank_fails_between_barriers)


def barriers_of_different_calls(rank, world):
    cfg = MegaMoEConfig(**BASE)
    buf = get_symm_buffer(None, cfg, timeout_s=10)
    buf.barrier(7 * 4 + 1)  # both at barrier 1 of call 7: passes
    with pytest.raises(RuntimeError, match="out of step"):
        buf.barrier((8 if rank == 0 else 9) * 4 + 1)
    with pytest.raises(RuntimeError, match="unusable"):
        buf.barrier(10 * 4 + 1)


def test_barriers_of_different_calls_never_pair(rank_pools):
    rank_pools(2).run(barriers_of_different_calls)


# ----------------------------------------------------------------------------- bad input and configs


def non_strided_input_on_one_rank(rank, world, layout):
    cfg, prob, w1, w2 = _rank_inputs(rank, world)
    buf = get_symm_buffer(None, cfg, timeout_s=20)
    x, idx, tw = prob["x"][rank], prob["idx"][rank], prob["w"][rank]
    bad = x
    if rank == 1:
        bad = {"sparse_coo": x.to_sparse, "sparse_csr": x.to_sparse_csr, "mkldnn": x.to_mkldnn}[layout]()
    with pytest.raises(MegaMoEInputError) as err:
        mega_moe(bad, idx, tw, w1, w2, buf)
    assert ("layout" in str(err.value)) if rank == 1 else ("rank(s) [1] rejected" in str(err.value)), str(err.value)
    y = mega_moe(x, idx, tw, w1, w2, buf)  # the buffer serves the next call
    assert rel_err(y, dense_moe(x, idx, tw, prob["w1"], prob["w2"], cfg)) < 1e-5


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "mkldnn"])
def test_non_strided_input_raises_on_every_rank(rank_pools, layout):
    if layout == "mkldnn" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without mkldnn")
    rank_pools(2).run(non_strided_input_on_one_rank, layout)


def create_with_config(rank, world, differ):
    change = {"size": dict(hidden=128), "equal_size": dict(num_experts=4)}[differ]
    cfg = MegaMoEConfig(**(BASE if rank == 0 else dict(BASE, **change)))
    with pytest.raises(ValueError, match="config") as err:
        get_symm_buffer(None, cfg, timeout_s=10)
    return str(err.value)


@pytest.mark.parametrize("differ", ["size", "equal_size"])
def test_configs_that_differ_raise_and_leave_no_shm_file(differ):
    with no_new_shm_files():
        pool = RankPool(2)
        try:
            messages = pool.run(create_with_config, differ, timeout=60)
        finally:
            pool.close()
    assert all("rank 1" in m or "ranks [1]" in m or "rank 0" in m for m in messages), messages


def creation_with_a_rank_that_dies(rank, world):
    """Rank 1 dies right after writing its file; rank 0 times out and removes both files."""
    import os

    from megamoe_train.transport import shared_memory

    cfg = MegaMoEConfig(**BASE)
    if rank == 1:
        shared_memory.SharedMemoryPeers._map_all = lambda self, paths: os._exit(3)
    with pytest.raises(RuntimeError, match="rank 1 did not reach"):
        get_symm_buffer(None, cfg, timeout_s=SHORT_TIMEOUT_S)
    return True


def test_rank_dying_at_creation_leaves_no_shm_file():
    with no_new_shm_files():
        pool = RankPool(2)
        try:
            # rank 1 never reports: it died, and the pool says so once rank 0 has timed out and cleaned up
            with pytest.raises(AssertionError, match="rank 1 exited with code 3"):
                pool.run(creation_with_a_rank_that_dies)
        finally:
            pool.close(force=True)


# ----------------------------------------------------------------------------- CUDA creation agreement
# The CUDA transport compares configs through the job's c10d store (cuda_symmetric._agree_description);
# it never touches a device, so gloo ranks test it here.


def agree(rank, world, descriptions, late=None, timeout_s=SHORT_TIMEOUT_S):
    from megamoe_train import MegaMoEPeerError
    from megamoe_train.transport.cuda_symmetric import _agree_description

    group = torch.distributed.group.WORLD
    outcomes = []
    for description in descriptions[rank]:
        if rank == late:
            time.sleep(timeout_s + 1.5)
        start = time.monotonic()
        try:
            _agree_description(group, rank, description, timeout_s)
            outcomes.append(("ok", time.monotonic() - start))
        except (MegaMoEPeerError, ValueError) as err:
            outcomes.append((f"{type(err).__name__}: {err}", time.monotonic() - start))
    return outcomes


def test_cuda_creation_agreement_matching_and_differing_configs(rank_pools):
    same, other = "cfg A on 2 ranks, 100 bytes", "cfg B on 2 ranks, 100 bytes"
    out = rank_pools(2).run(agree, {0: [same, same, same], 1: [same, other, same]})
    for rank in range(2):
        (first, _), (second, _), (third, _) = out[rank]
        assert first == "ok" and third == "ok", out  # agreements in sequence never mix
        assert second.startswith("ValueError") and "rank 1 built their buffer from another config" in second, second
        assert "rank 1: cfg B" in second and "rank 0: cfg A" in second


@pytest.mark.parametrize("late", [0, 1])
def test_cuda_creation_agreement_names_the_absent_rank_on_every_rank(late):
    pool = RankPool(2)
    try:
        out = pool.run(agree, {0: ["cfg"], 1: ["cfg"]}, late, timeout=60)
    finally:
        pool.close(force=True)
    ((waited, elapsed),) = out[1 - late]
    assert f"gave up waiting for rank {late} after {SHORT_TIMEOUT_S}s" in waited, waited
    assert elapsed < SHORT_TIMEOUT_S + 1, elapsed  # its own deadline, not the process group's
    ((came_late, _),) = out[late]  # the late rank fails too instead of allocating alone
    assert "MegaMoEPeerError" in came_late and "arrived after that" in came_late, came_late
