"""Anomaly forensics in whole runs: a NaN injected into one named layer at a known sample
(``debug.nan_sample``) is found and named -- step, rank, micro-batch, samples, module and
tensor -- then the run stops, skips the batch or rolls back (``train.on_anomaly``), and
``lptrain replay`` reproduces the step bitwise.

Layout of every run here (fp8_delayed_cpu at small shapes): 4 samples per step in two
micro-batches of 2, so step N reads samples [4(N-1), 4N) and sample 14 is in step 4's second
micro-batch (samples 14-15).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from lptrain.cli.app import app
from lptrain.config.compose import load
from lptrain.train import TrainingDivergedError, pretrain

SMALL = ["logging.progress=false", "logging.plots=false", "data.builtin_max_mb=1",
         "train.global_batch_size=4", "train.micro_batch_size=2", "model.seq_length=64",
         "optimizer.warmup_iters=0", "train.eval_iters=1"]
NAN_AT_STEP_4 = ["debug.nan_sample=14", "debug.nan_module=layers.1.mlp.linear_fc2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _cfg(cache: Path, tmp: Path, *overrides: str) -> Any:
    return load("fp8_delayed_cpu.yaml", [*SMALL, f"data.cache_dir={cache}",
                                         f"checkpoint.save={tmp / 'ckpt'}", *overrides]).cfg


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_injected_nan_stops_naming_layer_step_and_samples(cache: Path, tmp_path: Path) -> None:
    cfg = _cfg(cache, tmp_path, "train.train_iters=6", "checkpoint.save_interval=2",
               *NAN_AT_STEP_4)
    with pytest.raises(TrainingDivergedError) as err:
        pretrain(cfg, tmp_path / "run")
    msg = str(err.value)
    assert msg.startswith("step 4, rank 0: gradient of 'layers.1.mlp.linear_fc2.weight' is not finite")
    assert ("first non-finite: output grad of 'layers.1.mlp.linear_fc2' (rank 0, micro-batch 1, "
            "samples 14-15)") in msg
    (record,) = _lines(tmp_path / "run" / "anomalies.jsonl")
    assert record["step"] == 4 and record["kind"] == "nonfinite" and record["action"] == "stop"
    assert record["batch"] == [12, 16] and record["samples"] == [14, 15] and record["rank"] == 0
    assert record["culprit"]["tensor"] == "output grad"
    stats = record["numerics"]  # that step's statistics: the poisoned grad shows its NaN
    assert stats["layers.1.mlp.linear_fc2.grad"]["nonfinite"] >= 1
    assert stats["layers.0.self_attention.linear_qkv.input"]["nonfinite"] == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["anomalies"][0]["culprit"] == record["culprit"]
    assert "numerics" not in summary["anomalies"][0]
    assert len(_lines(tmp_path / "run" / "metrics.jsonl")) == 3  # steps 1-3; step 4 never completed
    r = CliRunner().invoke(app, ["replay", str(tmp_path / "run"), "--step", "4"])
    assert r.exit_code == 0, r.output
    assert "bitwise the same: anomaly, loss, first non-finite tensor" in r.output


def test_injected_nan_in_the_output_names_the_forward(cache: Path, tmp_path: Path) -> None:
    cfg = _cfg(cache, tmp_path, "train.train_iters=2", "debug.nan_sample=1",
               "debug.nan_module=layers.0.self_attention.linear_proj", "debug.nan_tensor=output")
    with pytest.raises(TrainingDivergedError, match=r"step 1, rank 0: .*first non-finite: output of "
                       r"'layers.0.self_attention.linear_proj' \(rank 0, micro-batch 0, samples 0-1\)"):
        pretrain(cfg, tmp_path / "run")


def test_rollback_resumes_skips_the_window_and_finishes(cache: Path, tmp_path: Path) -> None:
    """The NaN at step 4: back to the checkpoint of step 2, the samples read since (8-15)
    skipped, steps 3-6 trained again on the next data; the metrics hold each step once.
    ``replay`` of step 4 follows the skip and matches the run and its checkpoint bitwise."""
    cfg = _cfg(cache, tmp_path, "train.train_iters=6", "checkpoint.save_interval=2",
               "checkpoint.keep_latest=5", "train.on_anomaly=rollback", *NAN_AT_STEP_4)
    summary = pretrain(cfg, tmp_path / "run")
    assert summary["status"] == "completed"
    (a,) = summary["anomalies"]
    assert a["step"] == 4 and a["action"] == "rollback" and a["to_step"] == 2
    assert a["skipped_samples"] == [8, 16] and a["culprit"]["module"] == "layers.1.mlp.linear_fc2"
    recs = _lines(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert [r["consumed_samples"] for r in recs] == [4, 8, 20, 24, 28, 32]
    r = CliRunner().invoke(app, ["replay", str(tmp_path / "run"), "--step", "4"])
    assert r.exit_code == 0, r.output
    assert "bitwise the same: loss, grad norm" in r.output and "fp32 master weights" in r.output


def test_rollback_budget_then_stop(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step from 3 on is anomalous: one rollback (train.max_rollbacks=1), then a stop."""
    from lptrain.train.engine import TrainEngine

    real = TrainEngine._nonfinite
    monkeypatch.setattr(TrainEngine, "_nonfinite",
                        lambda self, losses, step: f"step {step}, rank 0: forced" if step >= 3
                        else real(self, losses, step))
    cfg = _cfg(cache, tmp_path, "train.train_iters=5", "checkpoint.save_interval=2",
               "train.on_anomaly=rollback", "train.max_rollbacks=1")
    with pytest.raises(TrainingDivergedError, match=r"train.max_rollbacks=1 reached"):
        pretrain(cfg, tmp_path / "run")
    actions = [r["action"] for r in _lines(tmp_path / "run" / "anomalies.jsonl")]
    assert actions == ["rollback", "stop"]


