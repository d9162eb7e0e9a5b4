"""`megamoe-train RECIPE.yaml` (also `python -m megamoe_trainer RECIPE.yaml`): train a
Megatron-core GPT with MegaMoE layers from a recipe.

The recipe is read and checked before any rank starts; a bad one exits with status 2 and a
one-line message naming the key. Then the CLI locks the run dir (run_lock: a second invocation
on it exits 2), decides where the run starts (`_start_point`: the latest checkpoint that
verifies; a run dir holding checkpoints or metrics is never started over without --no-resume)
and starts the ranks itself (supervisor): on CPU, gloo processes (`parallel.world_size` of
them); on GPU, one NCCL process per GPU. Under torchrun (RANK / WORLD_SIZE / MASTER_ADDR set) it
runs as that one rank instead.

Outputs in the run dir: recipe.yaml (as run), metrics.jsonl, progress.png, checkpoints/, run.lock.

This module imports megatron-core only inside functions, after `quiet()`: megatron-core warns
at import time when Transformer Engine / Apex / absl are absent (CPU machines), in this process
and in every rank it starts. MEGAMOE_VERBOSE=1 keeps the chatter.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import warnings

import yaml

from .recipe import Recipe, RecipeError, check_environment, load_recipe

EXIT_BAD_RECIPE = 2  # also: a run dir in use, or with nothing this invocation may start from

# Prefixes of messages megatron-core warns with at import time when TE / Apex / absl are absent.
_QUIET = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "absl.logging is not installed",
    "MimoModelConfig is experimental",
    "full scope is deprecated",
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    # torch.distributed.checkpoint, as megatron-core's dist_checkpointing drives it
    "torch.distributed is disabled",
    "The argument order of load has been changed",
    "Please use DTensor instead",
)


def quiet():
    """Silence megatron-core's import-time and per-step chatter (call before importing megatron)."""
    if os.environ.get("MEGAMOE_VERBOSE") == "1":
        return
    for prefix in _QUIET:
        warnings.filterwarnings("ignore", message=prefix)
    # child processes (ranks, checkpoint writers) read this at start-up
    extra = ",".join(f"ignore:{p}" for p in _QUIET)
    current = os.environ.get("PYTHONWARNINGS")
    if not current or extra not in current:
        os.environ["PYTHONWARNINGS"] = f"{current},{extra}" if current else extra
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # megatron-core's own loggers: deprecation notices, and "CPU RNG state changed within GPU RNG
    # context" on every RNG fork on CPU (there the "CUDA" RNG state is the CPU one, by design)
    logging.getLogger("megatron").setLevel(logging.ERROR)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megamoe-train",
        description="Train a Megatron-core GPT whose MoE layers run through MegaMoE, from a YAML recipe.",
        epilog="Example: megamoe-train recipes/tiny_moe_cpu.yaml --steps 20 --run-dir /tmp/run1",
    )
    p.add_argument("recipe", help="recipe YAML file (see recipes/)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a recipe key, value read as YAML (repeatable), e.g. --set train.lr=3e-4",
    )
    p.add_argument("--steps", type=int, help="same as --set train.steps=N")
    p.add_argument(
        "--stop-at",
        type=int,
        metavar="STEP",
        help="same as --set train.stop_at=STEP: end this invocation after STEP (checkpointed); "
        "the LR schedule still runs to train.steps",
    )
    p.add_argument("--run-dir", help="same as --set run.dir=DIR")
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--resume",
        dest="resume",
        action="store_const",
        const=True,
        help="continue from the run dir's latest checkpoint that verifies (error if there is none); "
        "the default (run.resume: auto) also starts a run dir that holds nothing yet",
    )
    g.add_argument(
        "--no-resume",
        dest="resume",
        action="store_const",
        const=False,
        help="start from scratch: removes the run dir's checkpoints, metrics, plot and summary (and says so)",
    )
    p.add_argument("--check", action="store_true", help="validate the recipe, print it resolved, and exit")
    return p


