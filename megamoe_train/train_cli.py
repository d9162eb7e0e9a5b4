"""Thin entry of the `megamoe-train` console script (the trainer itself is megatron_patch.cli).

It lives outside `megatron_patch` so that it can silence megatron-core's import-time chatter
(no Transformer Engine / Apex / absl on CPU machines) before anything imports megatron-core,
in this process and in every rank it starts. MEGAMOE_VERBOSE=1 keeps the chatter.
"""

from __future__ import annotations

import logging
import os
import warnings

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


def spawn_entry(rank: int, *args):
    """torch.multiprocessing.spawn target of the CLI (imports megatron only after quiet())."""
    quiet()
    from megatron_patch.cli import rank_entry

    rank_entry(rank, *args)


def main(argv=None) -> int:
    quiet()
    from megatron_patch.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
