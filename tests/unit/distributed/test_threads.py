"""The intra-op thread count of a rank (issue 52 item 22): a single CPU run on a busy machine
took 18.4 s for 20 tiny steps with PyTorch's default threads and 0.9 s with one. The count
comes from the CPUs the rank can actually have; the user's number is kept. The figures are in
``bench/threads.py`` (a bench under a load it starts itself), not here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lptrain.distributed.threads as T
from lptrain.distributed.threads import cgroup_quota, choose_threads


def test_the_thread_count_follows_the_free_cpus() -> None:
    none: dict[str, str] = {}
    # a quiet 8-CPU machine: PyTorch's default (its physical cores) stays
    assert choose_threads(None, none, cpus=8, busy=0.2, default=8).threads == 8
    # two of the CPUs kept busy by other processes: the six free ones
    got = choose_threads(None, none, cpus=8, busy=2.1, default=8)
    assert got.threads == 6 and got.why == "8 CPU(s) in this process's affinity, 2.1 kept busy by other processes"
    # the machine: 2 CPUs, both busy -> one thread, never zero
    assert choose_threads(None, none, cpus=2, busy=2.0, default=2).threads == 1
    # a SLURM binding of 4 CPUs on a 64-core node, 2 ranks there: 2 each (no load measured)
    two = choose_threads(None, {"LOCAL_WORLD_SIZE": "2"}, cpus=4, busy=None, default=32)
    assert two.threads == 2 and "2 ranks on this node (LOCAL_WORLD_SIZE)" in two.why
    # a container's quota of 1.5 CPUs on 16 visible ones
    assert choose_threads(None, none, cpus=16, busy=0.0, default=16, quota=1.5).threads == 1
    # never more than PyTorch's default (hyper-threads are in the affinity, not its count)
    assert choose_threads(None, none, cpus=16, busy=0.0, default=8).threads == 8
    # the user's number is kept: the key first, then OMP_NUM_THREADS
    assert choose_threads(3, {"OMP_NUM_THREADS": "1"}, cpus=2, busy=2.0, default=2).threads == 3
    omp = choose_threads(None, {"OMP_NUM_THREADS": "4"}, cpus=2, busy=2.0, default=4)
    assert omp.threads == 4 and omp.why == "OMP_NUM_THREADS=4"


def test_apply_sets_torch_and_says_why_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(T, "_TORCH_DEFAULT", [2])
    monkeypatch.setattr(T, "affinity_cpus", lambda: [0, 1])
    monkeypatch.setattr(T, "busy_cpus", lambda cpus: 1.9)  # the busy machine
    monkeypatch.setattr(T, "cgroup_quota", lambda: None)
    before = torch.get_num_threads()
    try:
        line = T.apply_threads(None, {})
        assert torch.get_num_threads() == 1
        assert line == ("note: 1 intra-op CPU thread(s), not PyTorch's 2: 2 CPU(s) in this process's "
                        "affinity, 1.9 kept busy by other processes (run.cpu_threads or OMP_NUM_THREADS sets it)")
        assert T.apply_threads(2, {}) is None and torch.get_num_threads() == 2  # the key, silently
        torch.set_num_threads(1)
        assert T.apply_threads(None, {"OMP_NUM_THREADS": "1"}) is None
        assert torch.get_num_threads() == 1  # untouched: PyTorch already follows OMP_NUM_THREADS
    finally:
        torch.set_num_threads(before)


def test_the_busy_measure_and_the_quota_read_the_system(tmp_path: Path) -> None:
    busy = T.busy_cpus(T.affinity_cpus(), sample_s=0.02)
    assert busy is None or 0.0 <= busy <= len(T.affinity_cpus()) + 1e-9
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(tmp_path) is None
    assert cgroup_quota(tmp_path / "missing") is None
