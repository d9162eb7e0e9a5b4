"""`megamoe-train RECIPE.yaml` (also `python -m megamoe_trainer RECIPE.yaml`): train a
Megatron-core GPT with MegaMoE layers from a recipe.

The recipe is read and checked before any rank starts; a bad one exits with status 2 and a
one-line message naming the key. Then the CLI starts the ranks itself: on CPU, gloo processes
(`parallel.world_size` of them); on GPU, one NCCL process per GPU. Under torchrun (RANK /
WORLD_SIZE / MASTER_ADDR set) it runs as that one rank instead.

Outputs in the run dir: recipe.yaml (as run), metrics.jsonl, progress.png, checkpoints/.

This module imports megatron-core only inside functions, after `quiet()`: megatron-core warns
at import time when Transformer Engine / Apex / absl are absent (CPU machines), in this process
and in every rank it starts. MEGAMOE_VERBOSE=1 keeps the chatter.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings

import yaml

from .recipe import Recipe, RecipeError, check_environment, load_recipe

EXIT_BAD_RECIPE = 2
EXIT_RANK_FAILED = 1

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
        help="continue from the run dir's latest checkpoint (error if there is none)",
    )
    g.add_argument(
        "--no-resume",
        dest="resume",
        action="store_const",
        const=False,
        help="start from scratch even if the run dir has a checkpoint",
    )
    p.add_argument("--check", action="store_true", help="validate the recipe, print it resolved, and exit")
    return p


def _fail(message: str, code: int) -> int:
    print(f"megamoe-train: error: {message}", file=sys.stderr, flush=True)
    return code


def _rank_main(rank: int, world: int, recipe_dict: dict, run_dir: str, resume: bool):
    """Train on this rank (process group initialized), then release the MegaMoE buffers and the group."""
    from megamoe_train.launch import finish_rank

    from .train import run_rank

    run_rank(rank, world, recipe_dict, run_dir, resume)
    # Not in a `finally`: finish_rank is collective (the MegaMoE buffers' release barrier), and a
    # rank that raised leaves its peers blocked in a collective it will never join; it would wait
    # out that barrier's timeout (300 s) before exiting, and the launcher ends the peers only then.
    finish_rank()


def rank_entry(rank: int, world: int, port: int, backend: str, recipe_dict: dict, run_dir: str, resume: bool):
    """torch.multiprocessing.spawn target: one rank (imports megatron only after quiet())."""
    quiet()
    from megamoe_train.launch import exit_finished_rank, init_rank, place_rank

    init_rank(rank, world, port, backend)
    place_rank(rank, world, backend, recipe_dict["parallel"]["pin_cpus"])
    _rank_main(rank, world, recipe_dict, run_dir, resume)
    exit_finished_rank()  # outputs are written; no interpreter teardown (launch.exit_finished_rank)


def _launch(recipe: Recipe, device: str, run_dir: str, resume: bool) -> int:
    import torch.multiprocessing as mp

    from megamoe_train.launch import free_port

    world = recipe.parallel.world_size
    backend = "nccl" if device == "cuda" else "gloo"
    recipe_dict = recipe.to_dict()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:  # torchrun
        import torch
        import torch.distributed as dist

        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if size != world:
            return _fail(f"parallel.world_size: {world}, but the launcher started {size} ranks", EXIT_BAD_RECIPE)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group(backend)
        _rank_main(rank, world, recipe_dict, run_dir, resume)
        return 0
    try:
        mp.spawn(rank_entry, args=(world, free_port(), backend, recipe_dict, run_dir, resume), nprocs=world, join=True)
    except mp.ProcessRaisedException as e:
        text = str(e).rstrip()
        print(text, file=sys.stderr)
        last = text.splitlines()[-1] if text else "unknown error"
        return _fail(f"rank {e.error_index} failed: {last}", EXIT_RANK_FAILED)
    except mp.ProcessExitedException as e:
        return _fail(f"rank {e.error_index} exited with code {e.exit_code}", EXIT_RANK_FAILED)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    return 0


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
        run_dir = os.path.abspath(recipe.run.dir)
        from .checkpoint import LATEST, checkpoint_root, latest_checkpoint, read_meta

        resume = recipe.run.resume if args.resume is None else args.resume
        latest = latest_checkpoint(run_dir)
        if resume is True and latest is None:
            raise RecipeError("run.resume", f"no checkpoint to resume from in {run_dir}/checkpoints")
        resume = bool(resume) and latest is not None  # "auto": resume when there is one
        if resume:
            saved_world = read_meta(latest).get("world_size")
            if saved_world != recipe.parallel.world_size:
                raise RecipeError(
                    "parallel.world_size",
                    f"{recipe.parallel.world_size}, but the checkpoint in {run_dir} was written by "
                    f"{saved_world} ranks (use another run.dir, or --no-resume)",
                )
    except RecipeError as e:
        return _fail(str(e), EXIT_BAD_RECIPE)
    os.makedirs(run_dir, exist_ok=True)
    if not resume and latest is not None:  # starting over: a crash before the first save must not resume the old run
        os.remove(os.path.join(checkpoint_root(run_dir), LATEST))
        print(
            f"[megamoe-train] starting over in {run_dir}: checkpoints/latest no longer names the earlier run's "
            f"{os.path.basename(latest)} (its files stay until overwritten)",
            flush=True,
        )
    with open(os.path.join(run_dir, "recipe.yaml"), "w") as f:
        yaml.safe_dump(recipe.to_dict(), f, sort_keys=False)
    return _launch(recipe, device, run_dir, resume)


if __name__ == "__main__":
    raise SystemExit(main())
