"""The single-process training loop: it learns, writes its outputs, and stops loudly on NaN."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lptrain.config import compose
from lptrain.train import TrainingDivergedError, pretrain


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One prepared built-in corpus for the module (preparing it is not what these test)."""
    return tmp_path_factory.mktemp("cache")


def _cfg(cache: Path, *overrides: str):
    return compose(
        "tiny_cpu.yaml",
        [
            f"data.cache_dir={cache}",
            "logging.progress=false",
            "train.eval_iters=2",
            *overrides,
        ],
    )


def test_loss_decreases_and_outputs_written(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = pretrain(_cfg(cache_dir, "train.train_iters=15", "train.log_interval=5"), tmp_path / "run")
    # 15 AdamW steps at lr 3e-4 on a byte-level corpus drop the loss by far more than 0.3
    # nats from ~ln(259)=5.56; a broken update (no step, wrong sign) would not.
    assert summary["final_loss"] < summary["first_loss"] - 0.3
    assert summary["status"] == "completed"
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 15
    recs = [json.loads(x) for x in lines]
    assert [r["step"] for r in recs] == list(range(1, 16))
    assert "val_loss" in recs[-1] and "val_loss" not in recs[0]
    for key in ("loss", "lr", "lrs", "grad_norm", "tokens_per_s", "step_time_s", "mem_gib"):
        assert key in recs[0], key
    assert recs[0]["mfu"] is None  # CPU: no peak to compare with, so no made-up MFU
    for name in ("loss.png", "lr.png", "grad_norm.png"):
        assert (tmp_path / "run" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # stdout is not a terminal under pytest: plain log lines every log_interval steps
    logged = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step ")]
    assert [x.split()[1] for x in logged] == ["5/15", "10/15", "15/15"]
    assert "tokens/s" in logged[0] and "ms/step" in logged[0] and "GiB" in logged[0]
    assert all(f"{g}=" in logged[0] for g in recs[0]["lrs"])  # lr of every param group


@pytest.mark.parametrize("override", ["data.split_valid_fraction=0", "train.eval_iters=0"])
def test_eval_disabled_cleanly(tmp_path: Path, cache_dir: Path, override: str) -> None:
    """No validation split, or eval_iters=0: no evaluation and no made-up val_loss."""
    summary = pretrain(_cfg(cache_dir, "train.train_iters=2", "train.eval_interval=1",
                            "logging.plots=false", override), tmp_path / "run")
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and all("val_loss" not in r for r in recs)
    assert summary["val_loss"] is None and summary["status"] == "completed"


def test_nan_loss_stops_with_step(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lptrain.model.gpt import GPTModel

    real_forward = GPTModel.forward
    calls = {"n": 0}

    def poisoned(self, tokens, labels=None):
        out = real_forward(self, tokens, labels)
        calls["n"] += 1
        if labels is not None and calls["n"] == 3:  # step 1 (0-based), 1st micro-batch
            loss, aux = out
            return loss * float("nan"), aux
        return out

    monkeypatch.setattr(GPTModel, "forward", poisoned)
    # steps count from 1, as in metrics.jsonl: the 3rd forward is step 2's first micro-batch
    # (a NaN loss makes NaN grads: the engine names the loss or the first bad gradient)
    with pytest.raises(TrainingDivergedError,
                       match=r"step 2, rank 0: (loss is nan|gradient of '[\w.]+' is not finite)"):
        pretrain(_cfg(cache_dir, "train.train_iters=5"), tmp_path / "run")
    recs = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(recs) == 1  # step 1 was logged and flushed before the failure
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "diverged" and "step 2" in summary["error"]


def test_nan_loss_skipped_with_on_nonfinite_skip(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lptrain.model.gpt import GPTModel

    real_forward = GPTModel.forward
    calls = {"n": 0}

    def poisoned(self, tokens, labels=None):
        out = real_forward(self, tokens, labels)
        calls["n"] += 1
        if calls["n"] == 3:  # step 2, first micro-batch
            loss, aux = out
            return loss * float("nan"), aux
        return out

    monkeypatch.setattr(GPTModel, "forward", poisoned)
    summary = pretrain(_cfg(cache_dir, "train.train_iters=3", "train.on_nonfinite=skip",
                            "logging.plots=false"), tmp_path / "run")
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped", False) for r in recs] == [False, True, False]
    assert recs[1]["grad_norm"] is None  # NaN is written as null (JSON has no NaN)
    assert summary["status"] == "completed" and math.isfinite(summary["final_loss"])


def test_nan_gradient_names_the_tensor(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lptrain.model as model_pkg

    real_build = model_pkg.build_model

    def build_with_bad_grad(cfg, factory=None, **kwargs):
        model = real_build(cfg, factory, **kwargs)
        model.final_norm.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        return model

    monkeypatch.setattr(model_pkg, "build_model", build_with_bad_grad)
    with pytest.raises(TrainingDivergedError, match=r"step 1, rank 0: gradient of 'final_norm.weight'"):
        pretrain(_cfg(cache_dir, "train.train_iters=3"), tmp_path / "run")


def _cpu_recipes() -> list[str]:
    from lptrain.config.compose import available_recipes

    return [r for r in available_recipes() if r.endswith("_cpu.yaml")]


@pytest.mark.parametrize("recipe", _cpu_recipes())
def test_every_cpu_recipe_trains(recipe: str, tmp_path: Path, cache_dir: Path) -> None:
    """Each *_cpu sibling runs here on the emulated backend (2 steps, finite, loss moves)."""
    cfg = compose(
        recipe,
        [f"data.cache_dir={cache_dir}", "logging.progress=false",
         "logging.plots=false", "train.train_iters=2", "train.eval_iters=1"],
    )
    summary = pretrain(cfg, tmp_path / "run")
    assert math.isfinite(summary["final_loss"]) and math.isfinite(summary["val_loss"])
    assert summary["final_loss"] != summary["first_loss"]  # the step changed the weights


def test_quantized_primary_weights_follow_fp32_masters(cache_dir: Path) -> None:
    """FP8 primary weights are requantized from their fp32 masters after every step.

    The master is seeded from the high-precision init value (not the dequantized bytes) and,
    after a step, the param's bytes equal quantizing bf16(master) afresh.
    """
    from lptrain.config import World, derive
    from lptrain.model import build_model
    from lptrain.precision import quantize
    from lptrain.precision.factory import build_factory
    from lptrain.precision.tensors import QuantizedTensor
    from lptrain.train.engine import TrainEngine

    cfg = derive(compose("mxfp8_adamw_cpu.yaml", [f"data.cache_dir={cache_dir}"]), World(dp=1))
    factory = build_factory(cfg.precision, num_layers=cfg.model.num_layers)
    reference = build_model(cfg, factory)  # what the engine's model starts from
    init = reference.layers[0].self_attention.linear_qkv.weight.high_precision_init_value().float()
    engine = TrainEngine(cfg)
    w = engine.model.layers[0].self_attention.linear_qkv.weight
    assert isinstance(w, QuantizedTensor)
    (piece,) = [pc for c in engine.optimizer.children for pc in c.pieces if pc.param is w]
    assert piece.whole and torch.equal(piece.master, init)
    assert not torch.equal(w.dequantize(), init)  # the bytes alone would lose the init
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length))
    engine.train_step([{"tokens": tokens, "labels": tokens}], 1)
    with engine.params_synced():
        fresh = quantize(piece.master.to(torch.bfloat16), factory.recipe, role="weight")
        assert torch.equal(w.dequantize(), fresh.dequantize())
    assert not torch.equal(piece.master, init)


def test_wandb_offline_run_records_metrics(tmp_path: Path, cache_dir: Path) -> None:
    """logging.wandb=true writes an offline W&B run holding the step metrics (no network)."""
    out = tmp_path / "run"
    pretrain(
        _cfg(cache_dir, "train.train_iters=2", "logging.wandb=true", "logging.wandb_mode=offline"),
        out,
    )
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb")), "no W&B event file written"
