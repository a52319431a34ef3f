"""The exit status of a multi-rank launch, from its ranks' exit statuses.

Why: a launcher (torch's elastic agent, ``torchrun``) reports any non-zero rank as a failure,
so a run stopped by SIGTERM -- every rank saved and exited 143 -- ended as "failed" (exit 3
locally, 1 from ``torchrun``, FAILED in SLURM). The rule here:

* every failed rank exited 143 or 130 (a signal-driven stop, checkpoint saved): the launch
  exits with that status (143 wins over 130), so schedulers see a preemption;
* any other failure (a crash, a rank killed with SIGKILL, a rank that exited 3): the run
  failed, exit 3, naming the first failed rank.

A rank killed by a signal it did not handle shows as a negative exit code (-15 for SIGTERM);
it is a failure like any other, except that -15/-2 count as 143/130 (a rank that received
SIGTERM before it installed its handler).
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from typing import Optional

from lptrain.errors import EXIT_SIGINT, EXIT_SIGTERM

SIGNAL_STATUSES = (EXIT_SIGTERM, EXIT_SIGINT)


def normalized(exitcode: int) -> int:
    """A rank's exit code as a shell reports it: 128 + N for a death by signal N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def describe(exitcode: int) -> str:
    """``exit 143`` or ``exit 137 (SIGKILL)``: how a rank ended, for one error line, as a
    shell and a survivor's ``lost peer`` line give it (128 + N for a death by signal N; the
    launcher's own code for it is -N)."""
    if exitcode < 0:
        try:
            return f"exit {normalized(exitcode)} ({signal.Signals(-exitcode).name})"
        except ValueError:
            return f"exit {normalized(exitcode)} (signal {-exitcode})"
    return f"exit {exitcode}"


def signal_stop_status(exitcodes: Iterable[int]) -> Optional[int]:
    """143 or 130 when every failed rank stopped on a signal, else None (a real failure)."""
    codes = {normalized(c) for c in exitcodes if c != 0}
    if not codes or not codes <= set(SIGNAL_STATUSES):
        return None
    return EXIT_SIGTERM if EXIT_SIGTERM in codes else EXIT_SIGINT
