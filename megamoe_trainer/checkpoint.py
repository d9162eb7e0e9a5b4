"""Checkpoints of `megamoe-train`.

RUN/checkpoints/step_0000100/ holds one megatron-core distributed checkpoint (model and
optimizer sharded state dicts, written collectively by every rank with
`dist_checkpointing.save`), `rank_XXXXX.pt` per rank (step, samples consumed, CPU / CUDA /
Megatron tracker RNG states), `meta.json` and, once all of those are written and synced,
`manifest.json`: every file's size and blake2b checksum, and the step. RUN/checkpoints/latest
names the newest complete checkpoint; it is written last, atomically, so a run killed mid-save
resumes from the previous one.

meta.json's `optimizer_format` names how the optimizer state is stored: "plain" (Megatron's
non-distributed optimizer) or, with train.use_distributed_optimizer, "dp_reshardable" (Megatron-
LM's default for the distributed optimizer; between stock and MegaMoE layers exact, see
megatron_patch/distopt_checkpoint.py). The formats hold different keys, so a run resumes only a
checkpoint of its own format (checked by the launcher and by `load_checkpoint`); checkpoints
without the key were written with the plain optimizer.

Before a run resumes (`find_resume_checkpoint`, in the launcher) the checkpoint `latest` names is
verified against its manifest; one that is missing, torn or corrupt is reported by name and
file, and the run falls back to the newest checkpoint that verifies, or refuses.
`RunCheckpoints` is the training loop's view: what it resumes from and when it saves.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

LATEST = "latest"
MANIFEST = "manifest.json"
META = "meta.json"
# meta.json's "format": 2 = the checkpoint has a manifest (earlier ones, without the key, load unverified)
FORMAT = 2
PLAIN_OPTIMIZER = "plain"
DISTOPT_FORMAT = "dp_reshardable"  # metadata["distrib_optim_sharding_type"] of DistributedOptimizer
_STEP_DIR = re.compile(r"step_(\d+)")
_CHUNK = 8 << 20


class CheckpointProblem(Exception):
    """A checkpoint that cannot be resumed; the message names the file and what is wrong."""


class NoUsableCheckpoint(Exception):
    """The run dir has checkpoints, and none of them verifies."""


def optimizer_format(use_distributed_optimizer: bool) -> str:
    """The optimizer_format a run writes into meta.json."""
    return DISTOPT_FORMAT if use_distributed_optimizer else PLAIN_OPTIMIZER


def check_optimizer_format(meta: dict, use_distributed_optimizer: bool) -> None:
    """CheckpointProblem unless the checkpoint's optimizer state is in the format this run writes."""
    saved = meta.get("optimizer_format", PLAIN_OPTIMIZER)
    want = optimizer_format(use_distributed_optimizer)
    if saved != want:
        setting = "true" if saved != PLAIN_OPTIMIZER else "false"
        raise CheckpointProblem(
            f"its optimizer state is in format {saved!r}, this run's optimizer writes {want!r}: resume it with "
            f"train.use_distributed_optimizer={setting} (or start over with --no-resume)"
        )


def _optimizer_metadata(optimizer) -> dict | None:
    """The sharded_state_dict metadata of a distributed optimizer (None: the plain optimizer)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    if any(isinstance(o, DistributedOptimizer) for o in inner):
        return {"distrib_optim_sharding_type": DISTOPT_FORMAT}
    return None


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def _step_of(path: str) -> int:
    return int(_STEP_DIR.fullmatch(os.path.basename(path)).group(1))


def step_dirs(run_dir: str) -> list[str]:
    """The run dir's checkpoint directories (step_NNNNNNN), newest step first."""
    root = checkpoint_root(run_dir)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = [
        (int(m.group(1)), n) for n in names if (m := _STEP_DIR.fullmatch(n)) and os.path.isdir(os.path.join(root, n))
    ]
    return [os.path.join(root, n) for _, n in sorted(found, reverse=True)]


def read_meta(path: str) -> dict:
    """A checkpoint's meta.json: step, consumed_samples, world_size, the recipe it ran."""
    with open(os.path.join(path, META)) as f:
        return json.load(f)


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, text: str):
    """path holds text or its previous content, never a part (synced, renamed into place)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def file_checksum(path: str, sync: bool = False) -> str:
    """blake2b (128 bit) of the file's bytes; with sync, the file is flushed to disk too."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()


def _checkpoint_files(path: str) -> list[str]:
    """Every file of a checkpoint dir but the manifest, relative, sorted."""
    out = []
    for base, _, files in os.walk(path):
        for name in files:
            rel = os.path.relpath(os.path.join(base, name), path)
            if rel != MANIFEST and not rel.endswith(".tmp"):
                out.append(rel)
    return sorted(out)


