"""Running `megamoe-train` in tests as a user does: a real launcher process and its ranks.

The helpers wait on the processes themselves, never on a wall clock (pytest-timeout, in
pyproject.toml, ends a test that hangs). Every process of a run started here carries
RUN_TAG in its environment, so `run_processes` finds all of them, the ones handed to init too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "recipes", "tiny_moe_cpu.yaml")
TAG_VAR = "MEGAMOE_TEST_RUN_TAG"

# A smaller model than the recipe's, so a few steps take seconds.
SMALL = [
    "--set",
    "model.num_layers=2",
    "--set",
    "model.hidden_size=64",
    "--set",
    "model.num_attention_heads=4",
    "--set",
    "model.ffn_hidden_size=128",
    "--set",
    "model.seq_length=32",
    "--set",
    "moe.ffn_hidden_size=64",
    "--set",
    "train.micro_batch_size=4",
    "--set",
    "train.warmup_steps=2",
    "--set",
    "run.log_every=1",
    "--set",
    "run.plot_every=0",
]


def cli_env(**extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def run_cli(args, script: str | None = None, **env) -> tuple[int, str, str]:
    """megamoe-train ARGS (or `python SCRIPT ARGS`) to its end: (exit code, stdout, stderr)."""
    command = [sys.executable, script] if script else [sys.executable, "-m", "megamoe_trainer"]
    proc = subprocess.run([*command, *args], cwd=ROOT, env=cli_env(**env), capture_output=True, text=True)
    return proc.returncode, proc.stdout, proc.stderr


def start_cli(args, script: str | None = None, **env) -> tuple[subprocess.Popen, str]:
    """A run in the background, tagged: (the launcher's Popen, its tag)."""
    tag = uuid.uuid4().hex
    command = [sys.executable, script] if script else [sys.executable, "-m", "megamoe_trainer"]
    proc = subprocess.Popen(
        [*command, *args],
        cwd=ROOT,
        env=cli_env(**{TAG_VAR: tag}, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, tag


def run_processes(tag: str) -> list[psutil.Process]:
    """Every live process of the run tagged `tag` (zombies waiting for their parent excluded)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(TAG_VAR) == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_for_file(path: str, proc: subprocess.Popen):
    """Until `path` exists, as long as the run `proc` is alive (its output if it ended)."""
    while not os.path.exists(path):
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the run ended ({proc.returncode}) before {path} appeared:\n{out}\n{err}")
        time.sleep(0.05)


def metrics(run_dir: str) -> list[dict]:
    """metrics.jsonl's step records as one continuous run."""
    from megamoe_trainer.report import read_metrics

    return read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def metrics_lines(run_dir: str) -> list[dict]:
    """Every line of metrics.jsonl as written (step records and invocation markers)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# Rank 0 holds the run when it fetches the sample MEGAMOE_TEST_HOLD_AT (after writing the file
# MEGAMOE_TEST_HELD) until the file MEGAMOE_TEST_RELEASE exists: a run stopped at a known step,
# deterministically, for a test to act on. Spawned ranks import this file as __mp_main__.
HOLDING_RUN = """
import os
import sys
import time

import megamoe_trainer.data as data

_batch = data.SyntheticCorpus.batch


def batch(self, indices):
    import torch.distributed as dist

    if dist.get_rank() == 0 and indices[0] >= int(os.environ["MEGAMOE_TEST_HOLD_AT"]):
        open(os.environ["MEGAMOE_TEST_HELD"], "w").close()
        while not os.path.exists(os.environ["MEGAMOE_TEST_RELEASE"]):
            time.sleep(0.05)
    return _batch(self, indices)


data.SyntheticCorpus.batch = batch
if __name__ == "__main__":
    from megamoe_trainer.cli import main

    sys.exit(main(sys.argv[1:]))
"""
