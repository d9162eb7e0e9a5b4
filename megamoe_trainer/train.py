"""The per-rank training loop of `megamoe-train` (started by `megamoe_trainer.cli`).

Trains the model of `megamoe_trainer.model` (Adam, linear warmup + cosine decay), calls
`finalize_model_grads` every step, logs progress on rank 0, and checkpoints with
`megatron.core.dist_checkpointing`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from .recipe import Recipe, runs_on_cuda


def lr_at(step: int, recipe: Recipe) -> float:
    """LR for optimizer step `step` (1-based): linear warmup, then cosine from lr to min_lr."""
    t = recipe.train
    if t.warmup_steps and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def _set_lr(optimizer, lr: float):
    for group in optimizer.param_groups:
        group["lr"] = lr


def _set_recipe_hyperparams(optimizer, recipe: Recipe):
    """The recipe's weight decay and betas in every param group. Megatron's param groups carry
    weight_decay = train.weight_decay for all of them and a wd_mult (0 for 1-D parameters: norms,
    biases) that only its OptimizerParamScheduler multiplies in, which this trainer does not run;
    and a checkpoint load replaces the groups with the writer's (its weight decay and betas)."""
    t = recipe.train
    for group in optimizer.param_groups:
        group["weight_decay"] = t.weight_decay * group.get("wd_mult", 1.0)
        group["betas"] = (t.adam_beta1, t.adam_beta2)


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


def _gather_expert_load(model, dev: torch.device, stock: StockRouterLoad | None = None) -> torch.Tensor | None:
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
    return _all_gather_ep(local, dim=1)  # EP ranks hold contiguous expert ranges, in rank order


def _all_gather_ep(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Every expert-parallel rank's `t`, concatenated along `dim` in rank order (enqueued, no host sync)."""
    from megatron.core import parallel_state

    ep_group = parallel_state.get_expert_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(ep_group))]
    dist.all_gather(parts, t, group=ep_group)
    return torch.cat(parts, dim=dim)


def _gather_host_waits(model, previous: torch.Tensor | None, gc_paused_ns: int, dev: torch.device):
    """Per expert-parallel rank, this step's: ns its MegaMoE barriers waited for peers since
    `previous`, per barrier site (int64 [EP, len(protocol.WAIT_SITES)] on the device, or None
    without MegaMoE layers) and ns its host spent in garbage collection (int64 [EP]); and the new
    barrier snapshot. One all_gather, no host sync (torch.full sends the host value with the
    kernel launch)."""
    from megatron_patch import get_peer_wait_ns

    now = get_peer_wait_ns(model, by_site=True)
    gc_ns = torch.full((1,), gc_paused_ns, dtype=torch.int64, device=dev)
    if now is None:
        return None, _all_gather_ep(gc_ns), previous
    waited = now - previous if previous is not None else now
    both = _all_gather_ep(torch.cat([waited.to(torch.int64), gc_ns])[None], dim=0)  # [EP, sites + 1]
    return both[:, :-1], both[:, -1], now


class PendingStep:
    """One step's numbers on their way to the host: device tensors copied into pinned memory
    without a sync and read one step later, when the GPU has long finished them, so the host never
    waits for the GPU inside the loop. Step time = GPU time between the ends of consecutive steps
    (CUDA events), which counts idle gaps too; on CPU, host wall time."""

    def __init__(self, step: int, lr: float, consumed: int, values: torch.Tensor, load: torch.Tensor | None,
                 peer_wait: torch.Tensor | None, gc_paused: torch.Tensor, start_event, prev_end, host_start: float):
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


def _init_parallel(recipe: Recipe, device: str):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if device == "cpu":
        from megatron_patch import cpu_compat

        cpu_compat.apply()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=recipe.parallel.tensor_parallel,
        expert_model_parallel_size=recipe.parallel.expert_parallel,
    )
    torch.manual_seed(recipe.run.seed)
    model_parallel_cuda_manual_seed(recipe.run.seed)


