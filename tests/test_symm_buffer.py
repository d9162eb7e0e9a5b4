"""SymmBuffer on CPU: every rank's memory is really shared between the processes."""

import glob
import os

import pytest
import torch

from megamoe_train import MegaMoEConfig, get_symm_buffer

CFG = dict(num_experts=4, hidden=32, intermediate=16, topk=2, num_max_tokens_per_rank=8, block_m=8, dtype=torch.float32)


def peer_writes_are_visible(rank, world):
    cfg = MegaMoEConfig(**CFG)
    buf = get_symm_buffer(None, cfg, timeout_s=20)
    assert buf.nbytes == buf.layout.nbytes > 0 and buf.world_size == world
    assert sum(buf.nbytes_by_region.values()) <= buf.nbytes
    for name, reg in buf.layout.regions.items():
        view = getattr(buf.regions((rank + 1) % world), name)
        assert view.dtype == reg.dtype and tuple(view.shape) == reg.shape
    assert buf.regions().x_scales is None  # only quantized recipes publish scales
    # every rank writes its id into row `rank` of every peer's x region
    for peer in range(world):
        buf.regions(peer).x[rank].fill_(rank + 0.5)
    buf.barrier()
    x = buf.regions().x
    for src in range(world):
        assert (x[src] == src + 0.5).all()
    # nothing is left in /dev/shm: files are unlinked once every rank mapped them
    leftovers = glob.glob("/dev/shm/megamoe-*")
    buf.destroy()
    return leftovers


@pytest.mark.parametrize("world", [2, 4])
def test_peer_writes_visible_and_no_shm_left(rank_pools, world):
    leftovers = rank_pools(world).run(peer_writes_are_visible)
    assert leftovers == [[]] * world


def late_peer_is_charged_to_the_waiting_rank(rank, world):
    import time

    cfg = MegaMoEConfig(**CFG)
    buf = get_symm_buffer(None, cfg, timeout_s=20)
    buf.barrier()
    before = int(buf.peer_wait_ns)
    if rank == 1:
        time.sleep(0.3)  # rank 1 arrives late: rank 0 waits for it, rank 1 finds rank 0 there
    sites_before = buf.peer_wait_ns_by_site.clone()
    buf.barrier(wait_site=2)
    waited = int(buf.peer_wait_ns) - before
    by_site = (buf.peer_wait_ns_by_site - sites_before).tolist()
    with pytest.raises(ValueError, match="wait_site"):
        buf.barrier(wait_site=4)
    buf.destroy()
    return waited, by_site


def test_peer_wait_counter(rank_pools):
    (w0, sites0), (w1, sites1) = rank_pools(2).run(late_peer_is_charged_to_the_waiting_rank)
    assert w0 >= 0.25e9, w0
    assert w1 < 0.1e9, w1
    # the wait is charged to the site the barrier named, and the total is the sites' sum
    assert sites0[2] == w0 and sites0[0] == sites0[1] == sites0[3] == 0, sites0


def barrier_times_out_when_a_peer_is_missing(rank, world):
    cfg = MegaMoEConfig(**CFG)
    buf = get_symm_buffer(None, cfg, timeout_s=3)
    if rank == 0:
        with pytest.raises(RuntimeError, match="(?i)rank 1|timed out|monitored"):
            buf.barrier()
    import time

    time.sleep(0.1 if rank == 0 else 5)  # rank 1 never arrives within the timeout


def test_barrier_fails_loudly_instead_of_hanging(rank_pools):
    rank_pools(2).run(barrier_times_out_when_a_peer_is_missing)
    rank_pools(2).close(force=True)  # the group saw a failed collective; next tests start afresh


def no_room_in_dev_shm_on_rank_1(rank, world):
    import errno

    import torch.distributed as dist

    real = os.posix_fallocate

    def fallocate(fd, offset, length):  # rank 1's /dev/shm is full
        if rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    os.posix_fallocate = fallocate
    try:
        with pytest.raises(ValueError, match="/dev/shm has no room for a rank's buffer file") as err:
            get_symm_buffer(None, MegaMoEConfig(**CFG), timeout_s=20)
    finally:
        os.posix_fallocate = real
    dist.barrier()  # every rank's cleanup done
    return str(err.value), glob.glob("/dev/shm/megamoe-*")


@pytest.mark.skipif(not hasattr(os, "posix_fallocate"), reason="files stay sparse without it")
def test_no_room_in_dev_shm_is_refused_on_every_rank(rank_pools):
    """A /dev/shm without room for a rank's file: that rank's creation finds it (the file's pages
    reserved), and every rank raises the same error at once instead of a SIGBUS at a later write
    or peers waiting out the timeout for the file; no file is left behind."""
    for message, leftovers in rank_pools(2).run(no_room_in_dev_shm_on_rank_1):
        assert "on rank 1: " in message and "rank 0:" not in message and "num_max_tokens_per_rank" in message
        assert leftovers == []
    assert rank_pools(2).run(peer_writes_are_visible) == [[]] * 2  # the group goes on


# a buffer of 2^20 tokens of 4096 bf16 values: 16 GiB of combine rows per rank of the group
HUGE = dict(CFG, hidden=4096, num_max_tokens_per_rank=1 << 20, dtype=torch.bfloat16)


def huge_buffer_is_refused_before_allocating(rank, world):
    cfg = MegaMoEConfig(**HUGE)
    asked = []

    def mem_get_info(device=None):
        asked.append(torch.device(device))
        return 8 << 30, 80 << 30

    real, torch.cuda.mem_get_info = torch.cuda.mem_get_info, mem_get_info
    try:
        # no GPU here: anything past the check would fail on the device, not with this message
        with pytest.raises(ValueError, match="SymmBuffer: the buffer needs \\d+ bytes") as err:
            get_symm_buffer(None, cfg, device="cuda:0", timeout_s=20)
    finally:
        torch.cuda.mem_get_info = real
    return str(err.value), asked


def test_buffer_larger_than_free_device_memory_is_refused(rank_pools):
    from megamoe_train.layout import buffer_layout
    from megamoe_train.transport.cuda_symmetric import allocation_bytes

    needed = allocation_bytes(buffer_layout(MegaMoEConfig(**HUGE), 2).nbytes, 2)
    for message, asked in rank_pools(2).run(huge_buffer_is_refused_before_allocating):
        assert asked == [torch.device("cuda", 0)]
        assert f"needs {needed} bytes" in message and f"but {8 << 30} bytes (8.00 GiB) are free" in message
        assert "num_max_tokens_per_rank=1048576" in message and "hidden=4096" in message
        assert "group (2, + 1 with shared experts)" in message
        assert "partials [2, 1048576, 4096] torch.bfloat16 16.00 GiB" in message


def test_check_fits():
    from megamoe_train.layout import buffer_layout
    from megamoe_train.symm_buffer import check_fits

    cfg = MegaMoEConfig(**HUGE)
    layout = buffer_layout(cfg, 4)
    check_fits(cfg, layout, layout.nbytes, layout.nbytes, torch.device("cuda", 1))  # exactly fits
    with pytest.raises(ValueError, match=f"needs {layout.nbytes + 1} bytes .* on cuda:1, but {layout.nbytes} bytes"):
        check_fits(cfg, layout, layout.nbytes + 1, layout.nbytes, torch.device("cuda", 1))
