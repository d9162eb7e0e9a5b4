"""megamoe-train with the distributed optimizer: its checkpoints record their optimizer format
(dp_reshardable), a MegaMoE run's checkpoint continues with stock MoE layers, and a resume with
the other optimizer is refused before any rank starts."""

import json
import os

import pytest

pytest.importorskip("megatron.core")

from cli_runs import SMALL, TINY, metrics, run_cli  # noqa: E402

from megamoe_trainer.cli import main as cli_main  # noqa: E402
from megamoe_trainer.cli import quiet  # noqa: E402

quiet()

DISTOPT = ["--set", "train.use_distributed_optimizer=true"]


def test_distributed_optimizer_checkpoint_resumes_across_layer_kinds(tmp_path, capsys):
    run = str(tmp_path / "run")
    code, out, err = run_cli([TINY, *SMALL, *DISTOPT, "--run-dir", run, "--steps", "2"])
    assert code == 0, out + err
    with open(os.path.join(run, "checkpoints", "step_0000002", "meta.json")) as f:
        assert json.load(f)["optimizer_format"] == "dp_reshardable"

    code, out, err = run_cli(
        [TINY, *SMALL, *DISTOPT, "--run-dir", run, "--steps", "3", "--set", "moe.megamoe_recipe=null"]
    )
    assert code == 0, out + err
    assert "stock Megatron (2 x MoELayer)" in out and "at step 2" in out and "step     3/3" in out, out
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]

    # the plain optimizer cannot read a distributed optimizer's state: refused by the launcher
    capsys.readouterr()
    assert cli_main([TINY, *SMALL, "--run-dir", run, "--steps", "4"]) == 2
    said = capsys.readouterr()
    assert "train.use_distributed_optimizer" in said.err + said.out and "'dp_reshardable'" in said.err + said.out
