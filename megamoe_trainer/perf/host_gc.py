"""Python's garbage collector in the training loop: measured every step, and optionally run by hand.

Expert-parallel ranks meet at every MoE layer's barriers, so a pause on one rank's host (the
interpreter stopping to scan its heap) is paid by every peer as barrier wait. The automatic
collector starts whenever allocations cross its thresholds, at a different moment on each rank,
and a full collection scans every object the process holds (megatron, torch, the model).

manual: what Megatron's `--manual-gc` does: after the model is built, collect once and freeze
what survives (those objects are never scanned again), turn the automatic collector off, and
collect every `every` steps at the end of the same step on every rank, so the ranks pause
together. Objects in reference cycles then wait for that collection before they are freed.

Either way the time spent in collections is measured (gc.callbacks) and taken per step."""

from __future__ import annotations

import gc
import time


class HostGC:
    def __init__(self, manual: bool, every: int):
        self.manual, self.every = manual, every
        self._started: float | None = None
        self._paused_ns = 0
        gc.callbacks.append(self._on_gc)
        if manual:
            gc.collect()
            gc.freeze()
            gc.disable()
        self._paused_ns = 0  # the start-up collection belongs to no step

    def _on_gc(self, phase: str, info: dict):
        now = time.perf_counter()
        if phase == "start":
            self._started = now
        elif self._started is not None:
            self._paused_ns += int((now - self._started) * 1e9)
            self._started = None

    def after_step(self, step: int):
        """End of a step: the scheduled collection (manual mode, same step on every rank)."""
        if self.manual and self.every and step % self.every == 0:
            gc.collect()

    def take_paused_ns(self) -> int:
        """ns this process spent in collections since the last call."""
        paused, self._paused_ns = self._paused_ns, 0
        return paused

    def close(self):
        """Back to the interpreter's defaults (the launcher collects before the group goes)."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self.manual:
            gc.unfreeze()
            gc.enable()
