"""Training loop entry points (imported lazily by the CLI)."""

from lptrain.train.loop import TrainingDivergedError, pretrain

__all__ = ["TrainingDivergedError", "pretrain"]