def write_manifest(path: str, step: int):
    """Collective, after every file of the checkpoint is written: each rank checksums (and
    syncs) its share of the files, rank 0 writes manifest.json."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [_checkpoint_files(path) if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    mine = {}
    for rel in names[0][rank::world]:
        full = os.path.join(path, rel)
        mine[rel] = {"size": os.path.getsize(full), "blake2b": file_checksum(full, sync=True)}
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    if rank == 0:
        files = {k: v for part in parts for k, v in part.items()}
        manifest = {"step": step, "world_size": world, "checksum": "blake2b-128", "files": dict(sorted(files.items()))}
        _write_atomic(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1))


def verify_checkpoint(path: str) -> dict:
    """The checkpoint's meta.json once every file matches the manifest (size, then checksum);
    CheckpointProblem naming the first files that do not. A checkpoint of before manifests
    (meta.json without "format") is returned unverified, with "unverified": True."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise ValueError("not a manifest")
    except FileNotFoundError:
        try:
            meta = read_meta(path)
        except (OSError, ValueError):
            raise CheckpointProblem(f"{MANIFEST} and {META} are missing: its save did not finish") from None
        if isinstance(meta, dict) and "format" not in meta:
            return {**meta, "unverified": True}
        raise CheckpointProblem(f"{MANIFEST} is missing: its save did not finish") from None
    except (OSError, ValueError) as e:
        raise CheckpointProblem(f"{MANIFEST} is unreadable ({type(e).__name__}: {e})") from None

    problems = []
    to_hash = []
    for rel, want in manifest["files"].items():
        full = os.path.join(path, rel)
        try:
            size = os.path.getsize(full)
        except OSError:
            problems.append(f"{rel} is missing")
            continue
        if size != want.get("size"):
            problems.append(f"{rel} has {size} bytes, the manifest records {want.get('size')} (truncated or rewritten)")
        else:
            to_hash.append((rel, full, want.get("blake2b")))
    if not problems:
        # hashlib releases the GIL on large buffers: threads checksum files in parallel
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            sums = list(pool.map(lambda item: file_checksum(item[1]), to_hash))
        problems += [
            f"{rel} does not match its checksum (corrupt)" for (rel, _, want), got in zip(to_hash, sums) if got != want
        ]
    if problems:
        more = f" (and {len(problems) - 3} more files)" if len(problems) > 3 else ""
        raise CheckpointProblem("; ".join(problems[:3]) + more)
    try:
        meta = read_meta(path)
    except (OSError, ValueError) as e:
        raise CheckpointProblem(f"{META} is unreadable ({type(e).__name__}: {e})") from None
    if meta.get("step") != manifest.get("step"):
        raise CheckpointProblem(f"{META} is of step {meta.get('step')}, {MANIFEST} of step {manifest.get('step')}")
    return meta


def _read_latest(run_dir: str) -> tuple[str | None, str | None]:
    """(the checkpoint dir checkpoints/latest names, or None; what is wrong with it, or None)."""
    root = checkpoint_root(run_dir)
    try:
        with open(os.path.join(root, LATEST), "rb") as f:
            raw = f.read(256)
    except FileNotFoundError:
        return None, f"checkpoints/{LATEST} is missing"
    name = raw.decode(errors="replace").strip()
    if _STEP_DIR.fullmatch(name) and os.path.isdir(os.path.join(root, name)):
        return os.path.join(root, name), None
    shown = name if len(name) <= 40 else name[:40] + "..."
    return None, f"checkpoints/{LATEST} names {shown!r}, which is not a checkpoint of this run dir"


def latest_checkpoint(run_dir: str) -> str | None:
    """The checkpoint dir checkpoints/latest names (unverified), or None."""
    return _read_latest(run_dir)[0]


def has_checkpoints(run_dir: str) -> bool:
    return bool(step_dirs(run_dir)) or os.path.exists(os.path.join(checkpoint_root(run_dir), LATEST))


