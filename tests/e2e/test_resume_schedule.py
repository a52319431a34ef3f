"""A resume with a larger ``train.train_iters`` (issue 52, item 5): the cosine decay follows
``train_iters``, so the continued run used to jump back up the curve at the step reached
(1.035e-4 at step 30, 2.694e-4 at step 31 in the issue's 30 -> 40 continuation), re-warming a
trained model without a word. As Megatron-LM's ``OptimizerParamScheduler`` does, a changed
schedule is refused unless ``optimizer.use_checkpoint_opt_param_scheduler`` (the saved
schedule goes on) or ``optimizer.override_opt_param_scheduler`` (this config's from the step
reached) says which; the run says which in one line.

One 4-step run (warmup 1, checkpoint at the end), continued to 6 steps three ways, in-process.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from lptrain.checkpoint.compat import IncompatibleCheckpointError
from lptrain.config import compose
from lptrain.train import pretrain

LR, MIN_LR, WARMUP = 1e-3, 1e-4, 1


def _overrides(out: Path, steps: int, *extra: str) -> list[str]:
    return ["logging.progress=false", "logging.plots=false", "train.eval_iters=0",
            "train.log_interval=null", "data.builtin_max_mb=1", "model.seq_length=32",
            "train.global_batch_size=2", "train.micro_batch_size=2", f"train.train_iters={steps}",
            f"optimizer.warmup_iters={WARMUP}", f"checkpoint.save={out}/ckpt", *extra]


def _lrs(out: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _cosine(step: int, decay: int) -> float:
    """lptrain's (and Megatron's) lr at 1-based ``step``: warmup 1, then cosine to ``decay``."""
    progress = min(1.0, (step - 1 - WARMUP) / (decay - WARMUP))
    return MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi * progress))


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sched") / "run"
    pretrain(compose("tiny_cpu.yaml", _overrides(out, 4)), out)
    assert _lrs(out)[4] == pytest.approx(_cosine(4, 4))  # the end of its decay: min_lr
    return out


def _continue(src: Path, dst: Path, *extra: str) -> tuple[dict[str, Any], dict[int, float]]:
    shutil.copytree(src, dst)
    cfg = compose("tiny_cpu.yaml", [*_overrides(dst, 6, *extra)])
    return pretrain(cfg, dst), _lrs(dst)


def test_a_changed_schedule_is_refused_naming_both_fixes(four_steps: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(four_steps, out)
    with pytest.raises(IncompatibleCheckpointError) as e:
        pretrain(compose("tiny_cpu.yaml", _overrides(out, 6)), out)
    assert e.value.lines == [
        f"cannot resume from {out}/ckpt/iter_0000004: the learning-rate schedule changed "
        "(optimizer.decay_iters 4 there, 6 now (null: train.train_iters)), and the lr would jump "
        "to the new curve at the step reached; fix: pass "
        "optimizer.use_checkpoint_opt_param_scheduler=true to go on with the saved schedule, or "
        "optimizer.override_opt_param_scheduler=true to follow this config's from the step reached"]
    assert len(_lrs(out)) == 4  # nothing trained, nothing written


def test_use_checkpoint_opt_param_scheduler_goes_on_with_the_saved_decay(
        four_steps: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary, lrs = _continue(four_steps, tmp_path / "run", "optimizer.use_checkpoint_opt_param_scheduler=true")
    assert summary["status"] == "completed"
    assert lrs[5] == lrs[6] == pytest.approx(MIN_LR)  # past the saved decay's end: min_lr
    printed = capsys.readouterr().out
    assert ("note: optimizer.use_checkpoint_opt_param_scheduler: the checkpoint's lr schedule goes "
            "on (optimizer.decay_iters 4 there, 6 now (null: train.train_iters)): lr 0.0001 at step 5"
            in printed)
    # (issue 52, item 12) the banner and summary.json say how the ranks are split
    assert "6 steps x 2 seqs x 32 tokens, TP 1 x CP 1 x PP 1 x DP 1 = 1 rank(s), EP 1; resuming at step 5" in printed
    assert summary["parallel"] == {"tp": 1, "cp": 1, "pp": 1, "dp": 1, "ep": 1, "etp": 1, "world_size": 1}


def test_override_opt_param_scheduler_follows_the_new_decay_and_says_so(
        four_steps: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary, lrs = _continue(four_steps, tmp_path / "run", "optimizer.override_opt_param_scheduler=true")
    assert summary["status"] == "completed"
    assert lrs[5] == pytest.approx(_cosine(5, 6)) and lrs[5] > 2 * MIN_LR  # back up the new curve
    assert (f"note: optimizer.override_opt_param_scheduler: this config's lr schedule from step 5 "
            f"(optimizer.decay_iters 4 there, 6 now (null: train.train_iters)): lr {_cosine(5, 6):.4g} "
            f"at step 5, where the saved schedule gives 0.0001" in capsys.readouterr().out)
