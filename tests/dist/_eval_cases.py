"""Rank-side functions of the eval-vs-world-size test (module level: they are pickled)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _engine_and_loaders(recipe: str, overrides: Sequence[str]) -> tuple[Any, Any, Any, Any]:
    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.data import build_train_valid_loaders
    from lptrain.train.engine import TrainEngine

    cfg = derive(load(recipe, list(overrides)).cfg, World.detect())
    engine = TrainEngine(cfg)
    t = cfg.train
    train, valid = build_train_valid_loaders(
        cfg.data, seq_length=cfg.model.seq_length, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size, dp_rank=engine.dp_rank, dp_size=engine.dp_size,
        vocab_size=cfg.model.vocab_size)
    assert valid is not None
    return cfg, engine, train, valid


def _measure(cfg: Any, engine: Any, valid: Any) -> dict[str, Any]:
    """The validation loss as the loop computes it (``eval_micro_batches`` per rank), the
    samples it read, and the loss with the old per-rank count (``eval_iters`` micro-batches
    on every rank) to show the test can fail."""
    from lptrain.data import eval_micro_batches

    valid.load_state_dict({"consumed_samples": 0})
    loss = engine.evaluate(valid, eval_micro_batches(valid, cfg.train.eval_iters))
    samples = valid.consumed_samples
    valid.load_state_dict({"consumed_samples": 0})
    per_rank_count = engine.evaluate(valid, cfg.train.eval_iters)
    return {"loss": loss, "samples": samples, "per_rank_count": per_rank_count}


def train_at_one_rank(recipe: str, overrides: Sequence[str], steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``steps`` steps at one rank (so the evaluated model's per-sample losses differ, as a
    real run's do): the global checkpoint state and the DP=1 measurement."""
    cfg, engine, train, valid = _engine_and_loaders(recipe, overrides)
    n = cfg.train.global_batch_size // cfg.train.micro_batch_size
    for step in range(1, steps + 1):
        engine.train_step([next(train) for _ in range(n)], step)
    return engine.checkpoint_state()["global"], _measure(cfg, engine, valid)


def evaluate(rank: int, world: int, weights: dict[str, dict[str, Any]],
             overrides: Sequence[str]) -> dict[str, Any]:
    """Per recipe, :func:`_measure` of ``weights`` loaded into this world's engine."""
    out: dict[str, Any] = {}
    for recipe, state in weights.items():
        cfg, engine, _, valid = _engine_and_loaders(recipe, overrides)
        engine.load_checkpoint_state({"global": state, "local": None})
        out[recipe] = _measure(cfg, engine, valid)
    return out
