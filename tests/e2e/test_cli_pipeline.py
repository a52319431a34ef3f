"""The command line under pipeline parallelism: the world judged, the refusals, and a stage
that dies.

``validate-config --dp N`` judges ``TP x PP x N`` ranks; ``pretrain`` judges the ranks it has,
so a pipeline recipe on one process is refused by the rule (exit 1) before anything is built.
A rank killed on one stage (its peer blocked in the schedule's P2P, waiting for it) ends the
launch within 30 s with the one-line peer message and exit 3.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lptrain.cli import app
from lptrain.testing.dist import launched_rank_pids

runner = CliRunner(env={"COLUMNS": "400"})
PP2 = "model.pipeline_model_parallel_size=2"
PEER_LOST_WITHIN_S = 30.0


def test_validate_config_judges_tp_times_pp_times_dp() -> None:
    r = runner.invoke(app, ["validate-config", "--recipe", "tiny_cpu.yaml", PP2, "model.tensor_model_parallel_size=2",
                            "model.sequence_parallel=true", "train.micro_batch_size=2", "--dp", "2"])
    assert r.exit_code == 0, r.output
    assert "dp 2, 8 ranks" in r.output
    # 8 / (4 x 2) = 1 micro-batch < 2 stages: 1F1B runs it (GPipe's order), with a warning;
    # the interleaved schedule refuses it
    r = runner.invoke(app, ["validate-config", "--recipe", "tiny_cpu.yaml", PP2, "--dp", "2"])
    assert r.exit_code == 0 and "PP-FEW-MICRO-BATCHES" in r.output and "50% of the step is bubble" in r.output
    r = runner.invoke(app, ["validate-config", "--recipe", "tiny_cpu.yaml", PP2, "--dp", "2", "model.num_layers=4",
                            "model.virtual_pipeline_model_parallel_size=2"])
    assert r.exit_code == 1 and "PP-MICRO-BATCHES" in r.output


def test_pretrain_on_fewer_ranks_than_pp_is_refused_by_the_rule(tmp_path: Path) -> None:
    r = runner.invoke(app, ["pretrain", "--recipe", "tiny_cpu.yaml", PP2, "--output-dir", str(tmp_path / "run"),
                            "--nproc-per-node", "3", "train.train_iters=1"])
    assert r.exit_code == 1, r.output
    assert "LAUNCH-PP-DIVIDES-WORLD" in r.output and "--nproc-per-node" in r.output
    assert not (tmp_path / "run").exists()


@pytest.mark.dist
def test_a_stage_killed_ends_the_pipeline_within_30s_with_one_line(tmp_path: Path) -> None:
    """Rank 1 (the last stage) is killed mid-run; rank 0 waits on its P2P. The launcher ends
    it: exit 3, ``rank 0 lost peer 1`` first, no traceback, within 30 s of the kill."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lptrain", "pretrain", "--recipe", "tiny_cpu.yaml", "--output-dir", str(out),
           "--nproc-per-node", "2", PP2, "train.train_iters=100000", "checkpoint.save_interval=100000",
           "logging.progress=false", "data.builtin_max_mb=1", "model.seq_length=32", "train.eval_iters=1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            stdout, stderr = proc.communicate()
            pytest.fail(f"the run did not start training: {proc.returncode}\n{stdout[-1500:]}\n{stderr[-3000:]}")
        time.sleep(0.1)
    pid = launched_rank_pids(proc.pid).get(1)
    assert pid is not None
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    took = time.monotonic() - killed
    assert proc.returncode == 3, stderr[-3000:]
    assert took < PEER_LOST_WITHIN_S, took
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    # one failure, one line: the survivor's; the launcher adds none (issue 52, item 18)
    assert len(errors) == 1 and errors[0].startswith("error: rank 0 lost peer 1 (exit 137, signal SIGKILL)"), stderr
    assert "Traceback" not in stderr and "bug in lptrain" not in stderr, stderr


@pytest.mark.dist
def test_a_cpu_recipe_at_pp2_on_four_ranks_trains(tmp_path: Path) -> None:
    """``lptrain pretrain --recipe fp8_delayed_cpu.yaml --nproc-per-node 4 pp=2`` with the
    recipe's own batch (8 / (4 x 2) = 1 micro-batch per step: fewer than the stages, so the
    pipeline runs GPipe's order, with the PP-FEW-MICRO-BATCHES warning) trains: every step
    logged, the loss finite and falling. That it equals DP 2 bitwise, in every CPU recipe, is
    tests/dist/test_pipeline_parallel.py's."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "lptrain", "pretrain", "--recipe", "fp8_delayed_cpu.yaml",
                           "train.train_iters=3", "optimizer.warmup_iters=1", "logging.progress=false",
                           "data.builtin_max_mb=1", "train.eval_iters=1", "logging.plots=false",
                           "--nproc-per-node", "4", PP2, "--output-dir", str(out)],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PP-FEW-MICRO-BATCHES" in proc.stdout + proc.stderr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in rows if "loss" in m]
    assert [m["step"] for m in rows if "loss" in m] == [1, 2, 3]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
