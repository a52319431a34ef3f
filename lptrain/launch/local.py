"""Starting a multi-process run on this host.

:func:`launch_local` is what ``lptrain pretrain --nproc-per-node N`` does: it runs N copies
of ``python -m lptrain pretrain ...`` through torch's elastic launcher (the API behind
``torchrun``) with a c10d rendezvous on this host. When any rank fails, the agent ends the
others and the launch exits with that rank's status: a rank that printed its own error line
(exit 1, 2, 3 or 70) is not repeated; a rank that could not (killed by a signal) is named in
one line, exit 3. Each rank then joins the
world from its environment (:mod:`lptrain.distributed.launch_env`, which also provides
:func:`world_from_env`). Ranks that all stopped on SIGTERM/SIGINT (checkpoint saved) make the
launch exit 143/130, not "failed" (:mod:`lptrain.launch.exit_status`).
"""

from __future__ import annotations

import signal
import sys
import uuid
from collections.abc import Sequence
from typing import Any

from lptrain.distributed.launch_env import world_from_env
from lptrain.errors import (
    EXIT_INPUT,
    EXIT_INTERNAL,
    EXIT_RULES,
    EXIT_RUN_FAILED,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    RunFailedError,
)
from lptrain.launch.exit_status import SIGNAL_STATUSES, describe, normalized, signal_stop_status
from lptrain.launch.peers import publish_peer_exits
from lptrain.launch.torchrun import quiet_agent_logs
from lptrain.launch.watchdog import HANG_FIX, watching

__all__ = ["launch_local", "world_from_env"]

# A rank that exits with one of these went through lptrain's error surface: its one line (or,
# for 70, its traceback) is on stderr already, and the launch exits with the same status.
SPOKEN_STATUSES = (EXIT_RULES, EXIT_INPUT, EXIT_RUN_FAILED, EXIT_INTERNAL)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_local(nproc: int, args: Sequence[str]) -> int:
    """Run ``python -m lptrain *args`` on ``nproc`` local ranks; 0 when all succeed.

    A failing rank makes the elastic agent stop the others (no hang). A rank that printed
    its own error line makes this exit with its status (``SystemExit``); one that died
    without a word (a signal) makes it raise :class:`RunFailedError` naming the rank and how
    it ended (the CLI exits 3).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"lptrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
    )
    # (no OMP_NUM_THREADS: each rank takes its share of the CPUs, lptrain.distributed.threads)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    quiet_agent_logs()

    try:
        # the watchdog names a rank without progress; a survivor names how its lost peer ended
        with watching(nproc) as dog, publish_peer_exits():
            elastic_launch(config, sys.executable)("-m", "lptrain", *args)
    except SignalException as e:
        # SIGTERM/SIGINT to the launcher: the agent forwarded it to the ranks (which save a
        # checkpoint and stop) and stopped them; exit as the ranks do (130 SIGINT, else 143).
        raise SystemExit(EXIT_SIGINT if e.sigval == signal.SIGINT else EXIT_SIGTERM) from None
    except ChildFailedError as e:
        if dog.fired:  # it killed the ranks: its line is the one to say
            raise RunFailedError(dog.message or "", fix=HANG_FIX) from None
        status = signal_stop_status(f.exitcode for f in e.failures.values())
        if status is not None:  # every failed rank stopped on SIGTERM/SIGINT, checkpoint saved
            raise SystemExit(status) from None
        rank, failure = _first_real_failure(e.failures)
        if failure.exitcode in SPOKEN_STATUSES:  # the rank printed its own line: nothing to add
            raise SystemExit(failure.exitcode) from None
        raise RunFailedError(
            f"rank {rank} of {nproc} failed with {describe(failure.exitcode)}; the other "
            "ranks were stopped (its error, if it could print one, is above)",
            fix="see the failing rank's error line above",
        ) from None
    return 0


def _first_real_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """The earliest rank that failed other than by a signal-driven stop (a rank the agent
    stopped after the failure exits 143 too, later)."""
    real = {r: f for r, f in failures.items() if normalized(f.exitcode) not in SIGNAL_STATUSES}
    pool = real or failures
    rank = min(pool, key=lambda r: pool[r].timestamp)
    return rank, pool[rank]
