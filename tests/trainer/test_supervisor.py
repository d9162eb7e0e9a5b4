"""The launcher names the rank that failed first: a peer that a failed rank leaves blocked in a
collective fails a moment later, and both may have ended by the time the launcher looks. The
launcher runs in a process of its own, as `megamoe-train` does (at its end it stops
multiprocessing's resource tracker, which pytest's own rank pools share)."""

import os
import subprocess
import sys
import textwrap

from megamoe_trainer.supervisor import _Ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_LAUNCHER = textwrap.dedent(
    """
    import os, sys, time
    from megamoe_trainer.supervisor import run_ranks

    def root_cause_then_collateral(rank):
        # rank 1 fails first; rank 0 once rank 1's failure is on record, as a rank waiting on it
        # in a collective would
        if rank == 1:
            raise RuntimeError("the root cause")
        deadline = time.monotonic() + 60
        run_tmp = os.path.dirname(os.environ["TMPDIR"])
        while not os.path.exists(os.path.join(run_tmp, "r1", "failed_at")):
            assert time.monotonic() < deadline, "rank 1 never failed"
            time.sleep(0.001)
        raise RuntimeError("connection reset by peer")

    if __name__ == "__main__":
        end = run_ranks(root_cause_then_collateral, 2, ())
        print(end.code, end.message)
    """
)


def test_the_first_rank_to_fail_is_the_one_reported(tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "1 rank 1 failed: RuntimeError: the root cause", run.stdout


def _record(run_tmp, rank, failed_at=None):
    os.makedirs(os.path.join(run_tmp, f"r{rank}"), exist_ok=True)
    if failed_at is not None:
        with open(os.path.join(run_tmp, f"r{rank}", "failed_at"), "w") as f:
            f.write(str(failed_at))


def test_order_of_failures(tmp_path):
    run_tmp = str(tmp_path)
    ranks = _Ranks([], run_tmp)
    _record(run_tmp, 0, failed_at=2_000)
    _record(run_tmp, 1, failed_at=1_000)
    _record(run_tmp, 2, failed_at=1_500)
    assert ranks.first_failed([(0, "p0"), (1, "p1"), (2, "p2")]) == (1, "p1")  # the earliest
    _record(run_tmp, 3)  # killed: no time of its own, and its peers fail after it
    assert ranks.first_failed([(0, "p0"), (1, "p1"), (3, "p3")]) == (3, "p3")
