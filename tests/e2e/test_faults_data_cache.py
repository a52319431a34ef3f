"""Runs on one machine, one data cache (issue 43, failure 1): a run with
``data.builtin_max_mb=0.02`` trains; while it waits at its second step, one run with ``0.05``
(other files) and one with ``0.03`` (a cap that keeps the same files) start and prepare their
corpora; then the first run trains on over several epoch boundaries. All finish, each with the
losses of its solo run, bit for bit.

Before the fix the cache held one ``python-stdlib-byte`` per tokenizer whatever the cap, so a
later run prepared its corpus over the first run's files and the first died at its next epoch
boundary (exit 3, "dataset token file ... changed under the running job: it was replaced by
another file"). Cached datasets are content-addressed now.
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
from lptrain.testing.inject import injected_env
from lptrain.train import pretrain

BASE = ["logging.progress=false", "logging.plots=false", "checkpoint.save=null",
        "train.log_interval=null", "train.eval_iters=1", "optimizer.warmup_iters=1",
        "model.num_layers=1"]
FIRST = ["data.builtin_max_mb=0.02", "train.train_iters=60"]  # ~22 steps per epoch

# The first run waits at step 2 until the test says the others have prepared their data.
_WAIT_AT_STEP_2 = """
import os, time
from lptrain.train.engine import TrainEngine
_real = TrainEngine.train_step
def _step(self, micro, step, **kw):
    while step == 2 and not os.path.exists(os.environ["GO_ON"]):
        time.sleep(0.02)
    return _real(self, micro, step, **kw)
TrainEngine.train_step = _step
"""


def _cli(out: Path, cache: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**(env or os.environ), "OMP_NUM_THREADS": "1", "LPTRAIN_CACHE_DIR": str(cache)}
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
    cache, go_on = tmp_path / "cache", tmp_path / "go-on"
    env = {**injected_env(tmp_path / "inject", _WAIT_AT_STEP_2), "GO_ON": str(go_on)}
    first = _cli(tmp_path / "a", cache, *FIRST, env=env)
    metrics = tmp_path / "a" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.stat().st_size):
        assert first.poll() is None, first.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the first run did not start training"
        time.sleep(0.05)
    others = {cap: _cli(tmp_path / cap, cache, f"data.builtin_max_mb={cap}", "train.train_iters=5")
              for cap in ("0.05", "0.03")}  # other files; the same files as the first run
    for proc in others.values():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    go_on.touch()  # the first run trains on, over two more epoch boundaries
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    assert len(list(cache.glob("*.idx"))) == 2  # 0.02 and 0.03 keep the same files: shared
    assert _losses(tmp_path / "a") == _solo(tmp_path / "solo_a", tmp_path / "solo_cache", *FIRST)
    for cap in others:
        assert _losses(tmp_path / cap) == _solo(tmp_path / f"solo_{cap}", tmp_path / "solo_cache",
                                                f"data.builtin_max_mb={cap}", "train.train_iters=5")
