"""A hung rank stops the job (issue 43, failure 2): with ``--nproc-per-node 2`` and
``dist.distributed_timeout_minutes=0.1`` (6 s), SIGSTOP rank 1 after step 2. The launcher's
watchdog names rank 1 (stopped) in one line and the launch exits 3 within seconds, leaving no
rank behind. (Before, the launcher and rank 0 were still running after 180 s, printing
nothing: the process-group timeout was 10 minutes and nothing watched the ranks.)

The host-side hang (a rank stuck outside any collective while its peer waits inside one) and
the choice of the rank to name are tested on the watchdog itself in
``tests/unit/launch/test_watchdog.py``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lptrain.testing.dist import launched_rank_pids

pytestmark = pytest.mark.dist

TIMEOUT_MIN = 0.1


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_hung_rank_is_named_and_the_job_exits_3(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lptrain", "pretrain", "--output-dir", str(out), "--nproc-per-node", "2",
         "train.train_iters=100000", "checkpoint.save=null", "logging.progress=false",
         "logging.plots=false", "data.builtin_max_mb=1", "model.seq_length=32", "train.eval_iters=1",
         "train.log_interval=null", f"dist.distributed_timeout_minutes={TIMEOUT_MIN}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    ranks: dict[int, int] = {}
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 2"
            time.sleep(0.05)
        ranks = launched_rank_pids(proc.pid)
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, stderr = proc.communicate(timeout=60 * TIMEOUT_MIN + 60)
        waited = time.monotonic() - stopped_at
    finally:
        for pid in [*ranks.values(), proc.pid]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 3, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith(f"error: rank 1 (pid {ranks[1]}, step "), lines[0]
    assert "stopped by a signal (SIGSTOP or a debugger)) of 2 made no progress for " in lines[0]
    assert f"(dist.distributed_timeout_minutes={TIMEOUT_MIN:g}); the job was stopped" in lines[0]
    assert 60 * TIMEOUT_MIN - 2 <= waited <= 60 * TIMEOUT_MIN + 30, waited
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in ranks.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in ranks.values())  # no rank left behind
