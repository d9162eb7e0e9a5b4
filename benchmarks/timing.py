"""The one way the micro-benchmarks time a GPU call: warm up, then time each call alone between
two CUDA events and take the median (a call's own time, not a mean pulled by stragglers). Before
each call the GPU spins for ~0.1 ms while the host queues the events and the call, so the host's
launch time stays outside the events (it was inside before 2026-12-01: a few to ~15% of a
sub-millisecond kernel's time)."""

from __future__ import annotations

import statistics

import torch

_SPIN_CYCLES = 200_000  # ~0.1 ms at H200 clocks: longer than queueing a few launches


def median_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_SPIN_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def hbm_bandwidth(nbytes: int = 4 << 30, iters: int = 20, warmup: int = 3) -> float:
    """Bytes per second of a device-to-device copy of `nbytes` (read + write): the HBM rate the
    micro-benchmarks' floors divide by, measured in the same run."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (median_ms(lambda: dst.copy_(src), iters, warmup) * 1e-3)
