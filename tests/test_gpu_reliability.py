"""Issue 11 on GPUs (marked `gpu`, skipped without CUDA): call divergence under NCCL with both
executors, two streams sharing one buffer, and 64-bit offsets in the reduce kernel."""

import pytest
import torch

from megamoe_train import MegaMoECallMismatchError, MegaMoEConfig, MegaMoELayer, mega_moe
from test_gpu_triton import TRITON_BASE
from test_mega_moe_dist import make_problem

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
    else:  # host-free: that call moves no rows; the next call raises it on every rank
        y = order[0](x, idx, tw)
        torch.cuda.synchronize()
        assert y.abs().max() == 0
        with pytest.raises(MegaMoECallMismatchError, match="different calls"):
            order[1](x, idx, tw)
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
    want = (partials[0, :n].float() * mask[:, :1] + partials[1, :n].float() * mask[:, 1:] + partials[2, :n].float())
    assert torch.equal(out, want.to(torch.bfloat16))