def find_resume_checkpoint(run_dir: str, say=print) -> tuple[str, dict] | None:
    """(path, meta) of the checkpoint to resume from: the one checkpoints/latest names if it
    verifies, else the newest older one that does (checkpoint dirs newer than latest are saves
    that did not finish). None where the run dir holds no checkpoint; NoUsableCheckpoint where
    it holds some and none verifies. Says what it skips and why."""
    dirs = step_dirs(run_dir)
    latest, latest_problem = _read_latest(run_dir)
    if latest is None and not dirs:
        if os.path.exists(os.path.join(checkpoint_root(run_dir), LATEST)):
            raise NoUsableCheckpoint(f"{latest_problem}, and {checkpoint_root(run_dir)} holds no checkpoint")
        return None
    if latest is not None:
        for d in dirs:
            if _step_of(d) > _step_of(latest):
                say(
                    f"[megamoe-train] ignoring {os.path.basename(d)}: newer than checkpoints/{LATEST} "
                    "(a save that did not finish)",
                    flush=True,
                )
        candidates = [latest] + [d for d in dirs if _step_of(d) < _step_of(latest)]
    else:
        say(f"[megamoe-train] {latest_problem}: looking for the newest checkpoint that verifies", flush=True)
        candidates = dirs
    skipped = []
    for path in candidates:
        name = os.path.basename(path)
        try:
            meta = verify_checkpoint(path)
        except CheckpointProblem as e:
            say(f"[megamoe-train] checkpoint {name} is unusable: {e}", flush=True)
            skipped.append(f"{name}: {e}")
            continue
        if meta.get("unverified"):
            say(
                f"[megamoe-train] checkpoint {name} predates checkpoint manifests: resuming from it unverified",
                flush=True,
            )
        if skipped or latest is None:
            say(f"[megamoe-train] falling back to {name}, the newest checkpoint that verifies", flush=True)
        return path, meta
    raise NoUsableCheckpoint(
        f"no checkpoint in {checkpoint_root(run_dir)} verifies ({'; '.join(skipped)}): "
        "restore one, or start over with --no-resume (which removes them)"
    )


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
    opt_metadata = _optimizer_metadata(optimizer)
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, metadata=opt_metadata)}
    dist_checkpointing.save(state, path)
    torch.save(
        {"step": step, "consumed_samples": consumed_samples, "rng": _rng_state(device)},
        os.path.join(path, f"rank_{rank:05d}.pt"),
    )
    if rank == 0:
        record = {
            "step": step,
            "consumed_samples": consumed_samples,
            "world_size": dist.get_world_size(),
            "optimizer_format": optimizer_format(opt_metadata is not None),
        }
        _write_atomic(os.path.join(path, META), json.dumps({**record, "format": FORMAT, **meta}, indent=1))
    dist.barrier()
    write_manifest(path, step)  # the checkpoint is complete from here
    if rank == 0:
        _write_atomic(os.path.join(root, LATEST), name + "\n")
    dist.barrier()
    return path


def load_checkpoint(path: str, model, optimizer, device: str) -> dict:
    """Collective. Restores model, optimizer and this rank's RNG; returns {step, consumed_samples}."""
    rank = dist.get_rank()
    meta = read_meta(path)
    if meta.get("world_size") != dist.get_world_size():
        raise RuntimeError(
            f"checkpoint {path} was written by {meta.get('world_size')} ranks, this run has {dist.get_world_size()}"
        )
    try:
        check_optimizer_format(meta, _optimizer_metadata(optimizer) is not None)
    except CheckpointProblem as e:
        raise RuntimeError(f"cannot load checkpoint {path}: {e}") from None
    try:
        return _load(path, model, optimizer, device, rank)
    except Exception as e:  # a traceback deep in torch.distributed.checkpoint names no checkpoint
        raise RuntimeError(f"cannot load checkpoint {path}: {type(e).__name__}: {e}") from e


def _load(path: str, model, optimizer, device: str, rank: int) -> dict:
    from megatron.core import dist_checkpointing

    model_sd = model.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": model_sd}, path)
    model.load_state_dict(loaded["model"], strict=False)
    if hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # fp32 main copies of bf16 params follow the loaded weights
    model_sd = model.sharded_state_dict()
    opt_sd = dist_checkpointing.load(
        {"optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=_optimizer_metadata(optimizer))},
        path,
    )
    with torch.no_grad():  # fp32 models: the distributed optimizer's master weights are views of the parameters
        optimizer.load_state_dict(opt_sd["optimizer"])
    extra = torch.load(os.path.join(path, f"rank_{rank:05d}.pt"), weights_only=False)
    _set_rng_state(extra["rng"], device)
    return {"step": extra["step"], "consumed_samples": extra["consumed_samples"]}


class RunCheckpoints:
    """The checkpoints of one run dir as the training loop uses them: resume from the one the
    launcher chose (`find_resume_checkpoint`), save every run.save_every steps (not at the
    invocation's last step) and at the end unless that step is saved already; nothing is
    written with run.checkpoint false. Collective."""

    def __init__(self, run_dir: str, recipe, model, optimizer, device: str):
        self.run_dir, self.recipe = run_dir, recipe
        self.model, self.optimizer, self.device = model, optimizer, device
        self.enabled, self.every = recipe.run.checkpoint, recipe.run.save_every
        self.last_saved = 0  # step of the newest checkpoint of this run (resumed or saved)

    def resume(self, path: str) -> dict:
        """Load the checkpoint at `path` (verified by the launcher) into model, optimizer and
        RNG: {path, step, consumed_samples}."""
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
