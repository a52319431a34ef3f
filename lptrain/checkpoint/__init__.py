"""Checkpoints: DCP for the engine's replicated ("global") state, one torch.save file per rank
for its local state (RNG), a completion marker written last, a ``latest`` pointer after it,
pruning to ``checkpoint.keep_latest``, and fallback past incomplete or corrupt folders.
See :mod:`lptrain.checkpoint.store`."""

from lptrain.checkpoint.store import (
    Candidates,
    CheckpointError,
    CheckpointSaveError,
    find_checkpoints,
    load_checkpoint,
    prune,
    read_train_state,
    save_checkpoint,
    step_dir_name,
    step_dirs,
    validate,
    verify,
)

__all__ = [
    "Candidates",
    "CheckpointError",
    "CheckpointSaveError",
    "find_checkpoints",
    "load_checkpoint",
    "prune",
    "read_train_state",
    "save_checkpoint",
    "step_dir_name",
    "step_dirs",
    "validate",
    "verify",
]
