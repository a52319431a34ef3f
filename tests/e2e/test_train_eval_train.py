"""Train-eval-train == train-only, bitwise, for every precision recipe (one rank).

Evaluation goes through ``engine.params_synced()`` and must leave every piece of training
state alone: delayed-scaling amax histories and scales, stochastic-rounding streams, router
counts, the global torch RNG, the param buffers. Three steps with an eval after each one
against three steps without: losses, grad norms, raw param bytes and fp32 masters compared
with ``torch.equal`` / float ``==`` (``first_difference``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lptrain.testing.parity import first_difference, train_steps

RECIPES = sorted(p.name for p in (Path(__file__).parents[2] / "lptrain" / "_recipes").glob("*_cpu.yaml"))


@pytest.fixture(scope="module")
def overrides(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    cache = tmp_path_factory.mktemp("cache")
    # one micro-batch of 4 x 64 tokens per step: every GEMM still whole FP8/FP4 blocks
    return [f"data.cache_dir={cache}", "data.builtin_max_mb=1", "logging.progress=false",
            "train.eval_iters=1", "train.global_batch_size=4", "train.micro_batch_size=4",
            "model.seq_length=64", "optimizer.warmup_iters=0"]


def test_every_cpu_recipe_is_covered() -> None:
    assert {"tiny_cpu.yaml", "fp8_delayed_cpu.yaml", "nvfp4_adamw_cpu.yaml", "moe_mxfp8_cpu.yaml",
            "mxfp8_muon_cpu.yaml"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_eval_every_step_changes_nothing(recipe: str, overrides: list[str]) -> None:
    with_eval = train_steps(recipe, overrides, steps=3, eval_every=1)
    without = train_steps(recipe, overrides, steps=3, eval_every=0)
    assert len(with_eval["losses"]) == 3
    assert first_difference(with_eval, without) is None, first_difference(with_eval, without)
