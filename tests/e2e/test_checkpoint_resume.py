"""Resume is exact: N steps straight == N/2, stop, resume to N (losses and final state bitwise),
whatever stopped the first part -- ``train.exit_interval``, SIGTERM, a crash inside the
checkpoint writer, a SIGKILL mid-save -- plus W&B run id continuity and the run-folder policy.

Runs are single-process (``pretrain`` in-process); ``_train`` is the one place a
``--nproc-per-node 2`` variant (``lptrain.testing.dist.run_distributed``) would plug in once
the data-parallel engine lands.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lptrain.checkpoint import find_checkpoints, load_checkpoint, read_train_state, store, validate
from lptrain.config import compose
from lptrain.testing.parity import first_difference
from lptrain.train import TrainingInterrupted, pretrain
from lptrain.train.engine import TrainEngine

N = 4  # steps: the tiny model's first steps already move the loss by ~1e-2, enough to differ


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _overrides(cache: Path, out: Path, *extra: str) -> list[str]:
    # one micro-batch of 4 x 64 tokens per step: every GEMM still a multiple of the FP8 blocks
    return [f"data.cache_dir={cache}", "logging.progress=false", "logging.plots=false",
            "train.eval_iters=1", "train.log_interval=null", f"train.train_iters={N}",
            "train.global_batch_size=4", "train.micro_batch_size=4", "model.seq_length=64",
            f"checkpoint.save={out}/ckpt", *extra]


def _train(recipe: str, cache: Path, out: Path, *extra: str) -> dict[str, Any]:
    return pretrain(compose(recipe, _overrides(cache, out, *extra)), out)


def _metrics(out: Path) -> list[tuple]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in recs]


def _final_state_at(out: Path, step: int) -> dict[str, Any]:
    state, _ = load_checkpoint(out / "ckpt" / f"iter_{step:07d}", rank=0, world_size=1)
    return state["global"]


def _final_state(out: Path) -> dict[str, Any]:
    newest = find_checkpoints(out / "ckpt").valid[0]
    assert read_train_state(newest)["iteration"] == N
    state, _ = load_checkpoint(newest, rank=0, world_size=1)
    return state["global"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path):
    """N straight steps per recipe (computed once, on first use)."""
    runs: dict[str, Path] = {}

    def get(recipe: str) -> Path:
        if recipe not in runs:
            out = tmp_path_factory.mktemp("baseline") / "run"
            _train(recipe, cache_dir, out)
            runs[recipe] = out
        return runs[recipe]

    return get


def _assert_same_run(out: Path, base: Path) -> None:
    assert _metrics(out) == _metrics(base)  # losses, grad norms, lrs: float equality
    diff = first_difference(_final_state(out), _final_state(base))  # masters, optimizer, scaling
    assert diff is None, diff


@pytest.mark.parametrize(("recipe", "wandb"), [("tiny_cpu.yaml", True), ("fp8_delayed_cpu.yaml", False)])
def test_exit_interval_then_resume_is_bitwise(
    recipe: str, wandb: bool, tmp_path: Path, cache_dir: Path, baseline
) -> None:
    """The split run also evaluates every step: train-eval-train == train-only, bitwise (eval
    must not touch the delayed-scaling histories). With W&B (offline) on, the run id is
    persisted in the checkpoint and reused by the resumed job."""
    out = tmp_path / "run"
    extra = [f"train.exit_interval={N // 2}", "train.eval_interval=1"]
    if wandb:
        extra += ["logging.wandb=true", "logging.wandb_mode=offline"]
    first = _train(recipe, cache_dir, out, *extra)
    assert first["status"] == "exit_interval" and first["steps"] == N // 2
    assert validate(out / "ckpt" / f"iter_{N // 2:07d}") is None
    second = _train(recipe, cache_dir, out, *extra)
    assert second["status"] == "completed" and second["resumed_from_step"] == N // 2
    _assert_same_run(out, baseline(recipe))
    if wandb:
        run_id = first["wandb_run_id"]
        assert run_id and second["wandb_run_id"] == run_id
        assert read_train_state(out / "ckpt" / f"iter_{N // 2:07d}")["wandb_run_id"] == run_id
        runs = sorted((out / "wandb").glob("offline-run-*"))
        # W&B names a folder offline-run-<second>-<id>; a resume within the same second gets a
        # "-N" suffix, so the id is matched as a name component rather than as the last one.
        pattern = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
        assert runs and all(pattern.fullmatch(r.name) for r in runs), [r.name for r in runs]
        assert all(list(r.glob("*.wandb")) for r in runs), "no W&B event file written"


def test_sigterm_mid_run_saves_every_line_and_resumes_bitwise(
    tmp_path: Path, cache_dir: Path, baseline, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_step = TrainEngine.train_step

    def step_then_sigterm(self, micro_batches, step, **kw):
        result = real_step(self, micro_batches, step, **kw)
        if step == 2:  # arrives mid-run; the loop must finish this step, save, then exit
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    out = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(TrainEngine, "train_step", step_then_sigterm)
        with pytest.raises(TrainingInterrupted) as info:
            _train("tiny_cpu.yaml", cache_dir, out)
    assert info.value.code == 143
    assert [r[0] for r in _metrics(out)] == [1, 2]
    assert validate(out / "ckpt" / "iter_0000002") is None
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is not None  # handlers restored after the run
    _train("tiny_cpu.yaml", cache_dir, out)
    _assert_same_run(out, baseline("tiny_cpu.yaml"))


def test_crash_inside_writer_keeps_previous_checkpoint(
    tmp_path: Path, cache_dir: Path, baseline, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def crash_at_last_step(folder: Path) -> None:
        if folder.name == f"iter_{N:07d}":
            raise OSError("simulated crash while writing the checkpoint")

    out = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(store.HOOKS, "after_global", crash_at_last_step)
        with pytest.raises(OSError, match="simulated crash"):
            _train("tiny_cpu.yaml", cache_dir, out, "checkpoint.save_interval=2")
    assert "interrupted" in validate(out / "ckpt" / f"iter_{N:07d}")
    capsys.readouterr()
    _train("tiny_cpu.yaml", cache_dir, out, "checkpoint.save_interval=2")
    log = capsys.readouterr().out
    assert f"skipping checkpoint {out}/ckpt/iter_{N:07d}: incomplete" in log
    assert f"resuming from {out}/ckpt/iter_0000002" in log
    _assert_same_run(out, baseline("tiny_cpu.yaml"))


_KILL_SCRIPT = """
import sys, time
from pathlib import Path
from lptrain.checkpoint import store
from lptrain.config import compose
from lptrain.train import pretrain

