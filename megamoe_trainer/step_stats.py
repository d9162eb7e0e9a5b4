"""What each step of `megamoe-train` reports besides its loss, gathered on every rank without a
host sync: the rows each expert received (MegaMoE layers count their own, stock layers through a
router hook), how long the MegaMoE barriers waited for peers, the host's garbage-collection
pauses, and the step time. `StepStats` queues a step's numbers on the device and hands them to
rank 0's report (`report.ProgressReport`) one step later.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

__all__ = [
    "StockRouterLoad",
    "gather_expert_load",
    "all_gather_ep",
    "gather_host_waits",
    "PendingStep",
    "StepClock",
    "StepStats",
]


class StockRouterLoad:
    """Per-expert routed rows of Megatron's stock MoE layers (recipes with moe.megamoe_recipe: null),
    counted from each router's routing map; MegaMoE layers count their own (get_expert_load)."""

    def __init__(self, model):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.counts = [None] * len(self.routers)
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(module, inputs, output):
            if module.training:
                rows = output[1].sum(0).to(torch.int64)  # routing_map [T, E] -> rows per global expert
                self.counts[i] = rows if self.counts[i] is None else self.counts[i] + rows

        return hook

    def gather(self) -> torch.Tensor | None:
        """[layers, E] over the whole job (every rank's tokens), on the device, and reset."""
        if not self.routers or any(c is None for c in self.counts):
            return None
        load = torch.stack(self.counts)
        self.counts = [None] * len(self.routers)
        dist.all_reduce(load)
        return load


def gather_expert_load(model, dev: torch.device, stock: StockRouterLoad | None = None) -> torch.Tensor | None:
    """[num_moe_layers, E] rows each expert received this step, over the whole job, on the device
    (collectives enqueued, no host sync)."""
    from megatron.core import parallel_state

    from megatron_patch import get_expert_load

    local = get_expert_load(model, reset=True)
    if local is None or local.numel() == 0:
        return stock.gather() if stock is not None else None
    local = local.to(device=dev, dtype=torch.int64)
    # replicas of the same experts (expert data parallel) saw different tokens: sum them
    if parallel_state.get_expert_data_parallel_world_size() > 1:
        dist.all_reduce(local, group=parallel_state.get_expert_data_parallel_group())
    return all_gather_ep(local, dim=1)  # EP ranks hold contiguous expert ranges, in rank order


def all_gather_ep(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Every expert-parallel rank's `t`, concatenated along `dim` in rank order (enqueued, no host sync)."""
    from megatron.core import parallel_state

    ep_group = parallel_state.get_expert_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(ep_group))]
    dist.all_gather(parts, t, group=ep_group)
    return torch.cat(parts, dim=dim)


def gather_host_waits(model, previous: torch.Tensor | None, gc_paused_ns: int, dev: torch.device):
    """Per expert-parallel rank, this step's: ns its MegaMoE barriers waited for peers since
    `previous`, per barrier site (int64 [EP, len(protocol.WAIT_SITES)] on the device, or None
    without MegaMoE layers) and ns its host spent in garbage collection (int64 [EP]); and the new
    barrier snapshot. One all_gather, no host sync (torch.full sends the host value with the
    kernel launch)."""
    from megatron_patch import get_peer_wait_ns

    now = get_peer_wait_ns(model, by_site=True)
    gc_ns = torch.full((1,), gc_paused_ns, dtype=torch.int64, device=dev)
    if now is None:
        return None, all_gather_ep(gc_ns), previous
    waited = now - previous if previous is not None else now
    both = all_gather_ep(torch.cat([waited.to(torch.int64), gc_ns])[None], dim=0)  # [EP, sites + 1]
    return both[:, :-1], both[:, -1], now


