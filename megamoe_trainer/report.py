"""Run outputs of `megamoe-train`: the metrics log, the progress line, the progress plot and the
closing lines (rank 0), and RUN/summary.json (`write_summary`, collective)."""

from __future__ import annotations

import json
import math
import os
import statistics
import time

from megamoe_train.protocol import WAIT_SITES


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def read_metrics(path: str) -> list[dict]:
    """The step records of a metrics.jsonl as one continuous run. The file is only appended to:
    each invocation first writes a marker, {"event": "start" or "resume", "from_step": S, ...},
    and the records of steps past S written before it (steps run again after a resume) drop
    out. A line cut short by a crash is skipped."""
    records: list[dict] = []
    try:
        f = open(path)
    except FileNotFoundError:
        return records
    with f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(rec, dict):
                continue
            if "event" in rec:
                records = [r for r in records if r["step"] <= rec.get("from_step", 0)]
            elif isinstance(rec.get("step"), int):
                records.append(rec)
    return records


class MetricsLog:
    """metrics.jsonl in the run dir: one JSON object per logged step, after this invocation's
    marker line (`read_metrics`). Appended to, never truncated: what an earlier invocation
    wrote stays."""

    def __init__(self, path: str, resume_step: int | None, checkpoint: str | None = None):
        self.path = path
        self.records = [r for r in read_metrics(path) if r["step"] <= resume_step] if resume_step is not None else []
        # a record appended to a line cut short by a crash would be lost with it
        self._newline = os.path.exists(path) and os.path.getsize(path) > 0 and not _ends_with_newline(path)
        self._write(
            {
                "event": "start" if resume_step is None else "resume",
                "from_step": resume_step or 0,
                "checkpoint": checkpoint,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
        )

    def _write(self, record: dict):
        with open(self.path, "a") as f:
            f.write(("\n" if self._newline else "") + json.dumps(record) + "\n")
        self._newline = False

    def append(self, record: dict):
        self.records.append(record)
        self._write(record)


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


class ProgressReport:
    """Turns each step's numbers into its metrics.jsonl record, the progress line (every
    run.log_every steps, and the first and last step of the invocation) and progress.png."""

    def __init__(
        self,
        recipe,
        run_dir: str,
        resume_step: int | None,
        first_step: int,
        last_step: int,
        peak_tflops: float | None = None,
        checkpoint: str | None = None,
    ):
        self.recipe, self.first_step, self.last_step = recipe, first_step, last_step
        self.peak_tflops = peak_tflops  # None: no MFU (no peak known for the device)
        self.metrics = MetricsLog(os.path.join(run_dir, "metrics.jsonl"), resume_step, checkpoint)
        self.plot_path = os.path.join(run_dir, "progress.png")
        moe = recipe.moe
        self.title = (
            f"{os.path.basename(run_dir)}: {moe.num_experts} experts top-{moe.topk}, MegaMoE {moe.megamoe_recipe}"
        )
        self.window: list[float] = []  # losses since the last progress line

    def step(
        self,
        step: int,
        lr: float,
        loss_sum: float,
        ok_count: float,
        grad_norm: float,
        step_time: float,
        consumed: int,
        load=None,
        peer_wait=None,
        gc_paused=None,
    ):
        """loss_sum / ok_count: summed over data-parallel ranks; load: [MoE layers, experts] rows or None;
        peer_wait: [EP ranks, barrier sites] ns each rank's MegaMoE barriers waited for their peers this
        step (sites: megamoe_train.protocol.WAIT_SITES), or None;
        gc_paused: [EP ranks] ns each rank's host spent in Python garbage collection this step, or None."""
        recipe, dp = self.recipe, self.recipe.data_parallel_size
        tokens_per_s = recipe.tokens_per_step / step_time
        record = {
            "step": step,
            "loss": loss_sum / dp,
            "lr": lr,
            "grad_norm": None if math.isnan(grad_norm) else grad_norm,
            "tokens_per_s": tokens_per_s,
            "mfu": self.mfu(tokens_per_s),
            "step_time_s": step_time,
            "skipped": ok_count < dp,
            "consumed_samples": consumed,
        }
        if load is not None:
            per_expert = load.sum(0).double()
            mean = per_expert.mean().item()
            layer_imb = load.double().max(1).values / load.double().mean(1).clamp(min=1e-9)
            record["load_imbalance"] = per_expert.max().item() / mean if mean > 0 else None
            record["load_imbalance_worst_layer"] = layer_imb.max().item()
            record["expert_load"] = load.tolist()
            ep = recipe.parallel.expert_parallel
            if ep > 1:  # EP rank r holds experts [r E/EP, (r+1) E/EP); every layer's barriers wait for its busiest rank
                per_rank = load.double().reshape(load.shape[0], ep, -1).sum(-1)  # [layers, EP]
                record["ep_rank_load"] = per_rank.sum(0).tolist()
                record["ep_rank_imbalance"] = (
                    per_rank.max(1).values.sum() / per_rank.mean(1).sum().clamp(min=1e-9)
                ).item()
        if peer_wait is not None:
            by_site = peer_wait.double() / 1e6  # [EP, sites]
            waits = record["peer_wait_ms"] = by_site.sum(1).tolist()
            # where each rank waited: the peers were late arriving at that barrier
            record["peer_wait_ms_by_site"] = {site: by_site[:, i].tolist() for i, site in enumerate(WAIT_SITES)}
            # the EP rank that waited most: the other ranks were behind it this step
            record["peer_wait_most_rank"] = _argmax(waits)
        if gc_paused is not None:
            record["host_gc_ms"] = [v / 1e6 for v in gc_paused.tolist()]
        self.metrics.append(record)
        self.window.append(record["loss"])
        if step % recipe.run.log_every == 0 or step == self.first_step or step == self.last_step:
            imb, gn = record.get("load_imbalance"), record["grad_norm"]
            pacing = ""  # what set the pace between the EP ranks this step
            if "ep_rank_imbalance" in record:
                busiest = _argmax(record["ep_rank_load"])
                pacing = f" | EP rank rows max/mean {record['ep_rank_imbalance']:.3f} (rank {busiest} most)"
            if "peer_wait_ms" in record:
                most = record["peer_wait_most_rank"]
                sites = record["peer_wait_ms_by_site"]
                where = max(sites, key=lambda site: sites[site][most])
                pacing += f" | peer wait {record['peer_wait_ms'][most]:.1f} ms on EP rank {most} (most at {where})"
            gc_ms = record.get("host_gc_ms") or [0.0]
            if max(gc_ms) >= 0.05:  # a collection ran on some rank's host this step
                slowest = _argmax(gc_ms)
                pacing += f" | host GC {gc_ms[slowest]:.1f} ms on EP rank {slowest}"
            avg = (
                f" (mean of {len(self.window)}: {sum(self.window) / len(self.window):.4f})"
                if len(self.window) > 1
                else ""
            )
            self.window.clear()
            print(
                f"step {step:5d}/{recipe.train.steps} | loss {record['loss']:.4f}{avg} | {tokens_per_s:7.0f} tok/s | "
                f"{self._mfu_text(record['mfu'])}load max/mean {imb if imb is None else format(imb, '.2f')}"
                f"{'' if imb is None else ' (worst layer ' + format(record['load_imbalance_worst_layer'], '.2f') + ')'}"
                f"{pacing} | "
                f"lr {lr:.2e} | grad norm {gn if gn is None else format(gn, '.3f')}",
                flush=True,
            )
        if recipe.run.plot_every and step % recipe.run.plot_every == 0:
            self.plot()

    def mfu(self, tokens_per_s: float) -> float | None:
        from .flops import mfu

        return None if self.peak_tflops is None else mfu(self.recipe, tokens_per_s, self.peak_tflops)

    @staticmethod
    def _mfu_text(value: float | None, before: str = "", end: str = " | ") -> str:
        """'MFU 12.3%' between `before` and `end`; nothing where no peak is known."""
        return "" if value is None else f"{before}MFU {100 * value:.1f}%{end}"

    def plot(self):
        plot_progress(self.metrics.records, self.plot_path, self.title)

    def finish(self, summary: dict, start_step: int, last: int, run_start: float):
        """The final plot and closing lines of an invocation that ran steps start_step+1..last
        from time.perf_counter() run_start."""
        records = self.metrics.records
        if not records:
            return
        self.plot()
        wall = time.perf_counter() - run_start
        recipe, mfu = self.recipe, self.mfu
        tps = summary["tokens_per_s"]
        # the first steps carry compilation and allocator warm-up: give the steady rate beside the mean
        # (this invocation's steps: after a resume the records also hold the earlier invocations')
        ran = [r for r in records if r["step"] > start_step]
        warm = min(5, len(ran) // 4)
        steady = statistics.median(r["tokens_per_s"] for r in ran[warm:])
        print(
            f"[megamoe-train] {'done' if last == recipe.train.steps else 'stopped (train.stop_at)'}: "
            f"steps {start_step + 1}..{last} in {wall:.1f} s "
            f"({tps:.0f} tok/s{self._mfu_text(mfu(tps), before=', ', end='')} over the steps; "
            f"median after the first {warm}: {steady:.0f} tok/s{self._mfu_text(mfu(steady), before=', ', end='')}) | "
            f"loss {records[0]['loss']:.4f} (step {records[0]['step']}) -> "
            f"{records[-1]['loss']:.4f} (step {records[-1]['step']}) | "
            f"metrics {self.metrics.path} | plot {self.plot_path}",
            flush=True,
        )
        if summary["peak_memory_gib"]:
            print(
                "[megamoe-train] peak memory per GPU (GiB, allocated): "
                f"{', '.join(f'{x:.1f}' for x in summary['peak_memory_gib'])}",
                flush=True,
            )


def write_summary(device: str, tokens: int, seconds: float, profiler, run_dir: str) -> dict:
    """RUN/summary.json (written by rank 0): tokens/s over this invocation's steps, peak memory of
    every GPU, the step profile of every rank. Collective."""
    import torch
    import torch.distributed as dist

    local = {
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "profile": profiler.summary if profiler is not None else None,
    }
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    summary = {
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "peak_memory_gib": [p["peak_memory_gib"] for p in parts] if device == "cuda" else None,
        "profile": [p["profile"] for p in parts] if profiler is not None else None,
    }
    if dist.get_rank() == 0:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return summary


_WARNED = False


def plot_progress(records: list[dict], path: str, title: str = ""):
    """progress.png: loss curve (+ lr), imbalance, and a heatmap of every expert's share of the
    routed rows per step (summed over MoE layers; 1.0 = perfectly balanced)."""
    try:
        import matplotlib
    except ImportError:  # plotting is optional: metrics.jsonl has everything
        global _WARNED
        if not _WARNED:
            print("[megamoe-train] matplotlib is not installed: no progress.png", flush=True)
            _WARNED = True
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    recs = [r for r in records if "loss" in r]
    if not recs:
        return
    steps = np.array([r["step"] for r in recs])
    fig, axes = plt.subplots(3, 1, figsize=(9, 10), height_ratios=[2, 1, 2], constrained_layout=True)
    ax = axes[0]
    loss = np.array([r["loss"] for r in recs])
    ax.plot(steps, loss, color="tab:blue", lw=0.6, alpha=0.45, label="loss")
    if len(loss) >= 10:  # trailing mean over ~5% of the run
        w = max(5, len(loss) // 20)
        smooth = np.convolve(loss, np.ones(w) / w, mode="valid")
        ax.plot(steps[w - 1 :], smooth, color="tab:blue", lw=1.6, label=f"mean of {w}")
    ax.legend(loc="upper right")
    ax.set_ylabel("loss (nats/token)")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(steps, [r["lr"] for r in recs], color="tab:gray", lw=0.8, ls="--", label="lr")
    ax2.set_ylabel("lr", color="tab:gray")
    ax.set_title(title or "training progress")

    ax = axes[1]
    ax.plot(steps, [r.get("load_imbalance", float("nan")) for r in recs], color="tab:red", lw=1)
    ax.set_ylabel("expert load max/mean")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)

    ax = axes[2]
    loads = [r.get("expert_load") for r in recs]
    if all(l is not None and len(l) for l in loads):
        mat = np.array([np.asarray(l, dtype=float).sum(0) for l in loads])  # [steps, E]
        mean = mat.mean(1, keepdims=True)
        share = np.divide(mat, mean, out=np.zeros_like(mat), where=mean > 0)
        im = ax.imshow(
            share.T,
            aspect="auto",
            origin="lower",
            cmap="viridis",
            interpolation="nearest",
            extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, mat.shape[1] - 0.5),
        )
        fig.colorbar(im, ax=ax, label="rows / mean rows")
        ax.set_ylabel("expert (global id)")
        ax.set_xlabel("step")
        ax.set_title("expert load per step (all MoE layers)")
    else:
        ax.set_axis_off()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
