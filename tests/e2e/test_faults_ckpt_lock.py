"""One run per folder (issue 20, row 10): while another process holds a run folder, a second
``lptrain pretrain`` into it (fresh or resuming, and ``--dry-run``) is refused with one line
naming the holder, exit 2, and writes nothing; once the holder is SIGKILLed its stale record
is taken over, saying so. The holder is a small Python process that takes the lock the way
``pretrain`` does; the second run is the CLI in-process with the training loop recorded."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from lptrain.cli import app
from lptrain.train.run_lock import LOCK_FILE, locked_by, run_lock

_HOLD = """
import sys, time
from lptrain.train.run_lock import run_lock
with run_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(120)
"""


def _pretrain(out: Path, *extra: str) -> Any:
    return CliRunner().invoke(app, ["pretrain", "--recipe", "tiny_cpu.yaml", "--output-dir", str(out),
                                    "train.train_iters=3", "optimizer.warmup_iters=1", *extra])


def test_second_run_refused_while_held_then_stale_lock_taken_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trained: list[Path] = []
    monkeypatch.setattr("lptrain.train.pretrain", lambda cfg, out, **kw: trained.append(out))
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)  # a folder holding a run (metrics, config)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "resolved_config.yaml").write_text("old: run\n")
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert locked_by(out).pid == holder.pid
        for extra in ([], ["--overwrite"], ["--dry-run"]):
            r = _pretrain(out, *extra)
            lines = r.stderr.strip().splitlines()
            assert r.exit_code == 2 and len(lines) == 1, r.output
            assert f"run folder {out} is in use by another lptrain run (pid {holder.pid} on host " \
                   f"{socket.gethostname()})" in lines[0] and "Traceback" not in r.output
        assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
        assert (out / "resolved_config.yaml").read_text() == "old: run\n" and trained == []
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (out / LOCK_FILE).read_text().split()[0] == str(holder.pid)  # a stale record
    r = _pretrain(out, "--overwrite")
    assert r.exit_code == 0, r.output
    assert (f"note: taking over the lock of a previous run in {out} (pid {holder.pid} on host "
            f"{socket.gethostname()}, no longer running)") in r.stdout
    assert trained == [out]
    assert (out / LOCK_FILE).read_text() == ""  # released cleanly: no holder to report


def test_lock_is_reentrant_in_one_process(tmp_path: Path) -> None:
    """The CLI takes the lock and the loop asks again: the same process is not refused, and
    the lock is released only by the outermost holder."""
    with run_lock(tmp_path, note=print):
        with run_lock(tmp_path, note=print):
            pass
        assert (tmp_path / LOCK_FILE).read_text().split()[0] == str(os.getpid())
    assert (tmp_path / LOCK_FILE).read_text() == ""
