"""Profile one mega_moe forward+backward on every GPU of this host (dev tool for kernel work).

  python benchmarks/profile_layer.py --shape S1 --recipe fp8 [--world 2] [--backend triton] [--cuda-graph]

Prints the median forward and forward+backward times, then rank 0's CUDA kernels of one
profiled iteration, by total time: where to look next. `--timeline` also prints that iteration's
kernels in launch order with their start, duration and the idle gap before each; the host is put
ahead of the GPU first (a sleep kernel), so a gap there is the GPU waiting on a dependency or
a peer, not on the host. `--host` instead measures the host's time per call with the GPU kept
ahead (what launching one call costs) and prints rank 0's Python functions by own time.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
import torch.distributed as dist
from bench_layer import SHAPES as LAYER_SHAPES

from megamoe_train import MegaMoEConfig, get_symm_buffer, mega_moe
from megamoe_train.graphs import GraphedMegaMoE
from megamoe_train.launch import spawn

SHAPES = dict(LAYER_SHAPES, small=(32, 4, 1024, 512, 2048))  # (experts, topk, hidden, intermediate, tokens per GPU)


def make_inputs(cfg: MegaMoEConfig, rank: int, world: int, dev, seed: int = 0):
    g = torch.Generator(device=dev).manual_seed(seed * 1000 + rank)
    E, H, I, K, T = cfg.num_experts, cfg.hidden, cfg.intermediate, cfg.topk, cfg.num_max_tokens_per_rank
    E_l = E // world
    x = torch.randn(T, H, device=dev, generator=g, dtype=torch.bfloat16)
    idx = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
    tw = torch.rand(T, K, device=dev, generator=g)
    w1 = torch.randn(E_l, 2 * I, H, device=dev, generator=g, dtype=torch.bfloat16) * H**-0.5
    w2 = torch.randn(E_l, H, I, device=dev, generator=g, dtype=torch.bfloat16) * I**-0.5
    return x, idx, tw, w1, w2


def _time(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _is_sleep(name: str) -> bool:  # torch.cuda._sleep's kernel, not the layer's
    return "spin_kernel" in name


def _cuda_spans(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of the profiled kernels and copies, in start order (no sleep)."""
    return sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not _is_sleep(e.name)
    )


def _busy_summary(prof) -> str:
    """Kernel launches, summed kernel time and the union of kernel intervals over the profiled
    window: where the GPU waits on the host (launch-bound) rather than on its kernels."""
    spans = [(s, e) for s, e, _ in _cuda_spans(prof)]
    if not spans:
        return "no CUDA kernels profiled"
    busy, cur_s, cur_e = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy, cur_s, cur_e = busy + cur_e - cur_s, s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    total = sum(e - s for s, e in spans)
    window = spans[-1][1] - spans[0][0]
    return (
        f"profiled forward+backward: {len(spans)} kernels, {total / 1e3:.3f} ms of kernel time, GPU busy "
        f"{busy / 1e3:.3f} of {window / 1e3:.3f} ms first-to-last kernel ({100 * busy / window:.0f}%)"
    )


def _timeline(prof) -> str:
    """Kernels / copies of the profiled window in start order: offset, duration, idle gap before."""
    spans = _cuda_spans(prof)
    if not spans:
        return "no CUDA kernels profiled"
    t0, end, lines = spans[0][0], spans[0][0], ["  start us   dur us   gap us  kernel"]
    for s, e, name in spans:
        lines.append(f"{s - t0:9.1f} {e - s:8.1f} {max(0.0, s - end):8.1f}  {name[:90]}")
        end = max(end, e)
    return "\n".join(lines)


@contextlib.contextmanager
def _verdicts_not_due():
    """A call waits for the status copy of the call VERDICT_LAG before it (call_state.py), which
    here sits behind the sleep kernel: with the lag past the measured calls the host never waits
    (on every rank alike; their verdicts are raised by the calls after)."""
    from megamoe_train import call_state

    lag = call_state.VERDICT_LAG
    call_state.VERDICT_LAG = lag + 10_000
    try:
        yield
    finally:
        call_state.VERDICT_LAG = lag