def _describe(recipe: Recipe, world: int, device: str, model, optimizer, dev: torch.device, built_s: float) -> str:
    """The run's first line (collective: counts the experts of every rank)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_patch.grad_buffers import overwrites_expert_main_grads

    from .flops import train_flops_per_token
    from .model import count_params
    from .perf import describe as describe_perf

    total, expert = count_params(model)
    expert_total = torch.tensor([expert], dtype=torch.int64, device=dev)  # NCCL reduces GPU tensors only
    dist.all_reduce(expert_total)  # every rank holds its own experts (expert-DP replicas: divide out)
    dense_params = total - expert  # replicated on every rank (TP 1)
    expert_params = int(expert_total) // max(1, parallel_state.get_expert_data_parallel_world_size())
    m, moe, p = recipe.model, recipe.moe, recipe.parallel
    moe_layers = [type(mod).__name__ for mod in model.modules() if isinstance(mod, MoELayer)]
    shared = f", shared {moe.shared_expert_ffn_hidden_size}" if moe.shared_expert_ffn_hidden_size else ""
    adam = describe_perf(optimizer, recipe.train.adam_moments_dtype)
    graphs = False  # what the MoE layers will decide at their first call (megatron_patch.cuda_graphs_enabled)
    if moe.megamoe_recipe and dev.type == "cuda":
        from megatron_patch import cuda_graphs_enabled, megamoe_config

        graphs = cuda_graphs_enabled(model.config, megamoe_config(model.config, dtype=model.config.params_dtype), dev)
    return (f"[megamoe-train] {world} ranks on {device} | EP {p.expert_parallel}, TP {p.tensor_parallel}, "
            f"DP {recipe.data_parallel_size} | {m.num_layers} layers, hidden {m.hidden_size}, {moe.num_experts} experts "
            f"top-{moe.topk} (I={moe.ffn_hidden_size}{shared}) | "
            f"MoE: {'MegaMoE ' + moe.megamoe_recipe if moe.megamoe_recipe else 'stock Megatron'} "
            f"({len(moe_layers)} x {moe_layers[0] if moe_layers else '-'}"
            f"{', CUDA graphs' if graphs else ''}) | "
            f"params {(dense_params + expert_params) / 1e6:.2f} M ({expert_params / 1e6:.2f} M in experts) | "
            f"{train_flops_per_token(recipe) / 1e9:.2f} GFLOP/token (MFU vs {recipe.run.peak_tflops:g} TFLOP/s per GPU) | "
            f"attention {recipe.perf.attention} | "
            f"{adam}"
            f"{'expert main_grads written over, not zeroed | ' if overwrites_expert_main_grads(model) else ''}"
            f"data: {recipe.data.path or 'synthetic'} | built in {built_s:.1f} s")


def run_rank(rank: int, world: int, recipe_dict: dict, run_dir: str, resume: bool):
    """Entry of every rank (torch.distributed is initialized by the launcher)."""
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from . import checkpoint as ckpt
    from .data import build_corpus
    from .flops import mfu
    from . import perf
    from .model import build_model
    from .profiling import StepProfiler
    from .report import ProgressReport

    recipe = Recipe.from_dict(recipe_dict)
    device = "cuda" if runs_on_cuda(recipe) else "cpu"
    _init_parallel(recipe, device)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = recipe.train.tf32_matmul
    is_main = rank == 0
    say = (lambda *a: print(*a, flush=True)) if is_main else (lambda *a: None)
    t0 = time.perf_counter()
    model, optimizer, cfg = build_model(recipe, device)
    corpus = build_corpus(recipe, run_dir)
    stock_load = StockRouterLoad(model) if recipe.moe.megamoe_recipe is None else None
    say(_describe(recipe, world, device, model, optimizer, dev, time.perf_counter() - t0))

    start_step, consumed = 0, 0
    latest = ckpt.latest_checkpoint(run_dir) if resume else None
    if latest is not None:
        state = ckpt.load_checkpoint(latest, model, optimizer, device)
        perf.after_checkpoint_load(recipe.perf, optimizer)  # the loaded param groups carry the writer's flags
        start_step, consumed = state["step"], state["consumed_samples"]
        say(f"[megamoe-train] resumed from {latest} at step {start_step} ({consumed} samples consumed)")
    _set_recipe_hyperparams(optimizer, recipe)

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_group = parallel_state.get_data_parallel_group()
    mbs, gbs = recipe.train.micro_batch_size, recipe.global_batch_size
    accum, dp_size = recipe.train.grad_accum_steps, parallel_state.get_data_parallel_world_size()
    steps = recipe.train.steps
    last = min(steps, recipe.train.stop_at or steps)  # this invocation's final step
    if start_step >= last:
        say(f"[megamoe-train] nothing to do: the checkpoint is at step {start_step} (train.steps={steps}, train.stop_at={recipe.train.stop_at})")
    report = ProgressReport(recipe, run_dir, start_step if latest else None, start_step + 1, last) if is_main else None
    profiler = StepProfiler(recipe, run_dir, model, rank) if recipe.run.profile_at else None

    def fetch(step_start: int, micro: int) -> dict:
        """Micro-batch `micro` of the step whose samples start at step_start: micro-batch i
        covers the step's samples [i * dp * mbs, (i + 1) * dp * mbs), this rank its mbs of them
        (with one micro-batch per step: the rank's slice of the global batch, as before)."""
        first_sample = step_start + (micro * dp_size + dp_rank) * mbs
        batch = corpus.batch(range(first_sample, first_sample + mbs))
        if device == "cuda":
            return {k: v.pin_memory().to(dev, non_blocking=True) for k, v in batch.items()}
        return batch

    host_gc = perf.host_gc(recipe.perf)  # after the model and corpus exist
    pending: list[PendingStep] = []
    totals = {"tokens": 0, "seconds": 0.0}
    wait_snapshot = None  # MegaMoE barriers' wait counter at the end of the previous step

    def finish_oldest():
        p = pending.pop(0)
        step_time = p.seconds()
        totals["tokens"] += recipe.tokens_per_step
        totals["seconds"] += step_time
        if report is not None:
            report.step(p.step, p.lr, *p.values.tolist(), step_time, p.consumed, p.load, p.peer_wait, p.gc_paused)

    run_start = time.perf_counter()
    last_ckpt_step = start_step
    prev_end = None
    model.train()
    # The step's loss is the mean over micro-batches and data-parallel ranks: each micro-batch's
    # backward takes its loss over accum x DP, so DDP sums gradients unscaled (model.py; for a DP
    # that is a power of two the gradients are the bits of scaling after the backward).
    # Megatron's aux losses reach the router through the same scale.
    loss_scale = 1.0 / (accum * dp_size)
    if loss_scale != 1.0:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(loss_scale, device=dev))
    batch = fetch(consumed, 0) if start_step < last else None
    for step in range(start_step + 1, last + 1):
        host_start = time.perf_counter()
        start_event = None
        if device == "cuda":
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        if profiler is not None:
            profiler.before_step(step)
        lr = lr_at(step, recipe)
        _set_lr(optimizer, lr)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = 0.0
        for micro in range(accum):  # gradients add up in main_grad; DDP reduces after the last
            with model.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [B, S]
                mask = batch["loss_mask"]
                micro_loss = (per_token.float() * mask).sum() / mask.sum().clamp(min=1)
                (micro_loss * loss_scale).backward()
            loss = loss + micro_loss.detach() / accum
            if micro < accum - 1:
                batch = fetch(consumed, micro + 1)
        finalize_model_grads([model])
        ok, grad_norm, _ = optimizer.step()
        consumed += gbs
        if step < last:  # the next batch is made while the GPU works through this step
            batch = fetch(consumed, 0)

        # loss, success, grad norm as one device tensor (torch.full: a host value sent to the GPU
        # with torch.tensor would synchronize)
        if not isinstance(grad_norm, torch.Tensor):
            grad_norm = torch.full((), float("nan") if grad_norm is None else float(grad_norm), device=loss.device)
        values = torch.stack([loss.detach().float(), torch.full((), float(ok), device=loss.device),
                              grad_norm.detach().float().reshape(())])
        dist.all_reduce(values[:2], group=dp_group)  # loss sum and success count over data-parallel ranks
        load = _gather_expert_load(model, dev, stock_load)
        host_gc.after_step(step)
        peer_wait, gc_paused, wait_snapshot = _gather_host_waits(model, wait_snapshot, host_gc.take_paused_ns(), dev)
        pending.append(PendingStep(step, lr, consumed, values, load, peer_wait, gc_paused, start_event, prev_end,
                                   host_start))
        prev_end = pending[-1].end_event
        if profiler is not None:
            profiler.after_step(step)
        while len(pending) > 1:  # the previous step's numbers, by now long computed
            finish_oldest()
        if recipe.run.checkpoint and recipe.run.save_every and step % recipe.run.save_every == 0 and step != last:
            while pending:
                finish_oldest()
            ckpt.save_checkpoint(run_dir, step, consumed, model, optimizer, device, {"recipe": recipe.to_dict()})
            last_ckpt_step = step
            prev_end = None  # the checkpoint's time is no step's
            say(f"[megamoe-train] checkpoint step {step} saved")
    while pending:
        finish_oldest()
    host_gc.close()

    if recipe.run.checkpoint and last > last_ckpt_step:
        path = ckpt.save_checkpoint(run_dir, last, consumed, model, optimizer, device, {"recipe": recipe.to_dict()})
        say(f"[megamoe-train] checkpoint saved: {path}")
    if last > start_step:  # nothing ran: summary.json of the steps that did stays (every rank decides alike)
        summary = _summary(device, totals, profiler, run_dir)
    if report is not None and report.metrics.records and last > start_step:  # nothing ran: no summary of old steps
        report.plot()
        records = report.metrics.records
        wall = time.perf_counter() - run_start
        tps = summary["tokens_per_s"]
        # the first steps carry compilation and allocator warm-up: give the steady rate beside the mean
        # (this invocation's steps: after a resume the records also hold the earlier invocations')
        ran = [r for r in records if r["step"] > start_step]
        warm = min(5, len(ran) // 4)
        steady = statistics.median(r["tokens_per_s"] for r in ran[warm:])
        print(f"[megamoe-train] {'done' if last == steps else 'stopped (train.stop_at)'}: steps {start_step + 1}..{last} in {wall:.1f} s "
              f"({tps:.0f} tok/s, MFU {100 * mfu(recipe, tps):.1f}% over the steps; median after the first {warm}: "
              f"{steady:.0f} tok/s, MFU {100 * mfu(recipe, steady):.1f}%) | loss {records[0]['loss']:.4f} (step {records[0]['step']}) -> "
              f"{records[-1]['loss']:.4f} (step {records[-1]['step']}) | metrics {report.metrics.path} | plot {report.plot_path}", flush=True)
        if summary["peak_memory_gib"]:
            print(f"[megamoe-train] peak memory per GPU (GiB, allocated): {', '.join(f'{x:.1f}' for x in summary['peak_memory_gib'])}", flush=True)
    if loss_scale != 1.0:  # no CUDA tensor left in a class attribute for interpreter exit to free
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
    dist.barrier()


def _summary(device: str, totals: dict, profiler, run_dir: str) -> dict:
    """RUN/summary.json (written by rank 0): tokens/s over this invocation's steps, peak memory of
    every GPU, the step profile of every rank. Collective."""
    local = {"peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
             "profile": profiler.summary if profiler is not None else None}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    summary = {
        "tokens_per_s": totals["tokens"] / max(totals["seconds"], 1e-9),
        "peak_memory_gib": [p["peak_memory_gib"] for p in parts] if device == "cuda" else None,
        "profile": [p["profile"] for p in parts] if profiler is not None else None,
    }
    if dist.get_rank() == 0:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return summary
