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


def test_loss_decreases_and_outputs_written(tmp_path: Path, cache_dir: Path) -> None:
    summary = pretrain(_cfg(cache_dir, "train.train_iters=15"), tmp_path / "run")
    # 15 AdamW steps at lr 3e-4 on a byte-level corpus drop the loss by far more than 0.3
    # nats from ~ln(259)=5.56; a broken update (no step, wrong sign) would not.
    assert summary["final_loss"] < summary["first_loss"] - 0.3
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 15
    assert "val_loss" in json.loads(lines[-1])
    png = (tmp_path / "run" / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


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
    with pytest.raises(TrainingDivergedError, match=r"step 1: loss is nan"):
        pretrain(_cfg(cache_dir, "train.train_iters=5"), tmp_path / "run")


def test_nan_gradient_names_the_tensor(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lptrain.model as model_pkg

    real_build = model_pkg.build_model

    def build_with_bad_grad(cfg, factory=None):
        model = real_build(cfg, factory)
        model.final_norm.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        return model

    monkeypatch.setattr(model_pkg, "build_model", build_with_bad_grad)
    with pytest.raises(TrainingDivergedError, match=r"step 0: gradient of 'final_norm.weight'"):
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
    import lptrain.train.loop as loop
    from lptrain.model import build_model
    from lptrain.precision import quantize
    from lptrain.precision.factory import build_factory
    from lptrain.precision.tensors import QuantizedTensor

    cfg = compose("mxfp8_adamw_cpu.yaml", [f"data.cache_dir={cache_dir}"])
    factory = build_factory(cfg.precision, num_layers=cfg.model.num_layers)
    model = build_model(cfg, factory)
    w = model.layers[0].self_attention.linear_qkv.weight
    assert isinstance(w, QuantizedTensor)
    init = w.high_precision_init_value().float().clone()
    opt = loop._MasterOptimizer(model, cfg)
    idx = next(i for i, p in enumerate(opt.params) if p is w)
    assert torch.equal(opt.masters[idx], init)
    assert not torch.equal(w.dequantize(), init)  # the bytes alone would lose the init
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length))
    with model.autocast():
        loss, _ = model(tokens, labels=tokens)
    loss.backward()
    opt.step(1e-3)
    fresh = quantize(opt.masters[idx].to(torch.bfloat16), factory.recipe, role="weight")
    assert torch.equal(w.dequantize(), fresh.dequantize())
    assert not torch.equal(opt.masters[idx], init)


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