@_verdicts_not_due()
def _host_profile(fwd, fwd_bwd, iters: int, rank: int):
    """Host time per call with the GPU kept busy ahead of the host (a sleep kernel first), so the
    host never waits for the GPU: what the Python and launch path of one call costs. Then rank 0's
    functions by own time under cProfile (which slows Python calls; read it for the ranking)."""
    import cProfile
    import io
    import pstats
    import time

    def host_ms(fn) -> float:
        dist.barrier()
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)  # ~200 ms of GPU time queued first
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        ms = (time.perf_counter() - t0) * 1e3 / iters
        torch.cuda.synchronize()
        return ms

    f, fb = host_ms(fwd), host_ms(fwd_bwd)
    prof = cProfile.Profile()
    dist.barrier()
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    prof.enable()
    for _ in range(iters):
        fwd_bwd()
    prof.disable()
    torch.cuda.synchronize()
    if rank == 0:
        print(f"host per call (GPU ahead, {iters} calls): forward {f:.3f} ms, forward+backward {fb:.3f} ms", flush=True)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue(), flush=True)


def worker(rank, world, shape, recipe, backend, iters, cuda_graph=False, timeline=False, host=False):
    E, K, H, I, T = SHAPES[shape]
    cfg = MegaMoEConfig(num_experts=E, hidden=H, intermediate=I, topk=K, num_max_tokens_per_rank=T, recipe=recipe)
    buf = get_symm_buffer(None, cfg)
    dev = buf.device
    x, idx, tw, w1, w2 = make_inputs(cfg, rank, world, dev)
    leaves = [t.requires_grad_() for t in (x, tw, w1, w2)]
    gy = torch.randn_like(x)

    def fwd():
        with torch.no_grad():
            mega_moe(x, idx, tw, w1, w2, buf, backend=backend)

    graphed = GraphedMegaMoE(buf, w1, w2, backend=backend) if cuda_graph else None

    def fwd_bwd():
        y = graphed(x, idx, tw) if graphed else mega_moe(x, idx, tw, w1, w2, buf, backend=backend)
        y.backward(gy)
        for t in leaves:
            t.grad = None

    for _ in range(3):
        fwd_bwd()
    t_fwd, t_all = _time(fwd, iters), _time(fwd_bwd, iters)
    if rank == 0:
        how = "forward+backward replayed from CUDA graphs" if cuda_graph else "forward+backward"
        print(
            f"{shape} {recipe} world={world} backend={backend}: forward {t_fwd:.3f} ms, {how} {t_all:.3f} ms",
            flush=True,
        )
    if host:
        _host_profile(fwd, fwd_bwd, min(iters, 8), rank)  # 8 calls fit in the launch queue at P
        return
    dist.barrier()
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        if timeline:
            torch.cuda._sleep(50_000_000)  # ~25 ms: the host queues the whole iteration meanwhile
        fwd_bwd()
        torch.cuda.synchronize()
    if rank == 0:
        print(_busy_summary(prof), flush=True)
        if timeline:
            print(_timeline(prof), flush=True)
        print(
            prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60),
            flush=True,
        )
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=40), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="S1", choices=sorted(SHAPES))
    p.add_argument("--recipe", default="bf16")
    p.add_argument("--backend", default="triton")
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--cuda-graph", action="store_true", help="forward+backward through megamoe_train.graphs.GraphedMegaMoE"
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="also print the profiled iteration's kernels in order, host queued ahead",
    )
    p.add_argument(
        "--host",
        action="store_true",
        help="instead of the kernel profile: host time per call with the GPU ahead, and a cProfile of the host",
    )
    a = p.parse_args()
    spawn(worker, a.world, (a.shape, a.recipe, a.backend, a.iters, a.cuda_graph, a.timeline, a.host), backend="nccl")


if __name__ == "__main__":
    main()
