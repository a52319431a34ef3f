"""The quantizers' stochastic-rounding generators are found by name, saved and restored
(``lptrain.precision.rng`` through ``TrainEngine.checkpoint_state``), and recipes without
them are left untouched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lptrain.config import World, compose, derive
from lptrain.precision.rng import rng_generators
from lptrain.train.engine import TrainEngine


def _engine(recipe: str, cache: Path) -> TrainEngine:
    ov = [f"data.cache_dir={cache}", "data.builtin_max_mb=1", "model.seq_length=64"]
    return TrainEngine(derive(compose(recipe, ov), World.detect()))


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, 65), generator=g)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def test_nvfp4_streams_saved_and_restored(tmp_path: Path) -> None:
    engine = _engine("nvfp4_adamw_cpu.yaml", tmp_path)
    fresh = engine.checkpoint_state()["local"]["quantizer_rng"]
    # before any forward: the quantized layer's grad quantizers are created to be named
    assert fresh and all(k.endswith(".grad") for k in fresh)
    engine.train_step([_batch(), _batch()], 1)
    after = engine.checkpoint_state()
    moved = after["local"]["quantizer_rng"]
    assert moved.keys() == fresh.keys()
    assert any(not torch.equal(moved[k], fresh[k]) for k in moved), "SR streams did not advance"
    other = _engine("nvfp4_adamw_cpu.yaml", tmp_path)
    other.load_checkpoint_state(after)
    got = other.checkpoint_state()["local"]["quantizer_rng"]
    assert all(torch.equal(got[k], moved[k]) for k in moved)


@pytest.mark.parametrize("recipe", ["tiny_cpu.yaml", "fp8_delayed_cpu.yaml"])
def test_recipes_without_streams_untouched(recipe: str, tmp_path: Path) -> None:
    engine = _engine(recipe, tmp_path)
    recipe_obj = getattr(engine.model.factory, "recipe", None)
    assert rng_generators(engine.model, recipe_obj) == {}
    # no quantizer state was created early (delayed scaling keeps its state lazily)
    assert all(not getattr(m, "_qstates", {}) for m in engine.model.modules())