def hang(folder):
    if folder.name == "iter_{last:07d}":
        Path(sys.argv[1]).write_text("saving")
        time.sleep(120)

store.HOOKS.before_marker = hang
pretrain(compose("tiny_cpu.yaml", {overrides!r}), {out!r})
"""


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path: Path, cache_dir: Path, baseline) -> None:
    out = tmp_path / "run"
    flag = tmp_path / "in_save"
    script = _KILL_SCRIPT.format(last=N, overrides=_overrides(cache_dir, out, "checkpoint.save_interval=2"),
                                 out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", script, str(flag)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not flag.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the subprocess never reached the save"
        time.sleep(0.05)
    proc.kill()  # SIGKILL: files of step N are on disk, its marker is not
    proc.wait()
    assert validate(out / "ckpt" / f"iter_{N:07d}") is not None
    assert len(_metrics(out)) == N  # every line flushed before the kill survived
    _train("tiny_cpu.yaml", cache_dir, out, "checkpoint.save_interval=2")
    _assert_same_run(out, baseline("tiny_cpu.yaml"))


def test_cli_output_dir_policy_and_plot(tmp_path: Path, cache_dir: Path) -> None:
    """A finished folder is refused naming --overwrite; --overwrite replaces it; plot works."""
    from typer.testing import CliRunner

    from lptrain.cli import app

    out = tmp_path / "run"
    args = ["pretrain", "--recipe", "tiny_cpu.yaml", "--output-dir", str(out),
            *_overrides(cache_dir, out), "train.train_iters=1", "optimizer.warmup_iters=0"]
    runner = CliRunner()
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    before = (out / "metrics.jsonl").read_text()
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and "--overwrite" in r.output and "already finished" in r.output
    assert (out / "metrics.jsonl").read_text() == before  # the refused run modified nothing
    r = runner.invoke(app, [*args, "--overwrite"])
    assert r.exit_code == 0, r.output
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    r = runner.invoke(app, ["plot", str(out)])
    assert r.exit_code == 0 and (out / "grad_norm.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "memory.png").read_bytes()[:4] == b"\x89PNG" and "memory.png" in r.output
    # engine.memory_breakdown() measured on the live buffers: tiny_cpu keeps bf16 params, fp32
    # grads (grad_reduce_in_fp32, derived for bf16), fp32 masters and two fp32 Adam moments,
    # with no distributed optimizer (so no padding); n = the checkpoint's master element count.
    mem = json.loads((out / "summary.json").read_text())["memory_breakdown_bytes"]
    n = sum(v.numel() for v in _final_state_at(out, 1)["model"].values())
    assert (mem["params"], mem["grads"], mem["masters"], mem["moments"]) == (2 * n, 4 * n, 4 * n, 8 * n)
    assert mem["padding"] == 0 and mem["total"] == 18 * n
    r = runner.invoke(app, ["pretrain", "--recipe", "tiny_cpu.yaml", "--output-dir", str(tmp_path / "x"),
                            "checkpoint.load=" + str(tmp_path / "missing")])
    assert r.exit_code == 2 and "checkpoint.load" in r.output
