"""What the main rank prints while it trains: a rich progress bar on a terminal, plain
lines otherwise (logs, CI), and the throughput averaged between two console lines.

Only the main rank prints; the other ranks get a :class:`RunLog` that says nothing, so the
loop calls it the same way on every rank.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from lptrain.config.schema import LPTrainConfig


class RunLog:
    """Console output of the main rank: a rich progress bar on a terminal (with
    ``logging.progress``), plain flushed lines else."""

    def __init__(self, main: bool, cfg: LPTrainConfig) -> None:
        self.main = main
        self.tty = sys.stdout.isatty()
        self.progress: Any = None
        self.task: Any = None
        if main and cfg.logging.progress and self.tty:
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.progress = Progress(
                TextColumn("[progress.description]{task.description}"), BarColumn(),
                TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                TimeRemainingColumn(),
            )

    def start(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress.start()
            self.task = self.progress.add_task("training", total=total, completed=done)

    def advance(self, loss: Optional[float]) -> None:
        if self.progress is not None:
            desc = f"training loss {loss:.3f}" if loss is not None else "training"
            self.progress.update(self.task, advance=1, description=desc)

    def rewind(self, done: int) -> None:
        """A rollback: the bar goes back to ``done`` steps."""
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, completed=done)

    def line(self, text: str) -> None:
        if not self.main:
            return
        if self.progress is not None:
            self.progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


class LogWindow:
    """Step times and tokens since the last console line, so that the line reports the
    throughput of all the steps it stands for, not of the last one alone."""

    def __init__(self) -> None:
        self._steps: list[tuple[float, int]] = []

    def add(self, step_time_s: float, tokens: int) -> None:
        self._steps.append((step_time_s, tokens))

    def take(self) -> tuple[float, float]:
        """``(tokens/s, seconds/step)`` over the window, which starts afresh."""
        secs = sum(s[0] for s in self._steps)
        rates = (sum(s[1] for s in self._steps) / secs, secs / len(self._steps))
        self._steps.clear()
        return rates