def _fail(message: str, code: int) -> int:
    print(f"megamoe-train: error: {message}", file=sys.stderr, flush=True)
    return code


def _rank_main(rank: int, world: int, recipe_dict: dict, run_dir: str, resume_from: str | None):
    """Train on this rank (process group initialized), then release the MegaMoE buffers and the group."""
    from megamoe_train.launch import finish_rank

    from .train import run_rank

    run_rank(rank, world, recipe_dict, run_dir, resume_from)
    # Not in a `finally`: finish_rank is collective (the MegaMoE buffers' release barrier), and a
    # rank that raised leaves its peers blocked in a collective it will never join; the launcher
    # ends them (supervisor.run_ranks).
    finish_rank()


def rank_entry(
    rank: int, world: int, port: int, backend: str, recipe_dict: dict, run_dir: str, resume_from: str | None
):
    """One rank, started by supervisor.run_ranks (imports megatron only after quiet())."""
    quiet()
    from megamoe_train.launch import exit_finished_rank, init_rank, place_rank

    init_rank(rank, world, port, backend)
    place_rank(rank, world, backend, recipe_dict["parallel"]["pin_cpus"])
    _rank_main(rank, world, recipe_dict, run_dir, resume_from)
    exit_finished_rank()  # outputs are written; no interpreter teardown (launch.exit_finished_rank)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _start_over(run_dir: str, why: str):
    """Remove what an earlier run left in run_dir (checkpoints, metrics, plot, summary,
    profile), saying what."""
    from .checkpoint import checkpoint_root, step_dirs
    from .report import read_metrics

    removed = []
    root = checkpoint_root(run_dir)
    if os.path.exists(root):
        names = [os.path.basename(d) for d in step_dirs(run_dir)]
        shutil.rmtree(root)
        removed.append(f"checkpoints/ ({', '.join(names) or 'no checkpoint'})")
    for name in ("metrics.jsonl", "summary.json", "progress.png", "profile"):
        path = os.path.join(run_dir, name)
        if not os.path.exists(path):
            continue
        if name == "metrics.jsonl":
            records = read_metrics(path)
            removed.append(f"metrics.jsonl ({len(records)} steps)")
        else:
            removed.append(name + ("/" if os.path.isdir(path) else ""))
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    if removed:
        print(f"[megamoe-train] starting over in {run_dir} ({why}): removed {', '.join(removed)}", flush=True)


def _start_point(recipe: Recipe, run_dir: str, resume) -> str | None:
    """The checkpoint this invocation continues from (verified), or None to start at step 1
    (with resume false, after removing the earlier run's outputs). A run dir holding
    checkpoints or metrics is never started over silently: RecipeError instead."""
    from .checkpoint import CheckpointProblem, NoUsableCheckpoint, check_optimizer_format, find_resume_checkpoint
    from .report import read_metrics

    if resume is False:
        _start_over(run_dir, "--no-resume" if recipe.run.resume is not False else "run.resume: false")
        return None
    try:
        found = find_resume_checkpoint(run_dir)
    except NoUsableCheckpoint as e:
        raise RecipeError("run.resume", str(e)) from None
    if found is None:
        if resume is True:
            raise RecipeError("run.resume", f"no checkpoint to resume from in {run_dir}/checkpoints")
        steps = [r["step"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))]
        if steps:
            raise RecipeError(
                "run.resume",
                f"{run_dir} holds metrics.jsonl of steps {min(steps)}..{max(steps)} but no checkpoint to resume "
                "from: start over with --no-resume (it removes them), or use another run.dir",
            )
        return None
    path, meta = found
    if meta.get("world_size") != recipe.parallel.world_size:
        raise RecipeError(
            "parallel.world_size",
            f"{recipe.parallel.world_size}, but the checkpoint in {run_dir} was written by "
            f"{meta.get('world_size')} ranks (use another run.dir, or --no-resume)",
        )
    try:
        check_optimizer_format(meta, recipe.train.use_distributed_optimizer)
    except CheckpointProblem as e:
        raise RecipeError("train.use_distributed_optimizer", f"the checkpoint in {run_dir}: {e}") from None
    return path


