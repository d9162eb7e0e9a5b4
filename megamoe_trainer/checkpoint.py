"""Checkpoints of `megamoe-train`.

RUN/checkpoints/step_0000100/ holds one megatron-core distributed checkpoint (model and
optimizer sharded state dicts, written collectively by every rank with
`dist_checkpointing.save`), `rank_XXXXX.pt` per rank (step, samples consumed, CPU / CUDA /
Megatron tracker RNG states) and `meta.json`. RUN/checkpoints/latest names the newest complete
checkpoint; it is written last, so a run killed mid-save resumes from the previous one.
`RunCheckpoints` is the training loop's view: what it resumes from and when it saves.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

LATEST = "latest"


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def latest_checkpoint(run_dir: str) -> str | None:
    root = checkpoint_root(run_dir)
    try:
        with open(os.path.join(root, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    path = os.path.join(root, name)
    return path if os.path.isfile(os.path.join(path, "meta.json")) else None


def read_meta(path: str) -> dict:
    """A checkpoint's meta.json: step, consumed_samples, world_size, the recipe it ran."""
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def _rng_state(device: str) -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if device == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict, device: str):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    if device == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def save_checkpoint(run_dir: str, step: int, consumed_samples: int, model, optimizer, device: str, meta: dict):
    """Collective: every rank calls it."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    name = f"step_{step:07d}"
    root = checkpoint_root(run_dir)
    path = os.path.join(root, name)
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    dist.barrier()
    model_sd = model.sharded_state_dict()
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd)}
    dist_checkpointing.save(state, path)
    torch.save(
        {"step": step, "consumed_samples": consumed_samples, "rng": _rng_state(device)},
        os.path.join(path, f"rank_{rank:05d}.pt"),
    )
    dist.barrier()
    if rank == 0:
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump(
                {"step": step, "consumed_samples": consumed_samples, "world_size": dist.get_world_size(), **meta},
                f,
                indent=1,
            )
        tmp = os.path.join(root, LATEST + ".tmp")
        with open(tmp, "w") as f:
            f.write(name + "\n")
        os.replace(tmp, os.path.join(root, LATEST))
    dist.barrier()
    return path


def load_checkpoint(path: str, model, optimizer, device: str) -> dict:
    """Collective. Restores model, optimizer and this rank's RNG; returns {step, consumed_samples}."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    meta = read_meta(path)
    if meta.get("world_size") != dist.get_world_size():
        raise RuntimeError(
            f"checkpoint {path} was written by {meta.get('world_size')} ranks, this run has {dist.get_world_size()}"
        )
    model_sd = model.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": model_sd}, path)
    model.load_state_dict(loaded["model"], strict=False)
    if hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # fp32 main copies of bf16 params follow the loaded weights
    model_sd = model.sharded_state_dict()
    opt_sd = dist_checkpointing.load({"optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True)}, path)
    optimizer.load_state_dict(opt_sd["optimizer"])
    extra = torch.load(os.path.join(path, f"rank_{rank:05d}.pt"), weights_only=False)
    _set_rng_state(extra["rng"], device)
    return {"step": extra["step"], "consumed_samples": extra["consumed_samples"]}


class RunCheckpoints:
    """The checkpoints of one run dir as the training loop uses them: resume from the latest,
    save every run.save_every steps (not at the invocation's last step) and at the end unless
    that step is saved already; nothing is written with run.checkpoint false. Collective."""

    def __init__(self, run_dir: str, recipe, model, optimizer, device: str):
        self.run_dir, self.recipe = run_dir, recipe
        self.model, self.optimizer, self.device = model, optimizer, device
        self.enabled, self.every = recipe.run.checkpoint, recipe.run.save_every
        self.last_saved = 0  # step of the newest checkpoint of this run (resumed or saved)

    def resume(self) -> dict | None:
        """Load the latest checkpoint into model, optimizer and RNG: {path, step,
        consumed_samples}, or None where the run dir has none."""
        path = latest_checkpoint(self.run_dir)
        if path is None:
            return None
        state = load_checkpoint(path, self.model, self.optimizer, self.device)
        self.last_saved = state["step"]
        return {"path": path, **state}

    def due(self, step: int, last: int) -> bool:
        """Whether the loop saves after `step` (the invocation's `last` is saved by `save_final`)."""
        return bool(self.enabled and self.every and step % self.every == 0 and step != last)

    def save(self, step: int, consumed_samples: int) -> str:
        path = save_checkpoint(
            self.run_dir,
            step,
            consumed_samples,
            self.model,
            self.optimizer,
            self.device,
            {"recipe": self.recipe.to_dict()},
        )
        self.last_saved = step
        return path

    def save_final(self, last: int, consumed_samples: int) -> str | None:
        """The invocation's last step, unless checkpoints are off or it is saved already."""
        if not self.enabled or last <= self.last_saved:
            return None
        return self.save(last, consumed_samples)
