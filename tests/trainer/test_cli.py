"""megamoe-train: recipe validation, a short CPU training run with resume, and the data sources."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

from megamoe_trainer.cli import main as cli_main  # noqa: E402
from megamoe_trainer.cli import quiet

quiet()

from cli_runs import ROOT, SMALL, TINY, cli_env, metrics, run_cli  # noqa: E402

from megamoe_trainer.recipe import RecipeError, load_recipe  # noqa: E402

RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")))


def test_recipes_exist():
    names = {os.path.basename(p) for p in RECIPES}
    assert "tiny_moe_cpu.yaml" in names
    for model in ("deepseek_v3_proxy", "qwen3_30b_a3b_proxy", "mixtral_proxy"):
        for gpus in (1, 2):
            for prec in ("bf16", "fp8"):
                assert f"{model}_{gpus}gpu_{prec}.yaml" in names


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_every_recipe_validates(path):
    recipe = load_recipe(path)  # deep: builds the Megatron config too
    assert recipe.train.steps > 0
    assert recipe.moe.megamoe_recipe in ("bf16", "fp8", "mxfp8_mxfp4")


@pytest.mark.parametrize(
    "overrides, on_gpu_executor, graphed",
    [
        ([], True, True),  # a GPU recipe as it is, where the GPU executor runs it
        ([], False, False),  # ... where it does not (no sm90, or a recipe it does not run): no graphs
        (["moe.megamoe_recipe=fp8"], True, True),
        (["moe.megamoe_backend=reference"], True, False),
        (["moe.megamoe_cuda_graph=false"], True, False),
        (["moe.megamoe_cuda_graph=true"], False, True),  # as set (GraphedMegaMoE then names the executor)
    ],
)
def test_moe_cuda_graph_default_follows_the_executor(monkeypatch, overrides, on_gpu_executor, graphed):
    """moe.megamoe_cuda_graph unset reaches the adapter as None: graphs wherever the GPU executor
    runs the call (megatron_patch.cuda_graphs_enabled), never on CPU."""
    import megatron_patch.config as adapter_config
    from megamoe_trainer.model import transformer_config
    from megatron_patch import cuda_graphs_enabled, megamoe_config

    recipe = load_recipe(os.path.join(ROOT, "recipes", "deepseek_v3_proxy_2gpu_bf16.yaml"), overrides, deep=False)
    cfg = transformer_config(recipe)
    assert cfg.moe_megamoe_cuda_graph is recipe.moe.megamoe_cuda_graph
    monkeypatch.setattr(adapter_config, "gpu_executor_supports", lambda mm, device: on_gpu_executor)
    mm = megamoe_config(cfg)
    assert cuda_graphs_enabled(cfg, mm, torch.device("cuda", 0)) is graphed
    assert cuda_graphs_enabled(cfg, mm, torch.device("cpu")) is False
    cfg.recompute_granularity = "full"  # auto never graphs a recomputed layer (explicit True is refused)
    if recipe.moe.megamoe_cuda_graph is None:
        assert cuda_graphs_enabled(cfg, mm, torch.device("cuda", 0)) is False


def _write(tmp_path, text, name="bad.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


BASE = """
parallel: {world_size: 2, expert_parallel: 2, device: cpu}
model: {hidden_size: 128, num_attention_heads: 4}
moe: {num_experts: 8, topk: 2, ffn_hidden_size: 128}
"""


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.hiden_size=64"], "model.hiden_size"),  # unknown key
        (["trian.steps=3"], "trian"),  # unknown section
        (["train.steps=ten"], "train.steps"),  # wrong type
        (["train.grad_accum_steps=0"], "train.grad_accum_steps"),
        (["train.lr=[1]"], "train.lr"),
        (["parallel.expert_parallel=3"], "parallel.expert_parallel"),  # does not divide world size
        (["parallel.world_size=4", "parallel.expert_parallel=4", "moe.num_experts=6"], "parallel.expert_parallel"),
        (["moe.megamoe_recipe=fp16"], "moe.megamoe_recipe"),  # unknown recipe name
        (["moe.topk=9"], "moe.topk"),
        (["model.dtype=fp64"], "model.dtype"),
        (["data.path=/nonexistent/corpus"], "data.path"),  # missing file
        (["moe.megamoe_recipe=fp8", "model.hidden_size=96", "model.num_attention_heads=4"], "model.hidden_size"),
        (["moe.megamoe_backend=warp9"], "moe.megamoe_backend"),  # rejected by the adapter's config check
        (["moe.megamoe_cuda_graph=true"], "moe.megamoe_cuda_graph"),  # CUDA graphs on the CPU recipe
        (["parallel.tensor_parallel=3"], "parallel.tensor_parallel"),  # does not divide world size
        (["parallel.tensor_parallel=2", "model.seq_length=65"], "parallel.tensor_parallel"),  # sequence parallel
        (["parallel.pipeline_parallel=2"], "parallel.expert_parallel"),  # a stage of 1 rank cannot hold EP 2
        (["parallel.world_size=4", "parallel.pipeline_parallel=2", "model.num_layers=3"], "parallel.pipeline_parallel"),
        (["parallel.virtual_pipeline_stages=2"], "parallel.virtual_pipeline_stages"),  # needs pipeline stages
        (
            [
                "parallel.world_size=4",
                "parallel.pipeline_parallel=2",
                "parallel.virtual_pipeline_stages=2",
                "model.num_layers=4",
                "train.grad_accum_steps=3",
            ],
            "parallel.virtual_pipeline_stages",
        ),  # the interleaved schedule: micro-batches a multiple of the stages
        (
            ["parallel.world_size=4", "parallel.pipeline_parallel=2", "moe.megamoe_cuda_graph=true"],
            "moe.megamoe_cuda_graph",
        ),  # graphed layers hold one forward in flight
        (["model.attention=flash"], "model.attention"),  # the old name of perf.attention, as written
        (["perf.attention=flash"], "perf.attention"),
        (["perf.gc_every=-1"], "perf.gc_every"),
        (["run.peak_tflops=0"], "run.peak_tflops"),
        (["train.steps=10", "run.profile_at=9"], "run.profile_at"),  # steps 9..11 do not fit
        (["train.stop_at=4", "run.profile_at=3"], "run.profile_at"),  # steps 3..5: the invocation ends at 4
        (["train.adam_moments_dtype=fp16"], "train.adam_moments_dtype"),
        (["train.adam_moments_dtype=bf16"], "train.adam_moments_dtype"),  # the AdamW kernel needs CUDA
        (
            ["train.adam_moments_dtype=bf16", "parallel.device=cuda", "train.adam_beta2=0.999"],
            "train.adam_moments_dtype",
        ),  # a bf16 exp_avg_sq would stall
        (
            ["train.adam_moments_dtype=bf16", "parallel.device=cuda", "train.use_distributed_optimizer=true"],
            "train.adam_moments_dtype",
        ),
    ],
)
def test_bad_recipe_names_the_key(tmp_path, capsys, overrides, key):
    path = _write(tmp_path, BASE)
    argv = [path, "--check"]
    for o in overrides:
        argv += ["--set", o]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {key}:" in err, err
    assert "Traceback" not in err
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    assert info.value.key == key


def test_moved_keys_are_read_at_their_new_place(tmp_path, capsys):
    """The speed-up switches of earlier recipes (train.fused_optimizer, model.attention, ...: now
    in `perf`, recipe.MOVED_KEYS) still work in a recipe file and in --set, and errors name them
    as written; set under both names they are refused."""
    from megamoe_trainer.recipe import MOVED_KEYS

    assert set(MOVED_KEYS.values()) == {f"perf.{f}" for f in load_recipe(TINY, deep=False).perf.__dataclass_fields__}
    old_base = BASE.replace("num_attention_heads: 4}", "num_attention_heads: 4, attention: megatron}")
    old = _write(tmp_path, old_base + "train: {fused_optimizer: false, manual_gc: true}\n", "old.yaml")
    recipe = load_recipe(old, ["moe.fused_router_topk=false"], deep=False)
    p = recipe.perf
    assert (p.fused_optimizer, p.manual_gc, p.attention, p.fused_router_topk) == (False, True, "megatron", False)
    assert load_recipe(old, ["perf.manual_gc=false"], deep=False).perf.manual_gc is False  # --set wins, either name
    with pytest.raises(RecipeError) as info:
        load_recipe(old, ["train.gc_every=-1"], deep=False)
    assert info.value.key == "train.gc_every"
    both = _write(tmp_path, BASE + "train: {manual_gc: true}\nperf: {manual_gc: false}\n", "both.yaml")
    assert cli_main([both, "--check"]) == 2
    assert "error: train.manual_gc: is the old name of perf.manual_gc" in capsys.readouterr().err
    assert cli_main([old, "--check"]) == 0  # printed in the new layout
    import yaml

    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["perf"]["fused_optimizer"] is False and "fused_optimizer" not in printed["train"]


@pytest.mark.parametrize("name", ["123", "yes", "exp #2", "a: b", "null", "ü [1]"])
def test_run_dir_flag_is_taken_literally(tmp_path, capsys, name):
    """--run-dir is a path: not read as YAML (a number or yes refused, a ' #' comment cut off)."""
    import yaml

    assert cli_main([TINY, "--run-dir", name, "--check"]) == 0, capsys.readouterr().err  # --check creates nothing
    assert yaml.safe_load(capsys.readouterr().out)["run"]["dir"] == name


def test_bad_recipe_file(tmp_path, capsys):
    assert cli_main([str(tmp_path / "missing.yaml")]) == 2
    assert "file not found" in capsys.readouterr().err
    assert cli_main([_write(tmp_path, "run: [1, 2\n")]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert cli_main([_write(tmp_path, "run:\n  dir: x\n  sede: 3\n")]) == 2
    assert "run.sede: unknown key (did you mean 'seed'?)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, message",
    [
        ("- run\n- train\n", "holds a list, not a mapping of sections"),
        ("42\n", "holds a int (42), not a mapping of sections"),
        (
            "train: {steps: 3}\nmodel: {hidden_size: 64}\ntrain: {lr: 0.1}\n",
            "train: section given twice (lines 1 and 3)",
        ),
        ("train:\n  lr: 0.1\n  steps: 3\n  lr: 0.2\n", "train.lr: key given twice (lines 2 and 4)"),
    ],
)
def test_a_recipe_that_is_not_one_mapping_of_sections(tmp_path, capsys, text, message):
    """A list or scalar at the top, or a section or key given twice (YAML keeps the last
    silently): one line naming the file and what is wrong, exit 2, before any rank starts."""
    path = _write(tmp_path, text)
    assert cli_main([path, "--run-dir", str(tmp_path / "run"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err and path in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not os.path.exists(tmp_path / "run")


def test_a_directory_as_the_recipe(tmp_path, capsys):
    assert cli_main([str(tmp_path)]) == 2
    assert f"error: recipe: {tmp_path} is a directory, not a recipe file" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["empty .bin", "truncated .bin", "empty .idx", "truncated .idx", "random .idx"])
def test_an_unreadable_indexed_dataset_is_named(tmp_path, capsys, damage):
    """data.path's files checked before any rank starts: one line naming the file, exit 2 (it
    was megatron's 'cannot mmap an empty file' / 'offset must be non-negative' in a rank)."""
    from megamoe_trainer.data import write_synthetic_indexed

    prefix = write_synthetic_indexed(str(tmp_path / "corpus" / "synth"), num_documents=200, vocab_size=256)
    assert load_recipe(TINY, [f"data.path={prefix}"]).data.path == prefix  # intact: accepted
    kind, ext = damage.split()
    path = prefix + ext
    size = os.path.getsize(path)
    if kind == "random":
        with open(path, "wb") as f:
            f.write(os.urandom(size))
    else:
        with open(path, "r+b") as f:
            f.truncate(0 if kind == "empty" else size // 2)
    argv = [TINY, *SMALL, "--steps", "1", "--set", "run.checkpoint=false", "--run-dir", str(tmp_path / "run")]
    assert cli_main([*argv, "--set", f"data.path={prefix}"]) == 2
    err = capsys.readouterr().err
    assert f"error: data.path: {path}" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_resume_without_checkpoint_is_refused(tmp_path, capsys):
    assert cli_main([TINY, "--run-dir", str(tmp_path / "empty"), "--resume"]) == 2
    assert "run.resume" in capsys.readouterr().err


_run_cli = run_cli
_metrics = metrics


def test_console_entry_rejects_bad_recipe_cleanly(tmp_path):
    code, out, err = _run_cli([_write(tmp_path, BASE), "--set", "parallel.expert_parallel=3"])
    assert code == 2
    assert "megamoe-train: error: parallel.expert_parallel: 3 does not divide parallel.world_size=2" in err
    assert "Traceback" not in err and "Warning" not in err, err


def test_train_checkpoint_resume(tmp_path):
    """A 6-step run stopped after step 4, then resumed: steps continue, metrics are appended, and
    the result equals an uninterrupted 6-step run (model, optimizer, data position, RNG restored)."""
    run = str(tmp_path / "run")
    code, out, err = _run_cli(
        [TINY, *SMALL, "--run-dir", run, "--steps", "6", "--stop-at", "4", "--set", "run.save_every=2"]
    )
    assert code == 0, out + err
    assert "step     4/6" in out and "checkpoint saved" in out and "stopped (train.stop_at)" in out, out
    assert "median after the first 1:" in out, out  # the steady rate beside the mean with warm-up
    assert "Traceback" not in err, err
    first = _metrics(run)
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    assert all(r["expert_load"] and len(r["expert_load"][0]) == 8 for r in first)  # [layers, experts], gathered over EP
    assert all(r["load_imbalance"] >= 1.0 for r in first)
    # the EP ranks' rows: every routed row lands on one rank's experts
    assert all(len(r["ep_rank_load"]) == 2 and r["ep_rank_imbalance"] >= 1.0 for r in first)
    assert all(sum(r["ep_rank_load"]) == sum(map(sum, r["expert_load"])) for r in first)
    # every expert-parallel rank's barrier wait for its peers that step (the barriers' own counter)
    assert all(len(r["peer_wait_ms"]) == 2 and min(r["peer_wait_ms"]) >= 0 for r in first), first
    # and every one's host time in Python garbage collection (perf.manual_gc: the scheduled ones)
    assert all(len(r["host_gc_ms"]) == 2 and min(r["host_gc_ms"]) >= 0 for r in first), first
    assert "peer wait" in out, out
    # split by the barrier that waited (forward / backward, first / push barrier)
    assert all(
        sorted(r["peer_wait_ms_by_site"])
        == sorted(["forward exchange", "forward push", "backward exchange", "backward push"])
        and all(len(v) == 2 for v in r["peer_wait_ms_by_site"].values())
        for r in first
    )
    assert all(
        abs(sum(v[k] for v in r["peer_wait_ms_by_site"].values()) - r["peer_wait_ms"][k]) < 1e-6
        for r in first
        for k in range(2)
    )
    assert os.path.isfile(os.path.join(run, "progress.png"))
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["latest", "step_0000002", "step_0000004"]

    # resume (auto: the run dir has a checkpoint)
    code, out, err = _run_cli([TINY, *SMALL, "--run-dir", run, "--steps", "6"])
    assert code == 0, out + err
    assert "resumed from" in out and "at step 4" in out, out
    assert "step     5/6" in out and "step     1/6" not in out, out
    assert "median after the first 0:" in out, out  # this invocation's 2 steps, not the run's 6
    resumed = _metrics(run)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert resumed[:4] == first

    # the same 6 steps without a break
    ref = str(tmp_path / "ref")
    code, out, err = _run_cli([TINY, *SMALL, "--run-dir", ref, "--steps", "6"])
    assert code == 0, out + err
    straight = _metrics(ref)
    for a, b in zip(resumed, straight):
        assert a["step"] == b["step"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), (a, b)
        assert a["expert_load"] == b["expert_load"]
        assert a["lr"] == b["lr"]
    # a finished run asked for the same steps: nothing runs, and no summary of the old steps
    with open(os.path.join(ref, "summary.json")) as f:
        ref_summary = json.load(f)
    assert ref_summary["tokens_per_s"] > 0
    code, out, err = _run_cli([TINY, *SMALL, "--run-dir", ref, "--steps", "6"])
    assert code == 0 and "nothing to do: the checkpoint is at step 6" in out and "done:" not in out, out + err
    with open(os.path.join(ref, "summary.json")) as f:
        assert json.load(f) == ref_summary  # not overwritten by the invocation that ran no step
    # starting over in a run dir with checkpoints: --no-resume removes the earlier run's outputs
    # and says which, so a new run that dies before its first save is not resumed from them
    code, out, err = _run_cli(
        [TINY, *SMALL, "--run-dir", ref, "--steps", "1", "--no-resume", "--set", "run.checkpoint=false"]
    )
    assert code == 0 and "step     1/1" in out, out + err
    assert "starting over in" in out and "removed checkpoints/ (step_0000006)" in out, out
    assert "metrics.jsonl (6 steps), summary.json" in out, out
    assert not os.path.exists(os.path.join(ref, "checkpoints"))
    assert [r["step"] for r in _metrics(ref)] == [1]

    # the MegaMoE run's checkpoint (model + optimizer) continues with Megatron's stock MoE layers
    # (same parameters and checkpoint keys), and a finished run given more steps continues
    code, out, err = _run_cli([TINY, *SMALL, "--run-dir", run, "--steps", "7", "--set", "moe.megamoe_recipe=null"])
    assert code == 0, out + err
    assert "stock Megatron (2 x MoELayer)" in out and "at step 6" in out and "step     7/7" in out, out
    assert [r["step"] for r in _metrics(run)] == list(range(1, 8))

    # a checkpoint written by 2 ranks is not resumed by 1 (refused before any rank starts)
    assert (
        cli_main(
            [TINY, *SMALL, "--run-dir", run, "--set", "parallel.world_size=1", "--set", "parallel.expert_parallel=1"]
        )
        == 2
    )


_FAILING_RANK = """
import sys
import megamoe_trainer.data as data

_batch = data.SyntheticCorpus.batch


def batch(self, indices):
    import torch.distributed as dist
    if dist.get_rank() == 1 and indices[0] >= 40:  # rank 1 raises while fetching step 6's batch
        raise RuntimeError("injected data failure")
    return _batch(self, indices)


data.SyntheticCorpus.batch = batch  # module level: spawned ranks import this file as __mp_main__
if __name__ == "__main__":
    from megamoe_trainer.cli import main
    sys.exit(main(sys.argv[1:]))
"""


def test_a_rank_that_raises_ends_the_job_promptly(tmp_path):
    """Rank 1 raises outside the MoE layers while rank 0 waits in a collective: the job exits
    with the rank's error at once (its MegaMoE buffers' release barrier would have waited out its
    300 s timeout for the blocked peer, and the launcher ends the other ranks only then)."""
    script = _write(tmp_path, _FAILING_RANK, "failing_rank.py")
    proc = subprocess.run(
        [
            sys.executable,
            script,
            TINY,
            *SMALL,
            "--run-dir",
            str(tmp_path / "run"),
            "--steps",
            "10",
            "--set",
            "run.checkpoint=false",
        ],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=280,  # promptly: well before the 300 s release barrier it once waited out
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "megamoe-train: error: rank 1 failed: RuntimeError: injected data failure" in proc.stderr, proc.stderr


def test_gradient_accumulation_matches_one_large_micro_batch(tmp_path):
    """Two micro-batches of 2 sequences per step give the steps of one micro-batch of 4: the same
    samples per step, the loss a mean over micro-batches, gradients summed in main_grad before one
    all-reduce (DDP no_sync), the aux losses scaled like the main loss."""
    runs = {}
    for name, mbs, accum in (("one", 4, 1), ("two", 2, 2)):
        run = str(tmp_path / name)
        code, out, err = _run_cli(
            [
                TINY,
                *SMALL,
                "--run-dir",
                run,
                "--steps",
                "3",
                "--no-resume",
                "--set",
                f"train.micro_batch_size={mbs}",
                "--set",
                f"train.grad_accum_steps={accum}",
                "--set",
                "run.checkpoint=false",
            ]
        )
        assert code == 0, out + err
        runs[name] = _metrics(run)
    for a, b in zip(runs["one"], runs["two"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-4), (a, b)
    assert runs["one"][0]["loss"] == pytest.approx(runs["two"][0]["loss"], rel=1e-5)  # before any update


def test_data_parallel_mean_matches_one_rank(tmp_path):
    """Two data-parallel ranks (EP 1: both hold every expert) of 2 sequences give the steps of one
    rank of 4: the loss differentiated is the mean over ranks (1/DP in the loss, DDP summing
    unscaled, expert gradients too). A missing or doubled 1/DP would change the gradient norm."""
    runs = {}
    for name, world, mbs in (("one", 1, 4), ("two", 2, 2)):
        run = str(tmp_path / name)
        code, out, err = _run_cli(
            [
                TINY,
                *SMALL,
                "--run-dir",
                run,
                "--steps",
                "3",
                "--no-resume",
                "--set",
                f"parallel.world_size={world}",
                "--set",
                "parallel.expert_parallel=1",
                "--set",
                f"train.micro_batch_size={mbs}",
                "--set",
                "run.checkpoint=false",
            ]
        )
        assert code == 0, out + err
        runs[name] = _metrics(run)
    one, two = runs["one"], runs["two"]
    assert one[0]["loss"] == pytest.approx(two[0]["loss"], rel=1e-5)  # same weights and samples
    for a, b in zip(one, two):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3), (a, b)
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-4), (a, b)


def test_dense_wgrad_fusion_matches_ddp_accumulation(tmp_path):
    """perf.dense_wgrad_fusion (Megatron's gradient_accumulation_fusion through
    megamoe_trainer.perf.dense_wgrad): on CPU its fallback adds the bf16 wgrad into main_grad itself and
    DDP's hook skips its add, so the steps are the unfused run's bit for bit, over 2 micro-batches."""
    runs = _fused_and_unfused(tmp_path, "perf.dense_wgrad_fusion")
    assert [(r["loss"], r["grad_norm"]) for r in runs["fused"]] == [
        (r["loss"], r["grad_norm"]) for r in runs["unfused"]
    ]


def test_expert_main_grad_overwrite_matches_zeroed_buffers(tmp_path):
    """moe.megamoe_overwrite_main_grad (the default): DDP's reset leaves the expert main_grads
    stale and the step's first micro-batch writes over them, the second adds: bit for bit the
    steps of zeroed buffers (a missed overwrite would add last step's gradients)."""
    runs = _fused_and_unfused(tmp_path, "moe.megamoe_overwrite_main_grad")
    assert [(r["loss"], r["grad_norm"]) for r in runs["fused"]] == [
        (r["loss"], r["grad_norm"]) for r in runs["unfused"]
    ]
    assert "expert main_grads written over" in runs["fused_out"] and "expert main_grads" not in runs["unfused_out"]


def _fused_and_unfused(tmp_path, switch: str) -> dict:
    """The tiny recipe's metrics over 3 steps of 2 micro-batches, with `switch` true and false."""
    runs = {}
    for name, fuse in (("fused", "true"), ("unfused", "false")):
        run = str(tmp_path / name)
        code, out, err = _run_cli(
            [
                TINY,
                *SMALL,
                "--run-dir",
                run,
                "--steps",
                "3",
                "--no-resume",
                "--set",
                "train.micro_batch_size=2",
                "--set",
                "train.grad_accum_steps=2",
                "--set",
                f"{switch}={fuse}",
                "--set",
                "run.checkpoint=false",
            ]
        )
        assert code == 0, out + err
        runs[name] = _metrics(run)
        runs[name + "_out"] = out
    return runs


def test_synthetic_corpus_is_deterministic():
    from megamoe_trainer.data import SyntheticCorpus

    a = SyntheticCorpus(256, 64, seed=7).batch(range(10, 14))
    b = SyntheticCorpus(256, 64, seed=7).batch(range(10, 14))
    c = SyntheticCorpus(256, 64, seed=8).batch(range(10, 14))
    assert a["tokens"].shape == (4, 64) and a["labels"].shape == (4, 64)
    assert (a["tokens"] == b["tokens"]).all() and not (a["tokens"] == c["tokens"]).all()
    assert (a["tokens"][:, 1:] == a["labels"][:, :-1]).all()
    assert int(a["tokens"].max()) < 256


def test_indexed_dataset_source(tmp_path):
    from megamoe_trainer.data import IndexedCorpus, write_synthetic_indexed

    prefix = write_synthetic_indexed(str(tmp_path / "corpus" / "synth"), num_documents=500, vocab_size=256)
    recipe = load_recipe(TINY, [f"data.path={prefix}", f"run.dir={tmp_path / 'run'}"])
    assert recipe.data.path == prefix
    corpus = IndexedCorpus(prefix, 256, 32, seed=1, num_samples=64, cache_dir=str(tmp_path / "cache"))
    batch = corpus.batch(range(8))
    assert batch["tokens"].shape == (8, 32)
    assert (batch["tokens"][:, 1:] == batch["labels"][:, :-1]).all()
    assert int(batch["tokens"].max()) < 256
    again = IndexedCorpus(prefix, 256, 32, seed=1, num_samples=64, cache_dir=str(tmp_path / "cache")).batch(range(8))
    assert (again["tokens"] == batch["tokens"]).all()


def test_indexed_corpus_checks_the_labels_token_ids_too():
    """A token id past the vocabulary in a sample's last position reaches only the labels (the
    inputs stop one token earlier): refused with the data.path message, not by the loss."""
    import numpy as np

    from megamoe_trainer.data import IndexedCorpus

    corpus = IndexedCorpus.__new__(IndexedCorpus)
    corpus.vocab_size, corpus.seq_length = 256, 4
    text = np.array([5, 6, 7, 8, 300])
    corpus.dataset = [
        {"tokens": text[:-1], "labels": text[1:], "loss_mask": np.ones(4, np.float32), "position_ids": np.arange(4)}
    ]
    with pytest.raises(ValueError, match="data.path: token id 300"):
        corpus.batch([0])


def test_deepseek_proxy_features_train_on_cpu(tmp_path):
    """The DeepSeek-V3 proxy's feature set (fp8 MegaMoE recipe, sigmoid router with expert bias,
    group-limited top-8, shared expert, dense first layer, sequence aux loss), shrunk to CPU size."""
    recipe = os.path.join(ROOT, "recipes", "deepseek_v3_proxy_2gpu_fp8.yaml")
    shrink = {
        "parallel.device": "cpu",
        "model.num_layers": 2,
        "model.moe_layer_freq": "[0,1]",
        "model.hidden_size": 128,
        "model.num_attention_heads": 4,
        "model.ffn_hidden_size": 256,
        "model.vocab_size": 256,
        "model.seq_length": 32,
        "moe.num_experts": 16,
        "moe.ffn_hidden_size": 128,
        "moe.shared_expert_ffn_hidden_size": 128,
        "train.micro_batch_size": 2,
        "train.warmup_steps": 1,
        "run.log_every": 1,
        "run.checkpoint": "false",
        "run.plot_every": 0,
    }
    args = [recipe, "--steps", "2", "--run-dir", str(tmp_path / "ds")]
    for k, v in shrink.items():
        args += ["--set", f"{k}={v}"]
    code, out, err = _run_cli(args)
    assert code == 0, out + err
    assert "MegaMoE fp8 (1 x MegaMoEMoELayer on reference)" in out, out
    records = _metrics(str(tmp_path / "ds"))
    assert [r["step"] for r in records] == [1, 2]
    assert len(records[0]["expert_load"]) == 1 and len(records[0]["expert_load"][0]) == 16
    assert not os.path.exists(str(tmp_path / "ds" / "checkpoints"))


def test_fused_wgrad_accumulation_matches_ddp_accumulation(tmp_path):
    """moe.megamoe_fuse_wgrad_accumulation (the default) adds the expert wgrads into DDP's main_grad
    in the backward and DDP's hook skips its own add: the steps match the unfused run (gradient
    norm and loss; a double or a missing add would change the norm), over two micro-batches."""
    runs = _fused_and_unfused(tmp_path, "moe.megamoe_fuse_wgrad_accumulation")
    for a, b in zip(runs["fused"], runs["unfused"]):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3), (a, b)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a, b)
