"""Training throughput of one recipe, end to end: MegaMoE bf16, MegaMoE fp8 and Megatron's stock
MoE layer (alltoall dispatcher + SequentialMLP), same recipe, seed and data, in one run.

    python benchmarks/bench_train.py RECIPE.yaml [--steps 40] [--variants bf16,fp8,stock,bf16-eager,fp8-eager]
        [--profile-steps 3] [--out DIR] [--set SECTION.KEY=VALUE ...] [--tree LABEL=DIR ...] [--repeat N]
        [--reference stock] [--loss-tail 20] [--with EARLIER/bench_train.json ...]

A/B of two code versions in one call: `git worktree add ../base HEAD~1` (plus the built
extensions copied in), then `--tree base=../base --repeat 2` runs every variant from this checkout
and from base, alternating, two rounds.

Each variant is a `megamoe-train` run (no checkpoints) in DIR/<variant>/. Reported per variant:
- tokens/s: median of the per-step global tokens/s after the warm-up steps, profiled steps and the
  one after them (it holds the trace export) excluded;
- MFU at that rate (FLOPs-per-token formula in docs/trainer.md; peak = run.peak_tflops or the GPU's
  entry in flops.PEAK_TFLOPS_BY_GPU; n/a where none is known, e.g. on CPU);
- GPU busy: union of kernel/copy intervals over wall time of `--profile-steps` steps under the torch
  profiler (rank 0; CUDA only), and the MoE layers' share of kernel time;
- peer wait: ms per step the MegaMoE barriers of the most-waiting rank stood still for their
  expert-parallel peers (the barriers' own device counter, SymmBuffer.peer_wait_ns: unprofiled
  steps, median over the timed steps), next to the experts' load max/mean: a step paced by a
  busier or host-late peer shows here, not in the kernels. (The profiled steps' barrier time
  overstates it: the profiler slows each rank's host unevenly, and a host-late peer then shows
  as a waiting GPU.) Below the table: per variant, in how many timed steps each EP rank was the
  most-waiting one (a rank that waits in nearly every step has a slower peer);
- host GC: ms per step the slowest rank's host spent in Python garbage collection (mean over the
  timed steps; with perf.manual_gc only the scheduled collections every perf.gc_every steps);
- peak memory per GPU (torch.cuda.max_memory_allocated, every rank);
- loss agreement with the reference variant (`--reference`, default stock): max relative
  difference of the per-step losses, and the signed relative difference of the mean of the last
  `--loss-tail` losses. `--with` adds the rows of an earlier run of the same recipe and steps
  (e.g. variants too long for one call), compared and plotted with this run's.
Prints a markdown table and writes DIR/bench_train.json and DIR/loss_curves.png. Runs on CPU too
(then no profile / memory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# name -> (moe.megamoe_recipe, extra recipe settings); "-graph": MoE layers replayed from CUDA graphs
# (the recipes' default on CUDA), "-eager": called eagerly;
# "-unfused": expert wgrads returned as .grad and added into main_grad by DDP's hook
_UNFUSED = "moe.megamoe_fuse_wgrad_accumulation=false"
VARIANTS = {
    "bf16": ("bf16", []),
    "fp8": ("fp8", []),
    "mxfp8_mxfp4": ("mxfp8_mxfp4", []),
    "bf16-unfused": ("bf16", [_UNFUSED]),
    "fp8-unfused": ("fp8", [_UNFUSED]),
    "bf16-eager": ("bf16", ["moe.megamoe_cuda_graph=false"]),
    "fp8-eager": ("fp8", ["moe.megamoe_cuda_graph=false"]),
    "bf16-graph": ("bf16", ["moe.megamoe_cuda_graph=true"]),
    "fp8-graph": ("fp8", ["moe.megamoe_cuda_graph=true"]),
    "bf16-graph-unfused": ("bf16", ["moe.megamoe_cuda_graph=true", _UNFUSED]),
    "stock": (None, ["perf.fused_router_topk=false"]),  # Megatron's MoE layer and router as they are
    # host-side A/Bs against "bf16": Python's GC run by hand, rank processes pinned to their GPU's
    # CPUs, both, and the router's top-k by kernel / by torch.topk
    "bf16-manual-gc": ("bf16", ["perf.manual_gc=true"]),
    "bf16-pinned": ("bf16", ["parallel.pin_cpus=true"]),
    "bf16-manual-gc-pinned": ("bf16", ["perf.manual_gc=true", "parallel.pin_cpus=true"]),
    "bf16-router-kernel": ("bf16", ["perf.fused_router_topk=true"]),
    "bf16-router-torch": ("bf16", ["perf.fused_router_topk=false"]),
    # the dense layers' wgrads into main_grad by their GEMM (megamoe_trainer.perf.dense_wgrad)
    "bf16-dense-fusion": ("bf16", ["perf.dense_wgrad_fusion=true"]),
    "fp8-dense-fusion": ("fp8", ["perf.dense_wgrad_fusion=true"]),
    # DDP all-reduces the data-parallel gradient buckets during the last micro-batch's backward
    "bf16-overlap-grad": ("bf16", ["train.overlap_grad_reduce=true"]),
    "fp8-overlap-grad": ("fp8", ["train.overlap_grad_reduce=true"]),
    # torch's fused AdamW and megatron's main -> model copy instead of the AdamW kernel that writes
    # the bf16 params (megamoe_trainer/perf/adam_kernel.py)
    "bf16-torch-adam": ("bf16", ["perf.adam_writes_model_params=false"]),
    "fp8-torch-adam": ("fp8", ["perf.adam_writes_model_params=false"]),
    # the DeepSeek-V3 proxy's tokens per optimizer step in other micro-batch splits (the 2-GPU
    # recipes: 16 x 1 since a1edf4a, 4 x 4 before): every micro-batch reads and writes the
    # experts' fp32 main_grad once in its wgrads
    "bf16-mb4": ("bf16", ["train.micro_batch_size=4", "train.grad_accum_steps=4"]),
    "fp8-mb4": ("fp8", ["train.micro_batch_size=4", "train.grad_accum_steps=4"]),
    "bf16-mb8": ("bf16", ["train.micro_batch_size=8", "train.grad_accum_steps=2"]),
    "fp8-mb8": ("fp8", ["train.micro_batch_size=8", "train.grad_accum_steps=2"]),
    "bf16-mb16": ("bf16", ["train.micro_batch_size=16", "train.grad_accum_steps=1"]),
    "fp8-mb16": ("fp8", ["train.micro_batch_size=16", "train.grad_accum_steps=1"]),
    # DDP zeroes the experts' main_grad every step and the first micro-batch's wgrads add into it,
    # instead of writing over it (megatron_patch.grad_buffers)
    "bf16-zeroed-main-grad": ("bf16", ["moe.megamoe_overwrite_main_grad=false"]),
    "fp8-zeroed-main-grad": ("fp8", ["moe.megamoe_overwrite_main_grad=false"]),
    # AdamW's moments kept in bf16 by the AdamW kernel (DeepSeek-V3's recipe; 22 instead of 30
    # bytes per parameter per step)
    "bf16-bf16-moments": ("bf16", ["train.adam_moments_dtype=bf16"]),
    "fp8-bf16-moments": ("fp8", ["train.adam_moments_dtype=bf16"]),
}


def _records(run_dir: str) -> list[dict]:
    from megamoe_trainer.report import read_metrics

    return read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def run_variant(
    recipe_path: str,
    name: str,
    steps: int,
    out: str,
    overrides: list[str],
    profile_at: int | None,
    profile_steps: int,
    label: str | None = None,
    tree: str | None = None,
) -> dict:
    """One megamoe-train run of variant `name`, reported as `label` (default the name); with `tree`
    the trainer of that checkout runs it (a subprocess with the tree first on PYTHONPATH)."""
    from megamoe_trainer.cli import main as train

    label = label or name
    run_dir = os.path.abspath(os.path.join(out, label))
    args = [
        os.path.abspath(recipe_path),
        "--steps",
        str(steps),
        "--no-resume",
        "--run-dir",
        run_dir,
        "--set",
        f"moe.megamoe_recipe={'null' if VARIANTS[name][0] is None else VARIANTS[name][0]}",
        "--set",
        "run.checkpoint=false",
        "--set",
        "run.plot_every=0",
        "--set",
        f"run.log_every={max(1, steps // 10)}",
        "--set",
        f"train.steps={steps}",
    ]
    if profile_at is not None:
        args += ["--set", f"run.profile_at={profile_at}", "--set", f"run.profile_steps={profile_steps}"]
    for o in VARIANTS[name][1] + overrides:
        args += ["--set", o]
    start = time.perf_counter()
    if tree is None:
        code = train(args)
    else:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p))
        code = subprocess.run([sys.executable, "-m", "megamoe_trainer", *args], cwd=tree, env=env).returncode
    if code != 0:
        return {"variant": label, "error": f"megamoe-train exited with {code}"}
    records = _records(run_dir)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    return {"variant": label, "records": records, "summary": summary, "wall_s": time.perf_counter() - start}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def analyze(result: dict, warmup: int, untimed: set[int]) -> dict:
    """untimed: steps left out of the rates besides the warm-up (the profiled ones and the next)."""
    if "error" in result:
        return result
    recs = result["records"]
    timed = [r for r in recs if r["step"] > warmup and r["step"] not in untimed] or recs
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    mfu = _median([r.get("mfu") for r in timed])  # None where no peak is known (CPU)
    prof = (result["summary"].get("profile") or [None])[0]
    row = {
        "variant": result["variant"],
        "steps": len(recs),
        "tokens_per_s": tps,
        "mfu": mfu,
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "gpu_busy_fraction": prof and prof["busy_fraction"],
        "moe_share_of_kernel_time": prof and prof["moe_share"],
        # the most-waiting rank's MegaMoE barriers standing still for their peers, unprofiled steps
        "peer_wait_ms_per_step": _median([max(r["peer_wait_ms"]) if r.get("peer_wait_ms") else None for r in timed]),
        # per EP rank, the timed steps in which it waited most (the others were behind it): a rank
        # that waits in nearly every step has a slower peer, host or GPU
        "most_waiting_rank_steps": _most_waiting(timed),
        # per barrier site, each EP rank's mean wait over the timed steps: where the peers were late
        "peer_wait_ms_by_site": _mean_by_site(timed),
        # the slowest rank's host in Python garbage collection, mean over the timed steps (pauses
        # are rare and long, so a median would hide them)
        "host_gc_ms_per_step": _mean([max(r["host_gc_ms"]) if r.get("host_gc_ms") else None for r in timed]),
        # experts' load max/mean (median over the timed steps): what the peers wait for
        "expert_load_imbalance": _median([r.get("load_imbalance") for r in timed]),
        # the EP ranks' routed rows, busiest over mean per layer (summed over layers): the share of a
        # step the others wait at the barriers when the GPUs pace it
        "ep_rank_load_imbalance": _median([r.get("ep_rank_imbalance") for r in timed]),
        "profile_rank0": prof,
        "peak_memory_gib": result["summary"].get("peak_memory_gib"),
        "losses": [r["loss"] for r in recs],
        "wall_s": result["wall_s"],
    }
    return row


def loss_agreement(rows: list[dict], reference: str, tail: int) -> None:
    """Each row's losses against the reference row's, step by step: the largest relative
    difference, and the signed relative difference of the mean of the last `tail` losses (what
    a precision recipe must keep small). Rows without losses, or no reference row, get none."""
    for r in rows:  # an earlier run's rows (--with) carry its own comparison
        for key in ("loss_reference", "loss_max_rel_diff", "loss_tail_mean_rel_diff"):
            r.pop(key, None)
    ref = next((r for r in rows if r.get("variant") == reference and r.get("losses")), None)
    for r in rows:
        if ref is None or r is ref or not r.get("losses"):
            continue
        mine, theirs = r["losses"], ref["losses"]
        n = min(len(mine), len(theirs))
        t = min(tail, n)
        r["loss_reference"] = reference
        r["loss_max_rel_diff"] = max(_rel(a, b) for a, b in zip(mine[:n], theirs[:n]))
        mean_mine, mean_ref = sum(mine[n - t : n]) / t, sum(theirs[n - t : n]) / t
        r["loss_tail_mean_rel_diff"] = (mean_mine - mean_ref) / max(abs(mean_ref), 1e-12)


def _most_waiting(records) -> dict[int, int] | None:
    counts: dict[int, int] = {}
    for r in records:
        if "peer_wait_most_rank" in r:  # the trainer's report names it per step
            counts[r["peer_wait_most_rank"]] = counts.get(r["peer_wait_most_rank"], 0) + 1
    return dict(sorted(counts.items())) or None


def _mean_by_site(records) -> dict[str, list[float]] | None:
    rows = [r["peer_wait_ms_by_site"] for r in records if r.get("peer_wait_ms_by_site")]
    if not rows:
        return None
    return {site: [sum(r[site][k] for r in rows) / len(rows) for k in range(len(rows[0][site]))] for site in rows[0]}


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(x, spec, scale=1.0, none="n/a"):
    return none if x is None else format(x * scale, spec)


def markdown(rows: list[dict], recipe: str, steps: int, reference: str = "stock", tail: int = 20) -> str:
    lines = [
        f"`{os.path.basename(recipe)}`, {steps} steps per variant",
        "",
        "| variant | tokens/s | MFU | step ms | GPU busy | MoE share of kernel time | peer wait ms/step | "
        "host GC ms/step | "
        f"expert load max/mean | EP rank rows max/mean | peak mem per GPU (GiB) | loss max rel diff vs {reference} | "
        f"last-{tail} mean loss | "
        f"its rel diff vs {reference} |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['error']} | | | | | | | | | | | | |")
            continue
        last = r["losses"][-tail:]
        mem = r["peak_memory_gib"]
        lines.append(
            f"| {r['variant']} | {r['tokens_per_s']:.0f} | {_fmt(r['mfu'], '.1%')} | {r['step_time_s'] * 1e3:.0f} | "
            f"{_fmt(r['gpu_busy_fraction'], '.0%')} | {_fmt(r['moe_share_of_kernel_time'], '.0%')} | "
            f"{_fmt(r['peer_wait_ms_per_step'], '.1f')} | {_fmt(r.get('host_gc_ms_per_step'), '.1f')} | "
            f"{_fmt(r['expert_load_imbalance'], '.2f')} | {_fmt(r.get('ep_rank_load_imbalance'), '.3f')} | "
            f"{'n/a' if not mem else ', '.join(f'{m:.1f}' for m in mem)} | "
            f"{_fmt(r.get('loss_max_rel_diff'), '.2%', none='-')} | "
            f"{sum(last) / len(last):.4f} | {_fmt(r.get('loss_tail_mean_rel_diff'), '+.2%', none='-')} |"
        )
    for r in rows:  # where the profiled steps' kernel time went, inside and outside the MoE layers
        prof = r.get("profile_rank0") or {}
        first_last = prof.get("steps") or [0, 0]  # the profiled steps' first and last
        steps = first_last[1] - first_last[0] + 1
        for key, what in (("top_moe_kernels", "inside"), ("top_other_kernels", "outside")):
            if prof.get(key):
                lines += ["", f"{r['variant']}: largest kernels {what} the MoE layers, rank 0, ms per profiled step:"]
                lines += [f"- {k['s'] * 1e3 / steps:.1f} {k['name']}" for k in prof[key][:10]]
    for r in rows:
        sites = r.get("peer_wait_ms_by_site")
        if sites:
            lines += [
                "",
                f"{r['variant']}: peer wait by barrier, ms per timed step (EP rank 0, 1, ...): "
                + "; ".join(f"{site} " + " / ".join(f"{v:.1f}" for v in per_rank) for site, per_rank in sites.items()),
            ]
    waiting = [
        f"{r['variant']}: " + ", ".join(f"rank {k} in {v}" for k, v in r["most_waiting_rank_steps"].items())
        for r in rows
        if r.get("most_waiting_rank_steps")
    ]
    if waiting:
        lines += ["", "Most-waiting EP rank (timed steps): " + "; ".join(waiting)]
    return "\n".join(lines)


def plot_losses(rows: list[dict], path: str, title: str) -> str | None:
    """Loss per step of every variant on one axis, and each variant's running mean relative to the
    first variant's (the agreement a precision change must keep). None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in rows if r.get("losses")]
    if not rows:
        return None
    fig, (ax, rel) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(2, 1))
    window = 20

    def smooth(v):
        return [sum(v[max(0, i - window + 1) : i + 1]) / len(v[max(0, i - window + 1) : i + 1]) for i in range(len(v))]

    base = smooth(rows[0]["losses"])
    for r in rows:
        steps = range(1, len(r["losses"]) + 1)
        ax.plot(steps, r["losses"], lw=0.6, alpha=0.8, label=r["variant"])
        mean = smooth(r["losses"])
        rel.plot(steps, [100 * (m - b) / b for m, b in zip(mean, base)], lw=1, label=r["variant"])
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    rel.set_ylabel(f"mean of {window} vs {rows[0]['variant']} (%)")
    rel.set_xlabel("step")
    rel.axhline(0, color="grey", lw=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--variants", default="bf16,fp8,stock", help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of tokens/s (default: min(5, steps // 4))")
    p.add_argument("--profile-steps", type=int, default=3, help="steps under the torch profiler (CUDA; 0 = none)")
    p.add_argument("--out", default="runs/bench_train")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument(
        "--tree",
        dest="trees",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="also run every variant with another checkout's code (rows 'VARIANT@LABEL'), e.g. a git "
        "worktree of the parent commit; its compiled extensions must be in place (copy them "
        "where only Python differs)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the list this many times, alternating variants and trees (rows '#k'): machine "
        "drift then falls on every variant alike",
    )
    p.add_argument("--reference", default="stock", help="the variant every other's losses are compared with")
    p.add_argument("--loss-tail", type=int, default=20, help="the last steps whose mean loss is compared")
    p.add_argument(
        "--with",
        dest="merged",
        action="append",
        default=[],
        metavar="JSON",
        help="also report the rows of an earlier bench_train.json of the same recipe and steps (its "
        "losses compared and plotted with this run's)",
    )
    args = p.parse_args(argv)
    from megamoe_trainer.cli import quiet

    quiet()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    merged = []  # rows of earlier runs of the same recipe and steps, e.g. from another call: checked first
    for path in args.merged:
        with open(path) as f:
            merged.append(json.load(f))
        if merged[-1]["steps"] != args.steps or os.path.basename(merged[-1]["recipe"]) != os.path.basename(args.recipe):
            p.error(f"--with {path}: {merged[-1]['recipe']} at {merged[-1]['steps']} steps, not this run's")
    warmup = min(5, args.steps // 4) if args.warmup is None else args.warmup
    profile_at = None
    if args.profile_steps > 0 and args.steps >= warmup + args.profile_steps + 1:
        profile_at = max(warmup + 1, args.steps - args.profile_steps - 2)
    profiled = set(range(profile_at, profile_at + args.profile_steps)) if profile_at else set()
    # the step after them is left out too: its time (GPU events from the previous step's end) holds
    # the profiler's trace export, which ran on the host while the GPU idled
    untimed = profiled | {profile_at + args.profile_steps} if profile_at else set()
    os.makedirs(args.out, exist_ok=True)

    trees = [(None, None)]
    for spec in args.trees:
        label, sep, tree = spec.partition("=")
        if not sep or not label or not os.path.isdir(os.path.join(tree, "megamoe_trainer")):
            p.error(f"--tree {spec!r}: expected LABEL=DIR, DIR a checkout of this repository")
        trees.append((label, os.path.abspath(tree)))
    runs = []  # (row label, variant, tree): each repetition runs every variant from every tree in turn
    for rep in range(args.repeat):
        for n in names:
            for label, tree in trees:
                key = n if label is None else f"{n}@{label}"
                runs.append((key if args.repeat == 1 else f"{key}#{rep + 1}", n, tree))
    results = {
        key: run_variant(
            args.recipe, n, args.steps, args.out, args.overrides, profile_at, args.profile_steps, key, tree
        )
        for key, n, tree in runs
    }
    # each row keeps its own overrides, so a later call's --with knows how every row ran
    rows = [analyze(results[key], warmup, untimed) | {"overrides": args.overrides} for key, n, _ in runs]
    notes = []  # what differs in the earlier runs' rows
    for path, earlier in zip(args.merged, merged):
        for r in earlier["rows"]:
            if r.get("error"):  # nothing to compare: say so instead of a row
                notes.append(f"{r['variant']} of {path} left out: {r['error']}")
                continue
            if r["variant"] in results:  # a variant run again here keeps both rows
                r = r | {"variant": f"{r['variant']} (earlier)"}
            # a row's own overrides (it may have joined that file by --with itself), else its file's
            r = r | {"overrides": r.get("overrides", earlier.get("overrides", []))}
            if r["overrides"] != args.overrides:  # e.g. another micro-batch split of the step
                notes.append(f"{r['variant']} ran with --set {' '.join(r['overrides']) or '(none)'} ({path})")
            rows.append(r)
    reference = args.reference if args.repeat == 1 else f"{args.reference}#1"
    loss_agreement(rows, reference, args.loss_tail)
    table = markdown(rows, args.recipe, args.steps, reference, args.loss_tail)
    if notes:
        table += "\n" + "".join(f"- {n}\n" for n in notes)
    print(table, flush=True)
    out = {
        "recipe": args.recipe,
        "steps": args.steps,
        "warmup": warmup,
        "profiled_steps": sorted(profiled),
        "untimed_steps": sorted(untimed),
        "overrides": args.overrides,
        "rows": rows,
        "table": table,
    }
    with open(os.path.join(args.out, "bench_train.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"[bench_train] wrote {os.path.join(args.out, 'bench_train.json')}", flush=True)
    plotted = sorted(rows, key=lambda r: r.get("variant") != reference)  # the reference first: the others vs it
    plot = plot_losses(
        plotted, os.path.join(args.out, "loss_curves.png"), f"{os.path.basename(args.recipe)}, {args.steps} steps"
    )
    if plot:
        print(f"[bench_train] wrote {plot}", flush=True)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
