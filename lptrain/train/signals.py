"""Graceful stop on SIGTERM / SIGUSR1 (SLURM preemption) and SIGINT (Ctrl-C).

A handler only records the signal; the loop checks :meth:`StopWatcher.poll` after each step,
so the current step finishes, then the loop saves (SIGTERM/SIGUSR1 when ``checkpoint.save``
is set; SIGINT only with ``checkpoint.save_on_interrupt``), writes the summary and plots, and
raises :class:`TrainingInterrupted` -- a ``SystemExit`` with the documented status:

* 143 (128 + SIGTERM) for SIGTERM and SIGUSR1: "stopped by the scheduler, resumable";
* 130 (128 + SIGINT) for SIGINT.

A second SIGINT raises ``KeyboardInterrupt`` at once (the user insists). With several ranks
the stop decision is all-reduced (MAX) every step, so every rank stops after the same step
even when only one of them got the signal. The watcher stays installed while the loop writes
its summary and plots, and after a signal-driven stop every rank waits for the main rank to
finish them: a launcher ends the other ranks (SIGTERM) as soon as the first one exits, which
must not cost the main rank its files. The launch then exits 143/130 too
(:mod:`lptrain.launch.exit_status`).
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any

import torch

EXIT_SIGTERM = 143  # lptrain.errors: terminated (SIGTERM/SIGUSR1), resumable
EXIT_SIGINT = 130  # lptrain.errors: interrupted (SIGINT)

_CODES = {signal.SIGTERM: 1, signal.SIGUSR1: 2, signal.SIGINT: 3}
_BY_CODE = {v: k for k, v in _CODES.items()}


class TrainingInterrupted(SystemExit):
    """Raised by the loop after a signal-triggered stop (summary written, checkpoint saved)."""

    def __init__(self, signum: int, summary: dict[str, Any]) -> None:
        code = EXIT_SIGINT if signum == signal.SIGINT else EXIT_SIGTERM
        super().__init__(code)
        self.signum = signum
        self.summary = summary


class StopWatcher:
    """Records SIGTERM/SIGUSR1/SIGINT and decides, once per step, whether to stop now."""

    def __init__(self, exit_duration_mins: float | None = None) -> None:
        self.received: int | None = None
        self._old: dict[int, Any] = {}
        self._deadline = (
            time.monotonic() + 60.0 * exit_duration_mins if exit_duration_mins else None
        )

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt
        if self.received is None or signum == signal.SIGINT:
            self.received = signum

    def __enter__(self) -> StopWatcher:
        if threading.current_thread() is threading.main_thread():
            for s in _CODES:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    def poll(self, device: torch.device | None = None) -> tuple[int | None, bool]:
        """``(signal or None, time_is_up)`` agreed on by every rank."""
        sig = _CODES.get(self.received, 0) if self.received is not None else 0
        late = int(self._deadline is not None and time.monotonic() >= self._deadline)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([sig, late], dtype=torch.int64, device=device or "cpu")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            sig, late = int(t[0]), int(t[1])
        return _BY_CODE.get(sig), bool(late)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
