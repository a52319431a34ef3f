"""The single-process training loop: it learns, writes its outputs, and stops loudly on NaN."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lptrain.config import compose
from lptrain.train import TrainingDivergedError, pretrain


def _cfg(tmp_path: Path, *overrides: str):
    return compose(
        "tiny_cpu.yaml",
        [
            f"data.cache_dir={tmp_path / 'cache'}",
            "logging.progress=false",
            "train.eval_iters=2",
            *overrides,
        ],
    )


def test_loss_decreases_and_outputs_written(tmp_path: Path) -> None:
    summary = pretrain(_cfg(tmp_path, "train.train_iters=15"), tmp_path / "run")
    # 15 AdamW steps at lr 3e-4 on a byte-level corpus drop the loss by far more than 0.3
    # nats from ~ln(259)=5.56; a broken update (no step, wrong sign) would not.
    assert summary["final_loss"] < summary["first_loss"] - 0.3
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 15
    assert "val_loss" in json.loads(lines[-1])
    png = (tmp_path / "run" / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_nan_loss_stops_with_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
        pretrain(_cfg(tmp_path, "train.train_iters=5"), tmp_path / "run")


def test_nan_gradient_names_the_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lptrain.model as model_pkg

    real_build = model_pkg.build_model

    def build_with_bad_grad(cfg, factory=None):
        model = real_build(cfg, factory)
        model.final_norm.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        return model

    monkeypatch.setattr(model_pkg, "build_model", build_with_bad_grad)
    with pytest.raises(TrainingDivergedError, match=r"step 0: gradient of 'final_norm.weight'"):
        pretrain(_cfg(tmp_path, "train.train_iters=3"), tmp_path / "run")
