"""SIGKILL during the first save of a fresh run (issue 43, smaller items): the same command
again -- what a SLURM requeue runs -- starts over, saying so, instead of refusing the folder
("already holds a run ... with no checkpoint"); the killed save's half-written step folder and
its writer's temp file (``.resolved_config.yaml.tmpNNNN``) are gone. A run that ended with a
summary but no checkpoint is still refused (that one is not a crash to recover from).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from lptrain.cli import app
from lptrain.testing.inject import injected_env

ARGS = ["logging.progress=false", "logging.plots=false", "data.builtin_max_mb=1", "train.eval_iters=1",
        "optimizer.warmup_iters=1", "model.seq_length=32", "train.log_interval=null",
        "train.train_iters=4", "checkpoint.save_interval=2"]

# Killed while the first save writes its config: the temp file is written, the rename is not.
_KILL_IN_FIRST_SAVE = """
import os, signal
from pathlib import Path
import lptrain.checkpoint.store as store
_real = store.write_atomically
def _write_then_die(path, data):
    path = Path(path)
    if path.name == "resolved_config.yaml" and path.parent.name.startswith("iter_"):
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(str(data)[:100])
        os.kill(os.getpid(), signal.SIGKILL)
    return _real(path, data)
store.write_atomically = _write_then_die
"""


def test_killed_first_save_starts_over_and_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "run"
    killed = subprocess.run(
        [sys.executable, "-m", "lptrain", "pretrain", "--output-dir", str(out), *ARGS],
        env={**injected_env(tmp_path / "inject", _KILL_IN_FIRST_SAVE), "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=300, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    step = out / "checkpoints" / "iter_0000002"
    leftovers = list(step.glob(".resolved_config.yaml.tmp*"))
    assert len(leftovers) == 1 and not (out / "summary.json").exists()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2

    r = CliRunner().invoke(app, ["pretrain", "--output-dir", str(out), *ARGS])  # the requeue
    assert r.exit_code == 0, r.output
    assert (f"note: {out} holds a run that was stopped before its first checkpoint "
            "(metrics.jsonl but no summary.json); nothing to resume, starting over") in r.stdout
    assert not leftovers[0].exists()
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # a fresh run's metrics, not the killed one's followed by these
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"

    os.remove(out / "checkpoints" / "latest")  # no checkpoint left, but a summary: refused
    for p in (out / "checkpoints").iterdir():
        if p.is_dir():
            shutil.rmtree(p)
    r = CliRunner().invoke(app, ["pretrain", "--output-dir", str(out), *ARGS])
    assert r.exit_code == 2 and "already holds a run" in r.stderr, r.output
