"""megamoe-train under faults, as a user meets them: real launchers and ranks, real megatron
dist-checkpoints, real signals. A run dir belongs to one run (run.lock); a checkpoint that is
missing, torn or corrupt is named with its file and the run falls back to the newest one that
verifies; a run dir that holds checkpoints or metrics is never started over silently; however a
run ends, none of its processes (ranks, megatron's checkpoint Managers) or temporary files is
left; and a resumed run's losses are the uninterrupted run's."""

import os
import shutil
import signal
import tempfile

import psutil
import pytest

pytest.importorskip("megatron.core")

from cli_runs import (  # noqa: E402
    HOLDING_RUN,
    SMALL,
    TINY,
    metrics,
    metrics_lines,
    run_cli,
    run_processes,
    start_cli,
    wait_for_file,
)

from megamoe_trainer.checkpoint import CheckpointProblem, NoUsableCheckpoint, find_resume_checkpoint  # noqa: E402
from megamoe_trainer.cli import main as cli_main  # noqa: E402

STEPS = ["--steps", "6", "--set", "run.save_every=2"]  # checkpoints at steps 2, 4 and 6
HOLD_AT_STEP_4 = "24"  # rank 0's first sample of step 4 (3 steps of 8 samples before it)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of 6 steps: its run dir (checkpoints 2, 4, 6) and its losses."""
    run = str(tmp_path_factory.mktemp("reference") / "run")
    code, out, err = run_cli([TINY, *SMALL, *STEPS, "--run-dir", run])
    assert code == 0, out + err
    assert "MFU" not in out, out  # no peak known for a CPU
    return run, {r["step"]: r["loss"] for r in metrics(run)}


def _copy(reference_run: str, tmp_path) -> str:
    run = str(tmp_path / "run")
    shutil.copytree(reference_run, run)
    return run


def _ckpt(run: str, step: int) -> str:
    return os.path.join(run, "checkpoints", f"step_{step:07d}")


def _flip(path: str, offsets):
    """Bit-flip 4 KiB at each offset."""
    with open(path, "r+b") as f:
        for offset in offsets:
            f.seek(offset)
            block = f.read(4096)
            f.seek(offset)
            f.write(bytes(b ^ 0xFF for b in block))


def _truncate(path: str, size: int):
    with open(path, "r+b") as f:
        f.truncate(size)


