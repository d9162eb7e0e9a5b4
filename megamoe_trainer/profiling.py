"""Where a training step's GPU time goes: torch.profiler over `run.profile_steps` steps from
`run.profile_at`, summarized per rank.

The summary (also in RUN/summary.json, and RUN/profile/trace_rankR.json for a trace viewer):
- wall_s: host wall time of the profiled steps (synchronized at both ends);
- busy_s: union of the GPU's kernel / memcpy / memset intervals over all streams (time the GPU
  does anything), and busy_fraction = busy_s / wall_s;
- kernel_s: sum of kernel durations (overlapping streams counted twice), memcpy_s likewise;
- moe_kernel_s / moe_share: kernels launched inside an MoE layer's forward or backward (ranges
  opened by hooks on every megatron MoELayer, MegaMoE and stock alike), over kernel_s;
- peer_wait_s: time in MegaMoE's device barrier kernel, i.e. this rank's GPU spinning until its
  expert-parallel peers arrive (load imbalance between ranks, or a peer's host running late):
  counted in busy_s and kernel_s, but no work. Under the profiler each rank's host runs slower,
  and unevenly, so a host-late peer inflates this well past the unprofiled wait (metrics.jsonl's
  peer_wait_ms, from the barriers' own counter, is the number to trust);
- top_kernels: the 15 largest kernel names by total time; top_moe_kernels and top_other_kernels
  the same inside and outside the MoE ranges (templated CUTLASS names keep their start and end,
  where the element types and the schedule are spelled).
Profiler overhead lengthens the profiled steps somewhat; tokens/s comes from the unprofiled steps.
"""

from __future__ import annotations

import bisect
import json
import os
import time
from collections import defaultdict

import torch

from .recipe import runs_on_cuda

MOE_FORWARD, MOE_BACKWARD = "megamoe_trainer/moe_forward", "megamoe_trainer/moe_backward"
PEER_WAIT_KERNEL = "_barrier_kernel"  # megamoe_train/device_barrier.py's Triton kernel


class _Range:
    """A profiler range opened in one autograd callback and closed in another."""

    def __init__(self, name: str):
        self.name, self.handle = name, None

    def open(self):
        self.handle = torch.autograd.profiler.record_function(self.name)
        self.handle.__enter__()

    def close(self):
        if self.handle is not None:
            self.handle.__exit__(None, None, None)
            self.handle = None


class _CallOnBackward(torch.autograd.Function):
    """Identity whose backward calls `action()`: on the layer's output it runs first of the layer's
    backward (open the range), on its input when the layer's input gradient is complete (close it)."""

    @staticmethod
    def forward(ctx, x, action):
        ctx.action = action
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.action()
        return grad, None


class _MoERanges:
    """Forward / backward profiler ranges around every MoELayer (hooks; removed by remove())."""

    def __init__(self, model):
        from megatron.core.transformer.moe.moe_layer import MoELayer

        self.handles = []
        for module in model.modules():
            if isinstance(module, MoELayer):
                self.handles.append(module.register_forward_pre_hook(self._pre))
                self.handles.append(module.register_forward_hook(self._post))

    @staticmethod
    def _pre(module, args):
        module._profile_fwd = _Range(MOE_FORWARD)
        module._profile_fwd.open()
        module._profile_bwd = _Range(MOE_BACKWARD)
        x = args[0]
        if torch.is_grad_enabled() and x.requires_grad:
            return (_CallOnBackward.apply(x, module._profile_bwd.close), *args[1:])
        return None

    @staticmethod
    def _post(module, args, output):
        module._profile_fwd.close()
        if torch.is_grad_enabled() and isinstance(output, tuple) and output[0].requires_grad:
            return (_CallOnBackward.apply(output[0], module._profile_bwd.open), *output[1:])
        return None

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _short(name: str) -> str:
    return name if len(name) <= 200 else f"{name[:90]} ... {name[-100:]}"


def _top(by_name: dict, n: int = 15) -> list[dict]:
    return [{"name": _short(k), "s": us / 1e6} for k, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:n]]


def summarize_trace(trace: dict, wall_s: float) -> dict:
    """The summary above from a chrome trace (torch.profiler export) of the profiled steps."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launches = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (e.get("tid"), e["ts"])
    ranges = defaultdict(list)  # tid -> sorted (start, end) of MoE ranges
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name") in (MOE_FORWARD, MOE_BACKWARD):
            ranges[e.get("tid")].append((e["ts"], e["ts"] + e["dur"]))
    starts = {}
    for tid, rs in ranges.items():
        rs.sort()
        starts[tid] = [a for a, _ in rs]

    def in_moe(kernel) -> bool:
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None or launch[0] not in ranges:
            return False
        tid, ts = launch
        i = bisect.bisect_right(starts[tid], ts) - 1
        return i >= 0 and ranges[tid][i][0] <= ts <= ranges[tid][i][1]

    kernel_us = memcpy_us = moe_us = wait_us = 0.0
    by_name, moe_by_name, other_by_name = defaultdict(float), defaultdict(float), defaultdict(float)
    for e in gpu:
        if e["cat"] == "kernel":
            kernel_us += e["dur"]
            by_name[e["name"]] += e["dur"]
            if e["name"] == PEER_WAIT_KERNEL:
                wait_us += e["dur"]
            if in_moe(e):
                moe_us += e["dur"]
                moe_by_name[e["name"]] += e["dur"]
            else:
                other_by_name[e["name"]] += e["dur"]
        else:
            memcpy_us += e["dur"]
    busy_us = _union_length([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    moe_ranges = sum(len(rs) for rs in ranges.values())
    return {
        "wall_s": wall_s,
        "busy_s": busy_us / 1e6,
        "busy_fraction": busy_us / 1e6 / wall_s if gpu and wall_s > 0 else None,
        "kernel_s": kernel_us / 1e6,
        "memcpy_s": memcpy_us / 1e6,
        "moe_kernel_s": moe_us / 1e6,
        "moe_share": moe_us / kernel_us if kernel_us else None,
        "peer_wait_s": wait_us / 1e6,
        "kernels": sum(1 for e in gpu if e["cat"] == "kernel"),
        "moe_ranges": moe_ranges,
        "top_kernels": _top(by_name),
        "top_moe_kernels": _top(moe_by_name),
        "top_other_kernels": _top(other_by_name),
    }


class StepProfiler:
    """Profiles steps profile_at .. profile_at + profile_steps - 1 (on CPU only host activity:
    no GPU numbers, but the same ranges and summary fields)."""

    def __init__(self, recipe, run_dir: str, model, rank: int):
        self.first = recipe.run.profile_at
        self.last = self.first + recipe.run.profile_steps - 1
        self.model, self.rank = model, rank
        self.dir = os.path.join(run_dir, "profile")
        self.prof = self.ranges = None
        self.summary = None
        self.cuda = runs_on_cuda(recipe)

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def before_step(self, step: int):
        if step != self.first:
            return
        self._sync()
        self.ranges = _MoERanges(self.model)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities)
        self.prof.__enter__()
        self.start = time.perf_counter()

    def after_step(self, step: int):
        if step != self.last or self.prof is None:
            return
        self._sync()
        wall = time.perf_counter() - self.start
        self.prof.__exit__(None, None, None)
        self.ranges.remove()
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, f"trace_rank{self.rank}.json")
        self.prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        self.summary = {"steps": [self.first, self.last], **summarize_trace(trace, wall)}
        self.prof = None
