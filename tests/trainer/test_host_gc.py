"""The training loop's garbage-collector control (megamoe_trainer/perf/host_gc.py)."""

import gc

import pytest

from megamoe_trainer.perf.host_gc import HostGC


@pytest.fixture
def restore_gc():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_manual_collects_on_schedule_and_measures(restore_gc):
    host = HostGC(manual=True, every=3)
    try:
        assert not gc.isenabled() and gc.get_freeze_count() > 0  # the heap at start-up is frozen
        assert host.take_paused_ns() == 0  # the start-up collection belongs to no step
        for step in (1, 2):
            host.after_step(step)
            assert host.take_paused_ns() == 0  # no collection outside the schedule
        host.after_step(3)
        assert host.take_paused_ns() > 0  # the scheduled one, timed
        assert host.take_paused_ns() == 0  # taken once
    finally:
        host.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_automatic_mode_only_measures(restore_gc):
    gc.enable()
    host = HostGC(manual=False, every=3)
    try:
        assert gc.isenabled() and gc.get_freeze_count() == 0
        host.after_step(3)
        assert host.take_paused_ns() == 0  # never collects by itself
        gc.collect()  # any collection (here an explicit one) is counted
        assert host.take_paused_ns() > 0
    finally:
        host.close()
    assert host._on_gc not in gc.callbacks


def test_never_during_the_run(restore_gc):
    host = HostGC(manual=True, every=0)
    try:
        for step in range(1, 5):
            host.after_step(step)
        assert host.take_paused_ns() == 0
    finally:
        host.close()
