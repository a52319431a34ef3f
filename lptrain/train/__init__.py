"""Training loop entry points (imported lazily by the CLI)."""

from lptrain.train.engine import TrainingDivergedError
from lptrain.train.loop import pretrain
from lptrain.train.signals import TrainingInterrupted

__all__ = ["TrainingDivergedError", "TrainingInterrupted", "pretrain"]
