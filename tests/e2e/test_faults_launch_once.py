"""A multi-rank launch says what went wrong once, with the status one process gives (issue 43,
failure 6 and the NaN line of the smaller items).

* A resume the config cannot load, and a run that already finished, are refused before any
  rank starts: one line, exit 2, as at one process. (Under ``--nproc-per-node 2`` they were
  exit 3 with three lines: the refusal, "terminated (SIGTERM)" from the rank the launcher
  stopped, and "rank 1 of 2 failed with exit 2".)
* A NaN stop on 2 ranks prints its error once (rank 0's; it was printed by both ranks and
  then once more by the launcher) and exits 3.
* A SIGTERM with which the launcher stops a rank because another rank failed is not an error
  line of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lptrain.cli import app
from lptrain.cli import errors as cli_errors

BASE = ["logging.progress=false", "logging.plots=false", "data.builtin_max_mb=1",
        "train.eval_iters=1", "optimizer.warmup_iters=1", "model.seq_length=32",
        "train.log_interval=null"]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def test_refusals_are_judged_before_the_ranks_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    base = [*BASE, "optimizer.decay_iters=2"]  # the lr schedule stays when train_iters grows
    r = CliRunner().invoke(app, ["pretrain", "--output-dir", str(out), *base, "train.train_iters=2"])
    assert r.exit_code == 0, r.output
    spawned: list[list[str]] = []
    monkeypatch.setattr("lptrain.launch.local.launch_local", lambda n, args: spawned.append(args) or 0)
    cases = {
        "already finished": ["train.train_iters=2"],
        "cannot resume": ["train.train_iters=4", "model.hidden_size=128"],
    }
    for words, extra in cases.items():
        r = CliRunner().invoke(app, ["pretrain", "--output-dir", str(out), "--nproc-per-node", "2",
                                     *base, *extra])
        lines = _error_lines(r.stderr)
        assert r.exit_code == 2 and len(lines) == 1 and words in lines[0], r.output
    assert spawned == []  # no rank was started for either
    r = CliRunner().invoke(app, ["pretrain", "--output-dir", str(out), "--nproc-per-node", "2",
                                 *base, "train.train_iters=4"])
    assert r.exit_code == 0 and len(spawned) == 1, r.output  # a compatible resume starts


def test_nan_stop_on_two_ranks_is_said_once(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "lptrain", "pretrain", "--output-dir", str(tmp_path / "run"),
         "--nproc-per-node", "2", *BASE, "train.train_iters=20", "checkpoint.save=null",
         "optimizer.lr=1e10", "optimizer.clip_grad=0"],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 3, r.stderr[-3000:]
    lines = _error_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: step 2, rank "), r.stderr
    assert "not finite" in lines[0] or "loss is nan" in lines[0], r.stderr
    assert "rank 1 of 2" not in r.stderr and "Traceback" not in r.stderr
    assert r.stdout.count("stopped: step ") == 1  # the summary line, as at one process
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "diverged"


def test_launcher_teardown_sigterm_is_not_a_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank the launcher stops after rank 1 failed prints nothing of its own; a SIGTERM
    without a failed peer (a preemption) still says so."""
    exits = tmp_path / "exits.json"
    monkeypatch.setenv("LPTRAIN_PEER_EXITS", str(exits))
    monkeypatch.setenv("LOCAL_RANK", "0")
    app_ = _raising_app(cli_errors.TerminatedError())
    r = CliRunner().invoke(app_, ["boom"])
    assert r.exit_code == 143 and "terminated (SIGTERM)" in r.stderr  # no failure recorded
    exits.write_text('{"1": 2}')  # the launcher saw rank 1 exit 2 and stops this rank
    r = CliRunner().invoke(app_, ["boom"])
    assert r.exit_code == 143 and r.stderr == ""


def _raising_app(exc: BaseException):  # -> typer.Typer
    import typer

    app_ = typer.Typer(cls=cli_errors.LPTrainGroup)

    @app_.command("boom")
    def boom() -> None:
        raise exc

    @app_.command("other")
    def other() -> None:
        pass

    return app_
