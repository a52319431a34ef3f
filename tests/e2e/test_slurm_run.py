"""The script ``lptrain slurm --dry-run`` renders, run for real under a fake SLURM.

A stub ``scontrol`` (``show hostnames`` prints localhost, ``requeue`` is recorded) and a stub
``srun`` (runs the task command locally) stand in for the cluster; ``lptrain validate-config``
and torchrun are the real ones, so the rendered launch line starts a 2-process CPU run. The
shell has no virtual environment on its ``PATH`` (issue row 14: the script must find lptrain's
interpreter itself). The first job is preempted: SIGTERM to every process of the job, as
SLURM does; the ranks save and the job exits 143, not torchrun's 1, with torchrun's traceback
only in the rank logs (row 15). The same script run again as restart 1 -- what a requeue
does -- resumes from that checkpoint and finishes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lptrain.checkpoint import find_checkpoints, read_train_state
from lptrain.cli import app
from lptrain.testing.dist import find_free_port

BASH = shutil.which("bash")
VENV_BIN = Path(sys.executable).parent
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")

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
        "train.train_iters=30", "optimizer.warmup_iters=1", "checkpoint.save_interval=1000",
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
    path = [d for d in os.environ["PATH"].split(":") if d and Path(d) != VENV_BIN]
    return {**base, "PATH": ":".join([str(bin_dir), *path]), "VIRTUAL_ENV": "",
            "STUB_LOG": str(tmp_path / "requeues"), "SLURM_JOB_ID": "77", "SLURM_NNODES": "1",
            "SLURM_JOB_NODELIST": "localhost", "SLURM_RESTART_COUNT": str(restart),
            "SLURM_NODEID": "0",
            "LPTRAIN_RDZV_PORT": str(find_free_port()), "OMP_NUM_THREADS": "1"}


def _run(script: Path, tmp_path: Path, restart: int) -> subprocess.CompletedProcess:
    r = subprocess.run([BASH, str(script)], env=_env(tmp_path, restart), cwd=tmp_path,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return r


def _preempt(script: Path, tmp_path: Path, metrics: Path) -> subprocess.CompletedProcess:
    """Run the job until it has trained a step, then SIGTERM every process of it."""
    proc = subprocess.Popen([BASH, str(script)], env=_env(tmp_path, 0), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.stat().st_size > 0):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_rendered_script_trains_two_ranks_then_a_requeue_resumes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    script = _render(tmp_path, out)
    ckpt = out / "checkpoints"
    assert shutil.which("lptrain", path=_env(tmp_path, 0)["PATH"]) is None  # no venv on PATH

    r = _preempt(script, tmp_path, out / "metrics.jsonl")
    assert r.returncode == 143, (r.stdout[-3000:], r.stderr[-3000:])  # not torchrun's 1
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "the job exits 143 (resumable)" in r.stderr
    found = find_checkpoints(ckpt).valid
    assert len(found) == 1
    step = read_train_state(found[0])["iteration"]
    state = read_train_state(found[0])
    assert state.get("world_size", 2) == 2 and state.get("dp_size", 2) == 2
    first = json.loads((out / "summary.json").read_text())
    assert first["status"] == "interrupted" and first["steps"] == step
    ranks = out / "slurm" / "logs" / "job77-restart0" / "ranks"
    assert ranks.is_dir() and any(ranks.rglob("*"))  # torchrun's per-rank logs
    assert "Traceback" in (ranks / "torchrun-node0.log").read_text()  # kept there

    r = _run(script, tmp_path, restart=1)  # the requeued job: same script, next restart
    second = json.loads((out / "summary.json").read_text())
    assert second["status"] == "completed", second
    assert second["resumed_from_step"] == step and second["steps_this_job"] == 30 - step
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 31))  # contiguous across the preemption
    assert read_train_state(find_checkpoints(ckpt).valid[0])["iteration"] == 30
    assert (out / "slurm" / "logs" / "job77-restart1").is_dir()
    logs = r.stdout + r.stderr + "".join(
        p.read_text(errors="replace") for p in (out / "slurm" / "logs" / "job77-restart1").rglob("*")
        if p.is_file())
    assert "resuming" in logs
    assert not (tmp_path / "requeues").exists()  # nothing preempted: no self-requeue