def _write_recipe(recipe: Recipe, run_dir: str):
    with open(os.path.join(run_dir, "recipe.yaml"), "w") as f:
        yaml.safe_dump(recipe.to_dict(), f, sort_keys=False)


def _launch(recipe: Recipe, device: str, run_dir: str, resume) -> int:
    """Take the run dir's lock, decide where to start, and run the ranks under supervision."""
    from megamoe_train.launch import free_port

    from .run_lock import RunDirBusy, RunDirLock
    from .supervisor import run_ranks

    world = recipe.parallel.world_size
    backend = "nccl" if device == "cuda" else "gloo"
    try:
        lock = RunDirLock(run_dir).acquire()
    except RunDirBusy as e:
        return _fail(str(e), EXIT_BAD_RECIPE)
    try:
        try:
            resume_from = _start_point(recipe, run_dir, resume)
        except RecipeError as e:
            return _fail(str(e), EXIT_BAD_RECIPE)
        _write_recipe(recipe, run_dir)
        args = (world, free_port(), backend, recipe.to_dict(), run_dir, resume_from)
        end = run_ranks(rank_entry, world, args, lock_fd=lock.fd)
        return _fail(end.message, end.code) if end.message else end.code
    except KeyboardInterrupt:  # before the ranks start (run_ranks handles its own signals)
        return _fail("interrupted", 130)
    finally:
        lock.release()


def _torchrun_rank(recipe: Recipe, device: str, run_dir: str, resume) -> int:
    """This process is one rank of a torchrun job: rank 0 takes the lock and decides where to
    start, for every rank."""
    import torch
    import torch.distributed as dist

    from .run_lock import RunDirBusy, RunDirLock

    world = recipe.parallel.world_size
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if size != world:
        return _fail(f"parallel.world_size: {world}, but the launcher started {size} ranks", EXIT_BAD_RECIPE)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    lock, plan = None, [None]
    try:
        if rank == 0:
            try:
                lock = RunDirLock(run_dir).acquire()
                plan[0] = ("start", _start_point(recipe, run_dir, resume))
                _write_recipe(recipe, run_dir)
            except (RunDirBusy, RecipeError) as e:
                plan[0] = ("error", str(e))
        dist.broadcast_object_list(plan, src=0)
        kind, value = plan[0]
        if kind == "error":
            return _fail(value, EXIT_BAD_RECIPE) if rank == 0 else EXIT_BAD_RECIPE
        _rank_main(rank, world, recipe.to_dict(), run_dir, value)
        return 0
    finally:
        if lock is not None:
            lock.release()


def main(argv: list[str] | None = None) -> int:
    quiet()
    args = _parser().parse_args(argv)
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.stop_at is not None:
        overrides.append(f"train.stop_at={args.stop_at}")
    if (
        args.run_dir is not None
    ):  # a path, taken as written (quoted: YAML would read 123, yes, "a #b", "a: b" otherwise)
        overrides.append(f"run.dir={json.dumps(args.run_dir)}")
    try:
        recipe = load_recipe(args.recipe, overrides)
        if args.check:
            print(yaml.safe_dump(recipe.to_dict(), sort_keys=False), end="")
            print(f"megamoe-train: {args.recipe} is valid", file=sys.stderr)
            return 0
        device = check_environment(recipe)
    except RecipeError as e:
        return _fail(str(e), EXIT_BAD_RECIPE)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    run_dir = os.path.abspath(recipe.run.dir)
    resume = recipe.run.resume if args.resume is None else args.resume
    if _under_torchrun():
        return _torchrun_rank(recipe, device, run_dir, resume)
    return _launch(recipe, device, run_dir, resume)


if __name__ == "__main__":
    raise SystemExit(main())
