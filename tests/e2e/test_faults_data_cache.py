"""Runs on one machine, one data cache (issue 43, failure 1): a run with
``data.builtin_max_mb=0.02`` and, started while it trains, one with ``0.05`` (other files) and
one with ``0.03`` (a cap that keeps the same files). All finish, each with the losses of its
solo run, bit for bit.

Before the fix the cache held one ``python-stdlib-byte`` per tokenizer whatever the cap, so
the second run prepared its corpus over the first run's files and the first died at its next
epoch boundary (exit 3, "dataset token file ... changed under the running job: it was
replaced by another file"). Cached datasets are content-addressed now.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from lptrain.config import compose
from lptrain.train import pretrain

BASE = ["logging.progress=false", "logging.plots=false", "checkpoint.save=null",
        "train.log_interval=null", "train.eval_iters=1", "optimizer.warmup_iters=1",
        "model.num_layers=1"]
LONG = ["data.builtin_max_mb=0.02", "train.train_iters=200"]  # ~22 steps per epoch


def _cli(out: Path, cache: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LPTRAIN_CACHE_DIR": str(cache)}
    return subprocess.Popen([sys.executable, "-m", "lptrain", "pretrain", "--output-dir", str(out),
                             *BASE, *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _solo(out: Path, cache: Path, *extra: str) -> list[float]:
    """The same run alone, in this process (one thread, like the subprocesses)."""
    torch.set_num_threads(1)
    pretrain(compose("tiny_cpu.yaml", [*BASE, f"data.cache_dir={cache}", *extra]), out)
    return _losses(out)


def test_runs_with_different_caps_share_a_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _cli(tmp_path / "a", cache, *LONG)
    metrics = tmp_path / "a" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.stat().st_size) and first.poll() is None:
        assert time.monotonic() < deadline, "the first run did not start training"
        time.sleep(0.05)
    others = {cap: _cli(tmp_path / cap, cache, f"data.builtin_max_mb={cap}", "train.train_iters=5")
              for cap in ("0.05", "0.03")}  # other files; the same files as the first run
    for proc in (*others.values(), first):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    assert first.returncode == 0 and len(list(cache.glob("*.idx"))) == 2  # 0.02 and 0.03 share
    assert _losses(tmp_path / "a") == _solo(tmp_path / "solo_a", tmp_path / "solo_cache", *LONG)
    for cap in others:
        assert _losses(tmp_path / cap) == _solo(tmp_path / f"solo_{cap}", tmp_path / "solo_cache",
                                                f"data.builtin_max_mb={cap}", "train.train_iters=5")
