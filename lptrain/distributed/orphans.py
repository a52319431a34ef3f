"""A rank never outlives its launcher.

Why: a launcher killed with SIGKILL (``kill -9``, the OOM killer) left its ranks running
under PID 1, holding the run folder's lock and the GPUs, training into a job nobody watches.
Linux can send a process a signal when its parent dies (``prctl(PR_SET_PDEATHSIG)``); every
rank asks for SIGTERM, so orphaned ranks stop as on a preemption (they agree on the stop,
save when ``checkpoint.save`` is set, and exit 143).

The request must not come too late: a launcher that died before it lets the rank run on. So
lptrain's launchers put their pid in the environment (:data:`LAUNCHER_PID_ENV`), and a rank
whose parent is no longer that pid once the request is in place stops at once. Torch-free, so
the CLI makes the request before it imports anything heavy.
"""

from __future__ import annotations

import os
import signal
import sys

LAUNCHER_PID_ENV = "LPTRAIN_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher() -> bool:
    """Ask for SIGTERM when this process's launcher dies; whether the request is in place."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    expected = os.environ.get(LAUNCHER_PID_ENV)
    parent = int(expected) if expected and expected.isdigit() else os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
    return True
