"""Rank placement on the host (megamoe_train/launch.py): CPU lists and each rank's share."""

import torch

from megamoe_train import launch


def test_parse_cpulist():
    assert launch._parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert launch._parse_cpulist("5") == {5}
    assert launch._parse_cpulist("") == set()


def test_rank_cpus_split_per_numa_node(monkeypatch):
    # 4 GPUs: 0 and 1 on node A (cpus 0-7), 2 and 3 on node B (cpus 8-15)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(launch, "gpu_local_cpus", lambda d: set(range(8)) if d < 2 else set(range(8, 16)))
    shares = [launch.rank_cpus(r, 4) for r in range(4)]
    assert shares == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    # two ranks on GPUs of one node split it; a rank alone on its node keeps all of it
    assert [launch.rank_cpus(r, 3) for r in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], list(range(8, 16))]


def test_rank_cpus_more_ranks_than_cpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(launch, "gpu_local_cpus", lambda d: {3})
    assert [launch.rank_cpus(r, 2) for r in range(2)] == [[3], [3]]  # never an empty set


def test_place_rank_without_gpus_splits_threads(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 8)
    launch.place_rank(0, 2, "gloo", pin_cpus=True)  # gloo: no pinning, threads split
    assert calls == [4]
