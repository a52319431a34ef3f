"""The script ``lptrain slurm --dry-run`` renders, run for real under a fake SLURM.

A stub ``scontrol`` (``show hostnames`` prints localhost, ``requeue`` is recorded) and a stub
``srun`` (runs the task command locally) stand in for the cluster; ``lptrain validate-config``
and ``torchrun`` are the real ones, so the rendered launch line starts a 2-process CPU run.
The first job stops after 2 of 4 steps (``train.exit_interval``, as a job that ran out of
time) with a checkpoint; the same script run again as restart 1 -- what ``scontrol requeue``
does -- resumes from it and finishes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lptrain.checkpoint import find_checkpoints, read_train_state
from lptrain.cli import app
from lptrain.testing.dist import find_free_port

BASH = shutil.which("bash")
VENV_BIN = Path(sys.executable).parent
pytestmark = pytest.mark.skipif(
    BASH is None or not (VENV_BIN / "torchrun").exists(), reason="needs bash and torchrun"
)

_SRUN = """#!/usr/bin/env bash
# Stub srun: drop srun's own options, run the task command (from `bash` on) on this machine.
while [ "$#" -gt 0 ] && [ "$1" != bash ]; do shift; done
exec "$@"
"""

_SCONTROL = """#!/usr/bin/env bash
if [ "$1 $2" = "show hostnames" ]; then echo localhost; exit 0; fi
if [ "$1" = requeue ]; then echo "requeue $2" >> "$STUB_LOG"; fi
exit 0
"""


def _render(tmp_path: Path, out: Path) -> Path:
    overrides = [
        "train.train_iters=4", "optimizer.warmup_iters=1", "checkpoint.save_interval=2",
        "train.exit_interval=2",
        "train.global_batch_size=4", "train.micro_batch_size=2", "model.seq_length=32",
        "train.eval_iters=1", "train.log_interval=1", "logging.progress=false",
        "logging.plots=false", "data.builtin_max_mb=1", f"data.cache_dir={tmp_path / 'cache'}",
    ]
    r = CliRunner().invoke(app, ["slurm", "--recipe", "tiny_cpu.yaml", "--nodes", "1",
                                 "--gpus-per-node", "2", "--output-dir", str(out), "--dry-run",
                                 *overrides])
    assert r.exit_code == 0, r.output
    script = tmp_path / "job.sbatch"
    script.write_text(r.stdout)
    return script


def _env(tmp_path: Path, restart: int) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        for name, text in (("srun", _SRUN), ("scontrol", _SCONTROL)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "PET_", "TORCH", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                                 "MASTER_", "GROUP_", "ROLE_"))}
    return {**base, "PATH": f"{bin_dir}:{VENV_BIN}:{os.environ['PATH']}",
            "STUB_LOG": str(tmp_path / "requeues"), "SLURM_JOB_ID": "77", "SLURM_NNODES": "1",
            "SLURM_JOB_NODELIST": "localhost", "SLURM_RESTART_COUNT": str(restart),
            "LPTRAIN_RDZV_PORT": str(find_free_port()), "OMP_NUM_THREADS": "1"}


def _run(script: Path, tmp_path: Path, restart: int) -> subprocess.CompletedProcess:
    r = subprocess.run([BASH, str(script)], env=_env(tmp_path, restart), cwd=tmp_path,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return r


def test_rendered_script_trains_two_ranks_then_a_requeue_resumes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    script = _render(tmp_path, out)
    ckpt = out / "checkpoints"

    _run(script, tmp_path, restart=0)
    found = find_checkpoints(ckpt).valid
    assert [read_train_state(c)["iteration"] for c in found] == [2]
    state = read_train_state(found[0])
    assert state.get("world_size", 2) == 2 and state.get("dp_size", 2) == 2
    first = json.loads((out / "summary.json").read_text())
    assert first["status"] == "exit_interval" and first["steps"] == 2
    ranks = out / "slurm" / "logs" / "job77-restart0" / "ranks"
    assert ranks.is_dir() and any(ranks.rglob("*"))  # torchrun's per-rank logs

    r = _run(script, tmp_path, restart=1)  # the requeued job: same script, next restart
    second = json.loads((out / "summary.json").read_text())
    assert second["status"] == "completed", second
    assert second["resumed_from_step"] == 2 and second["steps_this_job"] == 2
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert read_train_state(find_checkpoints(ckpt).valid[0])["iteration"] == 4
    assert (out / "slurm" / "logs" / "job77-restart1").is_dir()
    logs = r.stdout + r.stderr + "".join(
        p.read_text(errors="replace") for p in (out / "slurm" / "logs" / "job77-restart1").rglob("*")
        if p.is_file())
    assert "resuming" in logs
    assert not (tmp_path / "requeues").exists()  # nothing preempted: no self-requeue