# how a checkpoint gets damaged -> the file its report names
DAMAGE = {
    "bit flips in a shard": (lambda c: _flip(os.path.join(c, "__1_0.distcp"), (4096, 65536, 200_000)), "__1_0.distcp"),
    "truncated shard": (lambda c: _truncate(os.path.join(c, "__0_0.distcp"), 1000), "__0_0.distcp"),
    "empty rank file": (lambda c: _truncate(os.path.join(c, "rank_00000.pt"), 0), "rank_00000.pt"),
    "random .metadata": (
        lambda c: open(os.path.join(c, ".metadata"), "wb").write(
            os.urandom(os.path.getsize(os.path.join(c, ".metadata")))
        ),
        ".metadata",
    ),
    "meta.json missing": (lambda c: os.remove(os.path.join(c, "meta.json")), "meta.json"),
    "manifest missing (a save that did not finish)": (
        lambda c: os.remove(os.path.join(c, "manifest.json")),
        "manifest",
    ),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_named_and_the_previous_one_used(reference, tmp_path, damage):
    run = _copy(reference[0], tmp_path)
    harm, named = DAMAGE[damage]
    harm(_ckpt(run, 6))
    said = []
    path, meta = find_resume_checkpoint(run, say=lambda *a, **k: said.append(" ".join(a)))
    assert path == _ckpt(run, 4) and meta["step"] == 4
    assert any("step_0000006 is unusable" in s and named in s for s in said), said
    assert any("falling back to step_0000004" in s for s in said), said


def test_garbage_latest_falls_back_to_the_newest_checkpoint_that_verifies(reference, tmp_path):
    run = _copy(reference[0], tmp_path)
    with open(os.path.join(run, "checkpoints", "latest"), "wb") as f:
        f.write(b"\x00\xffstep_9\n garbage")
    said = []
    path, _ = find_resume_checkpoint(run, say=lambda *a, **k: said.append(" ".join(a)))
    assert path == _ckpt(run, 6)
    assert any("checkpoints/latest names" in s for s in said), said
    # and checkpoint dirs newer than latest are saves that did not finish: never resumed
    with open(os.path.join(run, "checkpoints", "latest"), "w") as f:
        f.write("step_0000004\n")
    said.clear()
    assert find_resume_checkpoint(run, say=lambda *a, **k: said.append(" ".join(a)))[0] == _ckpt(run, 4)
    assert any("ignoring step_0000006" in s for s in said), said


def test_no_checkpoint_verifies_refuses_before_any_rank_starts(reference, tmp_path, capsys):
    run = _copy(reference[0], tmp_path)
    for step in (2, 4, 6):
        _truncate(os.path.join(_ckpt(run, step), "__1_0.distcp"), 10)
    with pytest.raises(NoUsableCheckpoint, match="step_0000002: __1_0.distcp has 10 bytes"):
        find_resume_checkpoint(run, say=lambda *a, **k: None)
    before = metrics_lines(run)
    assert cli_main([TINY, *SMALL, *STEPS, "--run-dir", run]) == 2
    err = capsys.readouterr().err
    assert "error: run.resume: no checkpoint in" in err and "--no-resume" in err, err
    assert metrics_lines(run) == before  # nothing rewritten
    with pytest.raises(CheckpointProblem):
        from megamoe_trainer.checkpoint import verify_checkpoint

        verify_checkpoint(_ckpt(run, 6))


def test_metrics_without_a_checkpoint_are_not_started_over(reference, tmp_path, capsys):
    """A run dir with metrics.jsonl but no checkpoint (a run killed before its first save, or
    run.checkpoint false) refuses to start at step 1 unless told (--no-resume)."""
    run = _copy(reference[0], tmp_path)
    shutil.rmtree(os.path.join(run, "checkpoints"))
    before = metrics_lines(run)
    assert cli_main([TINY, *SMALL, *STEPS, "--run-dir", run]) == 2
    err = capsys.readouterr().err
    assert "holds metrics.jsonl of steps 1..6 but no checkpoint" in err and "--no-resume" in err, err
    assert metrics_lines(run) == before


def test_resume_past_a_corrupt_checkpoint_continues_the_uninterrupted_run(reference, tmp_path):
    """The latest checkpoint's shard bit-flipped: the run says so, resumes from step 4 and its
    steps 5-6 are the uninterrupted run's; metrics.jsonl keeps every line it had (appended to).
    With run.peak_tflops set, the progress line shows MFU."""
    ref_run, ref_loss = reference
    run = _copy(ref_run, tmp_path)
    DAMAGE["bit flips in a shard"][0](_ckpt(run, 6))
    before = metrics_lines(run)
    code, out, err = run_cli([TINY, *SMALL, *STEPS, "--run-dir", run, "--set", "run.peak_tflops=1"])
    assert code == 0, out + err
    assert "checkpoint step_0000006 is unusable: __1_0.distcp does not match its checksum" in out, out
    assert "resumed from" in out and "at step 4" in out, out
    assert "| MFU " in out, out
    lines = metrics_lines(run)
    assert lines[: len(before)] == before
    assert lines[len(before)]["event"] == "resume" and lines[len(before)]["from_step"] == 4
    assert {r["step"]: r["loss"] for r in metrics(run)} == ref_loss


def _start_holding(tmp_path, run: str):
    """A run of STEPS that holds at step 4 (its step 2 checkpointed); a TMPDIR of its own
    (short: a Manager's socket path in it must fit AF_UNIX's 107 bytes)."""
    script = tmp_path / "holding_run.py"
    script.write_text(HOLDING_RUN)
    tmp = tempfile.mkdtemp(prefix="mmt-", dir="/tmp")
    _TMPDIRS.append(tmp)
    held, release = str(tmp_path / "held"), str(tmp_path / "release")
    proc, tag = start_cli(
        [TINY, *SMALL, *STEPS, "--run-dir", run],
        script=str(script),
        MEGAMOE_TEST_HOLD_AT=HOLD_AT_STEP_4,
        MEGAMOE_TEST_HELD=held,
        MEGAMOE_TEST_RELEASE=release,
        TMPDIR=str(tmp),
    )
    wait_for_file(held, proc)
    return proc, tag, tmp, release


_TMPDIRS: list[str] = []


@pytest.fixture(autouse=True)
def _remove_tmpdirs():
    yield
    while _TMPDIRS:
        shutil.rmtree(_TMPDIRS.pop(), ignore_errors=True)


def _snapshot(run: str) -> dict:
    out = {}
    for base, _, files in os.walk(run):
        for name in files:
            st = os.stat(os.path.join(base, name))
            out[os.path.relpath(os.path.join(base, name), run)] = (st.st_size, st.st_mtime_ns)
    return out


def test_a_second_run_in_the_same_dir_is_refused(tmp_path):
    """While a run holds its run dir, a second invocation there exits 2 at once naming the
    holder's PID, and touches nothing; the first run ends with each step once."""
    run = str(tmp_path / "run")
    proc, tag, _, release = _start_holding(tmp_path, run)
    try:
        before = _snapshot(run)
        code, out, err = run_cli([TINY, *SMALL, *STEPS, "--run-dir", run])
        assert code == 2, out + err
        assert f"is in use by megamoe-train PID {proc.pid}" in err, err
        assert "[megamoe-train] 2 ranks" not in out, out
        assert _snapshot(run) == before
    finally:
        open(release, "w").close()
    out, err = proc.communicate()
    assert proc.returncode == 0, out + err
    assert [r["step"] for r in metrics_lines(run) if "step" in r] == [1, 2, 3, 4, 5, 6]


FAULTS = {
    "SIGKILL to the launcher": None,
    "SIGKILL to a rank": None,
    "SIGINT to the launcher": signal.SIGINT,
    "SIGTERM to the launcher": signal.SIGTERM,
}


@pytest.mark.parametrize("fault", FAULTS)
def test_however_a_run_ends_none_of_its_processes_is_left(tmp_path, reference, fault):
    """A run held at step 4 (checkpointed at step 2, so each rank has started megatron's
    checkpoint Manager) meets the fault: the launcher exits with the fault's status once every
    process of the run has ended (its pipes close: a `tee` would not hang), no temporary
    directory is left, and the run dir is free again. After the launcher was killed (its lock
    left stale), the next invocation takes the lock over and continues the uninterrupted run."""
    run = str(tmp_path / "run")
    proc, tag, tmp, _ = _start_holding(tmp_path, run)
    processes = run_processes(tag)
    ranks = [p for p in processes if p.ppid() == proc.pid and "spawn_main" in " ".join(p.cmdline())]
    assert len(ranks) == 2, processes
    assert [p for p in processes if p.ppid() in {r.pid for r in ranks}], processes  # the Managers
    if fault == "SIGKILL to the launcher":
        proc.kill()
    elif fault == "SIGKILL to a rank":
        os.kill(ranks[-1].pid, signal.SIGKILL)
    else:
        proc.send_signal(FAULTS[fault])
    out, err = proc.communicate()  # returns once nothing holds the launcher's stdout and stderr
    if fault == "SIGKILL to the launcher":
        assert proc.returncode == -signal.SIGKILL
        psutil.wait_procs(run_processes(tag))  # the ranks end their own process groups
    elif fault == "SIGKILL to a rank":
        assert proc.returncode == 1, out + err
        assert "rank 0 was killed by SIGKILL" in err or "rank 1 was killed by SIGKILL" in err, err
    else:
        sig = FAULTS[fault]
        assert proc.returncode == 128 + sig, out + err
        assert f"stopped by {sig.name}; every rank has ended" in err, err
        assert "done:" not in out, out
    assert run_processes(tag) == []
    # the ranks' pymp-* and other temporary directories (torch's compile cache stays, as always)
    assert [n for n in os.listdir(tmp) if not n.startswith("torchinductor_")] == []
    if fault != "SIGKILL to the launcher":
        return
    code, out, err = run_cli([TINY, *SMALL, *STEPS, "--run-dir", run])
    assert code == 0, out + err
    assert f"taking over {run}/run.lock: megamoe-train PID {proc.pid}" in out, out
    assert "at step 2" in out, out
    assert {r["step"]: r["loss"] for r in metrics(run)} == reference[1]


def test_a_checkpoint_from_before_manifests_resumes_unverified(reference, tmp_path):
    """A checkpoint written before checkpoints carried a manifest (meta.json without "format")
    is still resumed, saying it is unverified; one of today's without its manifest is not."""
    import json

    run = _copy(reference[0], tmp_path)
    ckpt = _ckpt(run, 6)
    os.remove(os.path.join(ckpt, "manifest.json"))
    meta = json.load(open(os.path.join(ckpt, "meta.json")))
    del meta["format"]
    with open(os.path.join(ckpt, "meta.json"), "w") as f:
        json.dump(meta, f)
    said = []
    path, found = find_resume_checkpoint(run, say=lambda *a, **k: said.append(" ".join(a)))
    assert path == ckpt and found["step"] == 6 and found["unverified"]
    assert any("step_0000006 predates checkpoint manifests" in s for s in said), said
