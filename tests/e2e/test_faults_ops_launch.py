"""Launch exit statuses when one rank of a 2-rank `lptrain pretrain --nproc-per-node 2` is
signalled (issue table rows 12, 13, 17), in one run folder:

1. SIGTERM to rank 1 only: every rank saves after the same step, rank 1 waits for rank 0's
   summary and plots, and the launch exits 143 (not 3): a preemption, resumable;
2. the same command resumes; SIGKILL to rank 1: rank 0 prints one line
   ``rank 0 lost peer 1 (exit 137, signal SIGKILL)`` and the launch exits 3, without a traceback
   or "bug in lptrain"; the checkpoint of step 1 is still there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lptrain.checkpoint import find_checkpoints, read_train_state
from lptrain.testing.dist import launched_rank_pids

pytestmark = pytest.mark.dist

PLOTS = ("loss.png", "lr.png", "grad_norm.png", "memory.png")


def _command(out: Path) -> list[str]:
    return [sys.executable, "-m", "lptrain", "pretrain", "--recipe", "tiny_cpu.yaml",
            "--output-dir", str(out), "--nproc-per-node", "2", "train.train_iters=100000",
            "checkpoint.save_interval=100000", "logging.progress=false", "data.builtin_max_mb=1",
            "model.seq_length=32", "train.eval_iters=1"]


def _start_then_signal(out: Path, sig: int, after_lines: int) -> subprocess.CompletedProcess:
    """Start the run, wait until metrics.jsonl has ``after_lines`` lines, signal rank 1."""
    proc = subprocess.Popen(_command(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:  # ended before the signal: show both streams' tails
            stdout, stderr = proc.communicate()
            pytest.fail(f"the run exited {proc.returncode} before it was signalled\n"
                        f"stdout: ...{stdout[-1500:]}\nstderr: ...{stderr[-4000:]}")
        if metrics.exists() and len(metrics.read_text().splitlines()) >= after_lines:
            break
        time.sleep(0.1)
    pid = launched_rank_pids(proc.pid).get(1)
    assert pid is not None
    os.kill(pid, sig)
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_one_rank_terminated_then_one_rank_killed(tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = _start_then_signal(out, signal.SIGTERM, after_lines=1)
    assert r.returncode == 143, (r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "error:" not in r.stderr, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM", summary
    assert all((out / p).is_file() for p in PLOTS), sorted(os.listdir(out))  # row 17
    saved = find_checkpoints(out / "checkpoints").valid
    assert len(saved) == 1
    step = read_train_state(saved[0])["iteration"]
    assert step == summary["steps"]

    r = _start_then_signal(out, signal.SIGKILL, after_lines=step + 1)  # resumed, then killed
    assert r.returncode == 3, (r.stdout[-2000:], r.stderr[-2000:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    # the launcher recorded how rank 1 ended before it stopped rank 0
    assert errors[0].startswith("error: rank 0 lost peer 1 (exit 137, signal SIGKILL)"), r.stderr
    assert len(errors) == 1, r.stderr  # one failure, one line (issue 52, item 18)
    assert "Traceback" not in r.stderr and "bug in lptrain" not in r.stderr, r.stderr
    assert "resuming" in r.stdout
    assert [read_train_state(c)["iteration"] for c in find_checkpoints(out / "checkpoints").valid] == [step]