def test_loss_spike_is_an_anomaly(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2x loss at step 11 against the 10 steps before it (a warm baseline): skipped as a
    spike, the run goes on. Its culprit is the operand whose statistics moved most against
    step 10's batch re-run with the same weights (the re-run itself is not spiked here)."""
    from lptrain.model.gpt import GPTModel

    real = GPTModel.forward
    calls = {"n": 0}

    def spiking(self: Any, tokens: Any, labels: Any = None) -> Any:
        loss, aux = real(self, tokens, labels)
        if self.training:
            calls["n"] += 1
            if calls["n"] in (21, 22):  # step 11's two micro-batches
                return loss * 2, {**aux, "lm_loss": aux["lm_loss"] * 2}
        return loss, aux

    monkeypatch.setattr(GPTModel, "forward", spiking)
    cfg = load("tiny_cpu.yaml", [*SMALL, f"data.cache_dir={cache}", "train.train_iters=12",
                                 "train.spike_zscore=3", "train.spike_window=10",
                                 "train.on_anomaly=skip_batch", "model.num_layers=1"]).cfg
    summary = pretrain(cfg, tmp_path / "run")
    assert summary["status"] == "completed"
    (a,) = summary["anomalies"]
    assert a["step"] == 11 and a["kind"] == "spike" and a["action"] == "skip_batch"
    assert "standard deviations above the mean of the last 10 steps" in a["note"]
    assert a["culprit"]["reference_step"] == 10 and a["culprit"]["statistic"] in ("amax", "snr_db",
                                                                                  "scale", "scale_exp_median")
    recs = _lines(tmp_path / "run" / "metrics.jsonl")
    assert [r.get("skipped", False) for r in recs] == [False] * 10 + [True, False]


def test_a_divergence_stops_the_run_naming_the_operand(cache: Path, tmp_path: Path) -> None:
    """Issue 52 item 6: at lr 10 the loss goes from 5.5 to about 80 at step 2 -- finite, and the
    run used to end "completed" with exit 0. Far above ln(vocab), it stops the run (exit 3, as
    a NaN does) naming the operand whose statistics moved most; step 1's batch diverges too
    with the same weights, which says the weights are to blame."""
    cfg = load("mxfp8_adamw_cpu.yaml", [*SMALL, f"data.cache_dir={cache}", "optimizer.lr=10",
                                        "train.train_iters=4"]).cfg
    assert cfg.train.check_for_spiky_loss and cfg.train.on_anomaly is None  # the defaults
    with pytest.raises(TrainingDivergedError) as err:
        pretrain(cfg, tmp_path / "run")
    assert err.value.exit_code == 3
    msg = str(err.value)
    assert msg.startswith("step 2: loss ") and " is above 3 x ln(259) = 16.67, 3x the loss of a uniform" in msg
    assert "statistics moved most: " in msg and "against step 1's batch re-run with the same weights" in msg
    assert "that loss diverged too: the weights (the updates before) are to blame" in msg
    assert msg.endswith("; stopping (train.on_anomaly=stop)")
    (record,) = _lines(tmp_path / "run" / "anomalies.jsonl")
    assert record["kind"] == "divergence" and record["action"] == "stop"
    culprit = record["culprit"]
    assert culprit["operand"] == f"{culprit['module']}.{culprit['tensor']}"
    assert culprit["operand"] in record["numerics"] and culprit["binades"] > 0
    assert f"{culprit['tensor']} of '{culprit['module']}'" in msg
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "diverged"
    assert [r["step"] for r in _lines(tmp_path / "run" / "metrics.jsonl")] == [1]


@pytest.mark.parametrize("recipe", ["fp8_delayed_cpu.yaml", "nvfp4_adamw_cpu.yaml"])
def test_forensics_rerun_changes_nothing(recipe: str, cache: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """skip_batch with the forensic re-run is bitwise the run without it: the re-run puts back
    the delayed-scaling state and the stochastic-rounding streams it advanced."""
    import lptrain.train.loop as loop

    def run(where: Path) -> list[tuple[Any, Any]]:
        cfg = load(recipe, [*SMALL, f"data.cache_dir={cache}", "train.train_iters=6",
                            "train.on_anomaly=skip_batch", *NAN_AT_STEP_4]).cfg
        pretrain(cfg, where)
        return [(r["loss"], r["grad_norm"]) for r in _lines(where / "metrics.jsonl")]

    with_rerun = run(tmp_path / "a")
    monkeypatch.setattr(loop, "investigate", lambda *a: {"culprit": None, "ranks": [], "numerics": None})
    without = run(tmp_path / "b")
    assert with_rerun == without and with_rerun[3][1] is None  # step 4 skipped in both


def test_replay_tells_a_reproduced_step_from_a_changed_one(cache: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 4 again from the checkpoint of step 2: bitwise the run's (loss, grad norm, every
    master against the checkpoint of step 4). With the update changed under it (another lr,
    standing in for a flaky GPU), the replay says different and names what."""
    from lptrain.train.engine import TrainEngine
    from lptrain.train.replay import replay_step

    pretrain(_cfg(cache, tmp_path, "train.train_iters=4", "checkpoint.save_interval=2"), tmp_path / "run")
    same = replay_step(tmp_path / "run", 4)
    assert same.same and same.fast_forwarded == 1
    assert same.compared == ["loss", "grad norm", "15 fp32 master weights (checkpoint iter_0000004)"]
    assert "the step is reproducible from its checkpoint" in same.lines()[1]
    real = TrainEngine.lr_for_step
    monkeypatch.setattr(TrainEngine, "lr_for_step",  # step 4's update only
                        lambda self, step: {k: (2 if step == 4 else 1) * v
                                            for k, v in real(self, step).items()})
    changed = replay_step(tmp_path / "run", 4)
    assert not changed.same
    assert [d.split(" ")[0] for d in changed.differences] == ["15"]  # the loss is before the update
    assert "suspect the hardware or non-determinism" in changed.lines()[1]
