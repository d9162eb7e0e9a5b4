"""Checkpoints of `megamoe-train`.

RUN/checkpoints/step_0000100/ holds one megatron-core distributed checkpoint (model and
optimizer sharded state dicts, written collectively by every rank with
`dist_checkpointing.save`), `rank_XXXXX.pt` per rank (step, samples consumed, CPU / CUDA /
Megatron tracker RNG states) and `meta.json`. RUN/checkpoints/latest names the newest complete
checkpoint; it is written last, so a run killed mid-save resumes from the previous one.
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
    torch.save({"step": step, "consumed_samples": consumed_samples, "rng": _rng_state(device)},
               os.path.join(path, f"rank_{rank:05d}.pt"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump({"step": step, "consumed_samples": consumed_samples, "world_size": dist.get_world_size(), **meta}, f, indent=1)
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
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if meta.get("world_size") != dist.get_world_size():
        raise RuntimeError(f"checkpoint {path} was written by {meta.get('world_size')} ranks, this run has {dist.get_world_size()}")
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