class PendingStep:
    """One step's numbers on their way to the host: device tensors copied into pinned memory
    without a sync and read one step later, when the GPU has long finished them, so the host never
    waits for the GPU inside the loop. Step time = GPU time between the ends of consecutive steps
    (CUDA events), which counts idle gaps too; on CPU, host wall time."""

    def __init__(
        self,
        step: int,
        lr: float,
        consumed: int,
        values: torch.Tensor,
        load: torch.Tensor | None,
        peer_wait: torch.Tensor | None,
        gc_paused: torch.Tensor,
        start_event,
        prev_end,
        host_start: float,
    ):
        self.step, self.lr, self.consumed = step, lr, consumed
        self.start_event, self.prev_end = start_event, prev_end
        cuda = values.is_cuda

        def to_host(t):
            return None if t is None else (t.to("cpu", non_blocking=True) if t.is_cuda else t)

        self.values, self.load, self.peer_wait = to_host(values), to_host(load), to_host(peer_wait)
        self.gc_paused = to_host(gc_paused)
        self.end_event = None
        if cuda:
            self.end_event = torch.cuda.Event(enable_timing=True)
            self.end_event.record()
        else:
            self.host_seconds = time.perf_counter() - host_start

    def seconds(self) -> float:
        """The step's time (waits for its end on the GPU: call one step later)."""
        if self.end_event is None:
            return self.host_seconds
        self.end_event.synchronize()
        return (self.prev_end or self.start_event).elapsed_time(self.end_event) / 1e3


class StepClock:
    """A step's start: host time, and on CUDA an event on the stream."""

    def __init__(self, device: str):
        self.host_start = time.perf_counter()
        self.event = None
        if device == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()


class StepStats:
    """Every step's numbers on every rank, queued as a PendingStep (collectives enqueued, no host
    sync) and reported one step later (`report`); and this invocation's tokens and step seconds."""

    def __init__(self, run, host_gc, report=None):
        from megatron.core import parallel_state

        self.run, self.host_gc, self.progress = run, host_gc, report
        recipe = run.recipe
        self.tokens_per_step = recipe.tokens_per_step
        self.stock_load = StockRouterLoad(run.model) if recipe.moe.megamoe_recipe is None else None
        self.dp_group = parallel_state.get_data_parallel_group()
        self.pending: list[PendingStep] = []
        self.tokens, self.seconds = 0, 0.0
        self.wait_snapshot = None  # MegaMoE barriers' wait counter at the end of the previous step
        self.prev_end = None  # the previous step's end event (step time = GPU time between step ends)

    def record(self, step: int, lr: float, consumed: int, values: torch.Tensor, clock: StepClock):
        """The step's [loss, success, grad norm] (this rank's) reduced over data-parallel ranks,
        the expert loads, the barrier waits and GC pauses gathered; the step's scheduled host GC
        runs here, so its pause counts in this step."""
        run = self.run
        dist.all_reduce(values[:2], group=self.dp_group)  # loss sum and success count over data-parallel ranks
        load = gather_expert_load(run.model, run.dev, self.stock_load)
        self.host_gc.after_step(step)
        peer_wait, gc_paused, self.wait_snapshot = gather_host_waits(
            run.model, self.wait_snapshot, self.host_gc.take_paused_ns(), run.dev
        )
        self.pending.append(
            PendingStep(
                step, lr, consumed, values, load, peer_wait, gc_paused, clock.event, self.prev_end, clock.host_start
            )
        )
        self.prev_end = self.pending[-1].end_event

    def report(self, keep: int = 0):
        """Hand all but the newest `keep` queued steps to the report (by now long computed)."""
        while len(self.pending) > keep:
            p = self.pending.pop(0)
            step_time = p.seconds()
            self.tokens += self.tokens_per_step
            self.seconds += step_time
            if self.progress is not None:
                self.progress.step(
                    p.step, p.lr, *p.values.tolist(), step_time, p.consumed, p.load, p.peer_wait, p.gc_paused
                )

    def restart_clock(self):
        """The time since the last step (a checkpoint's) is no step's."""
        self.prev_end = None
