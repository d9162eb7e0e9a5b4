"""The one way the micro-benchmarks time a GPU call: warm up, then time each call alone between
two CUDA events and take the median (a call's own time, not a mean pulled by stragglers)."""

from __future__ import annotations

import statistics

import torch


def median_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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
