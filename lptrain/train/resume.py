"""Loading a run's checkpoint into the engine, falling back past the ones that fail.

Shared by the resume at start-up, a rollback (``train.on_anomaly=rollback``) and ``lptrain
replay``: each tries checkpoints newest first, and a checksum mismatch, a file refused by the
restricted reader (:mod:`lptrain.checkpoint.restricted`) or a state the engine cannot take
makes every rank fall back to the next one together, saying why.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lptrain.checkpoint import CheckpointError, load_checkpoint

if TYPE_CHECKING:
    from lptrain.train.console import RunLog
    from lptrain.train.engine import TrainEngine


class NoCheckpointLoaded(CheckpointError):
    """Every candidate failed, on every rank alike (they agreed after each try): rank 0 says
    it, once for the job (exit 2)."""

    every_rank = True


def resume(engine: TrainEngine, candidates: list[Path], log: RunLog,
           load_optimizer: bool = True) -> dict[str, Any]:
    """Load the newest loadable checkpoint into the engine; returns its train state.

    Any failure on any rank -- a checksum mismatch, an unreadable or refused file, a load
    error -- falls back to the next older checkpoint on every rank (they agree after each
    try), naming the file and what failed; none left is :class:`NoCheckpointLoaded`.
    ``load_optimizer=False`` keeps the weights and drops the saved optimizer state
    (``checkpoint.load_optimizer=false``)."""
    failures = []
    for i, folder in enumerate(candidates):
        error = None
        notes: list[str] = []
        try:
            state, train_state = load_checkpoint(folder, engine.rank, engine.world_size)
            if not load_optimizer:
                state["global"]["optimizer"] = {}
            notes = engine.load_checkpoint_state(state)
        except (CheckpointError, KeyError, RuntimeError, ValueError) as e:
            error = str(e)
        error = _first_error(error)
        if error is not None:
            failures.append(error)
            nxt = candidates[i + 1] if i + 1 < len(candidates) else None
            log.line(f"warning: could not load checkpoint {folder} ({error}); "
                     + (f"falling back to {nxt}" if nxt else "no older valid checkpoint"))
            continue
        if not state["verified"]:
            log.line(f"note: {folder} has no checksums (written before lptrain recorded them): "
                     "its files could not be verified")
        if state["local"] is None:
            log.line(f"note: {folder} was written at world size {train_state.get('world_size')}; "
                     "per-rank RNG streams start afresh")
        if not load_optimizer:
            log.line("note: checkpoint.load_optimizer=false: the optimizer starts fresh from the "
                     "saved weights")
        for note in notes:  # optimizer state converted (lptrain.optim.precision_aware)
            log.line(f"warning: {note}")
        log.line(f"resuming from {folder} (step {train_state['iteration']})")
        return train_state
    raise NoCheckpointLoaded("no checkpoint could be loaded: " + "; ".join(failures))


def _first_error(error: Optional[str]) -> Optional[str]:
    """The first rank's error of this try (every rank gets the same answer)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return error
    errors: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)
