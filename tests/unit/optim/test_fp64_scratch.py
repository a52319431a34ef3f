"""The grad norms' fp64 casts go through a kept CPU buffer and give the bits fresh casts give.

``fp64_copy`` replaces a fresh fp64 allocation per bucket per step (page-faulted in on the
CPU) by a buffer kept across calls. The values must not change: the cast is exact, so the
copy equals ``double()`` bit for bit, and a whole training run's grad norms and weights are
the same with the kept buffer as with a fresh cast each time (``MAX_KEPT_ELEMS`` patched to 0).
"""

from __future__ import annotations

import pytest
import torch

from lptrain.config import World, compose, derive
from lptrain.optim import fp64_scratch
from lptrain.optim.fp64_scratch import fp64_copy


def test_the_copy_is_the_exact_fp64_cast_flattened() -> None:
    g = torch.randn(6, 7) * 1e-30
    g[0, 0], g[1, 1], g[2, 2] = float("inf"), float("nan"), -0.0
    out = fp64_copy(g)
    assert out.shape == (42,) and out.dtype == torch.float64
    assert torch.equal(out.view(torch.int64), g.double().reshape(-1).view(torch.int64))


def test_the_buffer_is_kept_across_calls_and_grown_to_the_largest() -> None:
    a = fp64_copy(torch.ones(10))
    b = fp64_copy(torch.full((4,), 2.0))
    assert b.data_ptr() == a.data_ptr()  # the same kept storage, reused
    assert torch.equal(b, torch.full((4,), 2.0, dtype=torch.float64))
    c = fp64_copy(torch.arange(1000, dtype=torch.float32))  # larger: the buffer grows once
    d = fp64_copy(torch.arange(500, dtype=torch.float32))
    assert d.data_ptr() == c.data_ptr()
    assert torch.equal(d, torch.arange(500, dtype=torch.float64))


def test_above_the_cap_the_cast_is_fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    kept = fp64_copy(torch.ones(8))
    monkeypatch.setattr(fp64_scratch, "MAX_KEPT_ELEMS", 4)
    fresh = fp64_copy(torch.ones(8))
    assert fresh.data_ptr() != kept.data_ptr()
    assert torch.equal(fresh, torch.ones(8, dtype=torch.float64))


BASE = ["data.builtin_max_mb=1", "logging.progress=false", "model.seq_length=32",
        "checkpoint.save=null", "ddp.use_distributed_optimizer=true"]


def _run(ov: list[str], steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    from lptrain.data import build_train_valid_loaders
    from lptrain.train.engine import TrainEngine

    cfg = derive(compose("tiny_cpu.yaml", [*BASE, *ov]), World.detect())
    engine = TrainEngine(cfg)
    t = cfg.train
    it, _ = build_train_valid_loaders(
        cfg.data, seq_length=cfg.model.seq_length, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size, dp_rank=0, dp_size=1, vocab_size=cfg.model.vocab_size)
    n = t.global_batch_size // t.micro_batch_size
    norms = [engine.train_step([next(it) for _ in range(n)], s + 1).grad_norm for s in range(steps)]
    return norms, [p.detach().clone() for p in engine.model.parameters()]


@pytest.mark.parametrize("ov", [[], ["optimizer.name=muon"]], ids=["adamw", "layer_wise_muon"])
def test_training_with_the_kept_buffer_equals_fresh_casts(monkeypatch: pytest.MonkeyPatch, ov: list[str]) -> None:
    kept_norms, kept_params = _run(ov)
    monkeypatch.setattr(fp64_scratch, "MAX_KEPT_ELEMS", 0)  # every cast fresh, as before
    fresh_norms, fresh_params = _run(ov)
    assert kept_norms == fresh_norms  # bitwise (Python floats from the same fp64 values)
    assert all(torch.equal(a, b) for a, b in zip(kept_params, fresh_params, strict=True))
