"""Rank-side functions for the sharding-strategy and recompute tests (module-level: pickled).

Several configurations run inside one spawned world (start-up costs seconds, a tiny step
milliseconds); the parent test compares the plain results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import _engine_cases as C
import torch

from lptrain.testing.parity import first_difference, train_steps


def run_matrix(rank: int, world: int, cases: dict[str, Sequence[str]], steps: int = 2) -> dict[str, Any]:
    """``{case: train_steps(...)}``, each result reduced to what the parity test compares."""
    keep = ("losses", "grad_norms", "masters", "logits", "raw")
    out = {}
    for name, ov in cases.items():
        r = train_steps(C.TINY, [*C.BASE, *ov], steps=steps)
        out[name] = {k: r[k] for k in keep}
    return out


def _engine(overrides: Sequence[str]) -> Any:
    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.train.engine import TrainEngine

    return TrainEngine(derive(load(C.TINY, [*C.BASE, *overrides]).cfg, World.detect()))


def _batches(engine: Any, step: int) -> list[dict[str, torch.Tensor]]:
    """Fixed synthetic micro-batches of ``step`` for this data-parallel rank."""
    cfg = engine.cfg
    g = torch.Generator().manual_seed(1000 * step + engine.dp_rank)
    n = cfg.train.global_batch_size // (cfg.train.micro_batch_size * engine.dp_size)
    out = []
    for _ in range(n):
        tok = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.seq_length + 1),
                            generator=g)
        out.append({"tokens": tok[:, :-1].contiguous(), "labels": tok[:, 1:].contiguous()})
    return out


def run_resume_across(rank: int, world: int, base: Sequence[str], strategies: Sequence[str]) -> dict[str, Any]:
    """Train 2 steps under ``strategies[0]``, save, then for every strategy of
    ``strategies[1:]``: a fresh engine loads the checkpoint and trains step 3. ``continued``
    is the saving engine's own step 3."""
    first = _engine([*base, f"ddp.data_parallel_sharding_strategy={strategies[0]}"])
    for step in (1, 2):
        first.train_step(_batches(first, step), step)
    with first.params_synced():
        state = first.checkpoint_state()
    out: dict[str, Any] = {}
    res = first.train_step(_batches(first, 3), 3)
    out["continued"] = (res.loss, res.grad_norm, first.checkpoint_state()["global"]["model"])
    for s in strategies[1:]:
        e = _engine([*base, f"ddp.data_parallel_sharding_strategy={s}"])
        e.load_checkpoint_state(state)
        res = e.train_step(_batches(e, 3), 3)
        out[s] = (res.loss, res.grad_norm, e.checkpoint_state()["global"]["model"])
    return out


def run_memory(rank: int, world: int, base: Sequence[str], strategies: Sequence[str]) -> dict[str, Any]:
    """Per strategy: this rank's measured breakdown after one step, the layout's kept grad
    elements (params + padding) for this rank from the planner's accounting, the Muon
    buffers' bytes, and the measured persistent categories with ``estimate-memory``'s."""
    from lptrain.memory.accounting import kept_grad_elements
    from lptrain.memory.measure import measure_engine
    from lptrain.memory.plan import estimate_memory

    out = {}
    for s in strategies:
        e = _engine([*base, f"ddp.data_parallel_sharding_strategy={s}"])
        res = e.train_step(_batches(e, 1), 1)
        measured = measure_engine(e)
        planned = estimate_memory(e.cfg, world, "cpu").ranks[rank].bytes
        kept = [kept_grad_elements(b.spec, b.groups.intra.rank, b.groups.intra.size) for b in e.ddp.buffers]
        muon = [(b.spec.numel, b.nbytes()) for b in e.ddp.buffers if b.key.is_muon]
        out[s] = {"measured": e.memory_breakdown(), "kept": kept, "muon_buffers": muon,
                  "categories": measured, "planned": {k: planned[k] for k in measured},
                  "trained": (res.loss, res.grad_norm, e.checkpoint_state()["global"]["model"]),
                  "unpadded": sum(s.end - s.start for b in e.layout.buffers for s in b.params), "padded": e.layout.numel}
    return out


def same(a: Any, b: Any) -> Any:
    return first_difference(a, b)


def run_suite(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Everything one world checks: ``matrix`` (cases), ``eval`` (cases trained with an
    eval and a forced sync after every step), ``resume`` (``{name: (base overrides,
    strategies)}``) and ``memory`` (base overrides, strategies)."""
    out: dict[str, Any] = {}
    if "matrix" in spec:
        out["matrix"] = run_matrix(rank, world, spec["matrix"])
    if "eval" in spec:
        out["eval"] = {
            name: {k: v for k, v in train_steps(C.TINY, [*C.BASE, *ov], steps=2, eval_every=1,
                                                  sync_after=(1,)).items()
                   if k in ("losses", "grad_norms", "masters", "logits")}
            for name, ov in spec["eval"].items()
        }
    if "resume" in spec:
        out["resume"] = {name: run_resume_across(rank, world, *args) for name, args in spec["resume"].items()}
    if "memory" in spec:
        out["memory"] = run_memory(rank, world, *spec["memory"])
    return out
