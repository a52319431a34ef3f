"""Rank-side functions of the precision-aware optimizer battery (module-level: pickled).

One spawned world runs every case (start-up costs seconds, a tiny step milliseconds); each
case trains a few steps and, where asked, checkpoints in memory after step 2 and resumes a
fresh engine from it for step 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import _engine_cases as C
import torch

SMALL = [*C.BASE, "model.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=4"]
PAO = ["optimizer.use_precision_aware_optimizer=true", *C.DISTOPT]
# TE holds the masters (bf16 GEMMs): fp32 masters as remainders, FP8 first moment, bf16 grads
TE_HELD = [*PAO, "optimizer.exp_avg_dtype=fp8", "optimizer.exp_avg_sq_dtype=bf16",
           "optimizer.main_grads_dtype=bf16"]
# lptrain holds fp32 masters (MXFP8 with FP8 primary weights gathered through the grad buffer)
MXFP8_PG = [*C.MXFP8, *C.FP8_PG, *C.REUSE]


def _engine(overrides: Sequence[str]) -> Any:
    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.train.engine import TrainEngine

    return TrainEngine(derive(load(C.TINY, [*SMALL, *overrides]).cfg, World.detect()))


def _batches(engine: Any, step: int) -> list[dict[str, torch.Tensor]]:
    """Fixed synthetic micro-batches of ``step`` for this data-parallel rank (the same global
    batch at every data-parallel size)."""
    cfg = engine.cfg
    g = torch.Generator().manual_seed(1000 * step)
    n = cfg.train.global_batch_size // cfg.train.micro_batch_size
    tok = torch.randint(0, cfg.model.vocab_size, (n, cfg.train.micro_batch_size, cfg.model.seq_length + 1),
                        generator=g)
    per = n // engine.dp_size
    mine = tok[engine.dp_rank * per:(engine.dp_rank + 1) * per]
    return [{"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()} for t in mine]


def _step(engine: Any, step: int) -> tuple[float, float]:
    res = engine.train_step(_batches(engine, step), step)
    return res.loss, res.grad_norm


def _masters(engine: Any) -> dict[str, torch.Tensor]:
    with engine.params_synced():
        return engine.checkpoint_state()["global"]["model"]


def run_case(overrides: Sequence[str], resume: bool) -> dict[str, Any]:
    """Two steps (losses, grad norms, final fp32 masters, the saved state dtypes); with
    ``resume``, step 2 again from an in-memory checkpoint of step 1 in a fresh engine, and the
    load's notes."""
    e = _engine(overrides)
    out: dict[str, Any] = {"steps": [_step(e, 1)]}
    state = e.checkpoint_state() if resume else None
    out["steps"].append(_step(e, 2))
    out["masters"] = _masters(e)
    out["finite"] = all(bool(torch.isfinite(v).all()) for v in out["masters"].values())
    if state is not None:
        out["dtypes"] = state["global"]["optimizer_state_dtypes"]
        out["moment_dtypes"] = sorted({str(v.dtype) for entry in state["global"]["optimizer"].values()
                                       for k, v in entry.items()
                                       if k in ("exp_avg", "exp_avg_sq", "momentum_buffer")})
        f = _engine(overrides)
        out["notes"] = f.load_checkpoint_state(state)
        out["resumed"] = _step(f, 2)
        out["resumed_masters"] = _masters(f)
        out["state"] = state["global"]  # for a resume at another layout (the parent)
    return out


def run_battery(rank: int, world: int, cases: dict[str, tuple[Sequence[str], bool]]) -> dict[str, Any]:
    """``{case: run_case(...)}``; the saved states are returned by rank 0 only."""
    torch.manual_seed(0)
    out = {name: run_case(ov, resume) for name, (ov, resume) in cases.items()}
    if rank != 0:
        for r in out.values():
            r.pop("state", None)
    return out


def run_single(overrides: Sequence[str], state: dict[str, Any] | None = None) -> dict[str, Any]:
    """In this process (one rank): two steps, or step 2 from ``state`` (another layout)."""
    if state is None:
        return run_case(overrides, resume=False)
    f = _engine(overrides)
    notes = f.load_checkpoint_state({"global": state, "local": None})
    return {"notes": notes, "resumed": _step(f, 2), "masters": _masters(f)}
