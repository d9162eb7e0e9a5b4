"""megamoe-train under pipeline parallelism (1F1B and interleaved virtual stages) and tensor +
sequence parallelism, on CPU processes: a run checkpointed after step 1 without either, then
resumed under each layout's recipe (recipes/tiny_moe_cpu_pp2_vp2.yaml, tiny_moe_cpu_tp2.yaml;
the same 16 sequences per step), gives the steps the unchanged run gives. So the layouts load
the checkpoint resharded (model and Adam state), and differentiate the same loss: the 1/DP of
the data-parallel mean, the micro-batch mean and the MoE aux losses scaled alike."""

import os
import shutil

import pytest

pytest.importorskip("megatron.core")

from cli_runs import ROOT, SMALL, metrics, run_cli  # noqa: E402

# recipe -> what makes its steps the base run's 16 sequences (micro-batch 4 x DP 2 x 2 micro-batches)
LAYOUT_RECIPES = {"tiny_moe_cpu_pp2_vp2.yaml": [], "tiny_moe_cpu_tp2.yaml": ["--set", "train.grad_accum_steps=2"]}
# one model for every run (SMALL with 4 layers: 2 stages x 2 chunks of one layer), fp32 so that
# the layouts' different reduction orders stay at fp32 rounding
MODEL = [*SMALL, "--set", "model.num_layers=4", "--set", "model.dtype=fp32", "--steps", "3"]


def test_pipeline_and_tensor_parallel_continue_a_run_alike(tmp_path):
    base = str(tmp_path / "ep2")
    common = ["--set", "parallel.world_size=4", "--set", "train.micro_batch_size=4"]
    first = os.path.join(ROOT, "recipes", "tiny_moe_cpu.yaml")
    code, out, err = run_cli([first, *MODEL, *common, "--set", "train.stop_at=1", "--run-dir", base, "--no-resume"])
    assert code == 0, out + err
    for name in LAYOUT_RECIPES:
        shutil.copytree(base, str(tmp_path / name))
    code, out, err = run_cli([first, *MODEL, *common, "--run-dir", base])  # steps 2 and 3 as they were
    assert code == 0, out + err
    ref = metrics(base)
    assert [r["step"] for r in ref] == [1, 2, 3]
    for name in LAYOUT_RECIPES:
        run = str(tmp_path / name)
        # the layout recipe's parallel section, the base run's model
        code, out, err = run_cli([os.path.join(ROOT, "recipes", name), *MODEL, *LAYOUT_RECIPES[name], "--run-dir", run])
        assert code == 0, out + err
        assert "resumed from" in out and ("PP 2 x 2 virtual" in out or "TP 2 (sequence parallel)" in out), out
        got = metrics(run)
        assert [r["step"] for r in got] == [1, 2, 3], (name, got)
        for a, b in zip(got[1:], ref[1:]):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (name, a, b)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (name, a, b)
