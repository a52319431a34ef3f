"""When the loop evaluates, prints, saves and stops: each decision as one small object.

Each policy is built from the config once and asked once per step, so the loop reads as a
sequence of steps and a decision can be tested without training. Steps count from 1.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Literal, Optional

from lptrain.config.schema import LPTrainConfig

StopReason = Literal["completed", "interrupted", "exit_duration", "exit_interval"]


@dataclass(frozen=True)
class EvalPolicy:
    """Validation loss every ``train.eval_interval`` steps and at the last step, when there
    is a validation split and ``train.eval_iters > 0``."""

    enabled: bool
    interval: Optional[int]
    last_step: int

    @classmethod
    def from_config(cls, cfg: LPTrainConfig, has_valid_split: bool) -> EvalPolicy:
        t = cfg.train
        return cls(has_valid_split and t.eval_iters > 0, t.eval_interval, t.train_iters)

    def due(self, step: int) -> bool:
        return self.enabled and (
            step == self.last_step or bool(self.interval and step % self.interval == 0)
        )


@dataclass(frozen=True)
class LogPolicy:
    """A console line every ``train.log_interval`` steps and at the last step (0: never)."""

    interval: Optional[int]
    last_step: int

    @classmethod
    def from_config(cls, cfg: LPTrainConfig) -> LogPolicy:
        return cls(cfg.train.log_interval, cfg.train.train_iters)

    def due(self, step: int) -> bool:
        return bool(self.interval) and (step % self.interval == 0 or step == self.last_step)


@dataclass(frozen=True)
class NumericsPolicy:
    """Quantization statistics every ``logging.numerics_interval`` steps (0: never)."""

    interval: int

    @classmethod
    def from_config(cls, cfg: LPTrainConfig) -> NumericsPolicy:
        return cls(cfg.logging.numerics_interval)

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0


@dataclass(frozen=True)
class StopPolicy:
    """Why the job stops after this step, if it does. A signal comes first (every rank got
    it, the watcher all-reduced it), then the last step, then ``train.exit_duration_mins``
    (the watcher's ``late``), then ``train.exit_interval`` steps in this job."""

    last_step: int
    exit_interval: Optional[int]

    @classmethod
    def from_config(cls, cfg: LPTrainConfig) -> StopPolicy:
        return cls(cfg.train.train_iters, cfg.train.exit_interval)

    def reason(self, step: int, job_steps: int, signum: Optional[int], late: bool) -> Optional[StopReason]:
        if signum is not None:
            return "interrupted"
        if step >= self.last_step:
            return "completed"
        if late:
            return "exit_duration"
        if self.exit_interval and job_steps >= self.exit_interval:
            return "exit_interval"
        return None


@dataclass(frozen=True)
class SavePolicy:
    """A checkpoint every ``checkpoint.save_interval`` steps and whenever the job stops,
    except after Ctrl-C without ``checkpoint.save_on_interrupt``; never without
    ``checkpoint.save``."""

    folder: Optional[str]
    interval: Optional[int]
    on_interrupt: bool

    @classmethod
    def from_config(cls, cfg: LPTrainConfig) -> SavePolicy:
        ck = cfg.checkpoint
        return cls(ck.save, ck.save_interval, ck.save_on_interrupt)

    def due(self, step: int, stop: Optional[StopReason], signum: Optional[int]) -> bool:
        if not self.folder:
            return False
        if self.interval and step % self.interval == 0:
            return True
        if stop == "interrupted":
            return signum != signal.SIGINT or self.on_interrupt
        return stop is not None
