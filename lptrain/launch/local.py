"""Starting a multi-process run on this host.

:func:`launch_local` is what ``lptrain pretrain --nproc-per-node N`` does: it runs N copies
of ``python -m lptrain pretrain ...`` through torch's elastic launcher (the API behind
``torchrun``) with a c10d rendezvous on this host. When any rank fails, the agent ends the
others and the launch exits with that rank's status: a rank that printed its own error line
(exit 1, 2, 3 or 70) is not repeated; a rank that could not (killed by a signal) is named in
one line, exit 3 -- by a survivor's ``lost peer`` line when one printed it, else here. Each rank then joins the
world from its environment (:mod:`lptrain.distributed.launch_env`, which also provides
:func:`world_from_env`). Ranks that all stopped on SIGTERM/SIGINT (checkpoint saved) make the
launch exit 143/130, not "failed" (:mod:`lptrain.launch.exit_status`).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import os
import signal
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
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
from lptrain.launch.peers import publish_peer_exits, rank_spoke
from lptrain.launch.torchrun import quiet_agent_logs
from lptrain.launch.watchdog import HANG_FIX, watching

__all__ = ["launch_local", "rank_environment", "world_from_env"]

# Set for the ranks of a launch whose launcher printed the rule report (warnings included):
# they validate again but do not print it a second time.
REPORTED_ENV = "LPTRAIN_RULES_REPORTED"

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
        with watching(nproc) as dog, publish_peer_exits(), _environment(rank_environment()):
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
        if rank_spoke():  # a survivor's "lost peer" line already named the killed rank
            raise SystemExit(EXIT_RUN_FAILED) from None
        raise RunFailedError(
            f"rank {rank} of {nproc} failed with {describe(failure.exitcode)}; the other "
            "ranks were stopped (its error, if it could print one, is above)",
            fix="see the failing rank's error line above",
        ) from None
    return 0


def rank_environment() -> dict[str, str]:
    """The variables the ranks start with so that ``python -m lptrain`` imports this lptrain
    whatever the current folder holds.

    ``-m`` puts the current folder first on ``sys.path``: a folder there named ``lptrain``
    (an empty one, or the clone itself seen from its parent folder) became a namespace
    package in every rank when lptrain is installed in editable mode (its finder comes after
    the path scan), and the ranks crashed at their first import (exit 70).
    ``PYTHONSAFEPATH`` (Python 3.11+) leaves the current folder off ``sys.path``; where this
    lptrain is not a regular package on the rest of the path (an editable install, or a
    checkout used as the current folder), its folder goes first on ``PYTHONPATH`` too (which
    also covers Python 3.10). The launcher's rule report is not printed again by the ranks."""
    import lptrain

    env = {"PYTHONSAFEPATH": "1", REPORTED_ENV: "1"}
    root = str(Path(lptrain.__file__).resolve().parents[1])
    cwd = os.path.realpath(os.getcwd())
    rest = [p for p in sys.path if p and os.path.realpath(p) != cwd]
    spec = importlib.machinery.PathFinder.find_spec("lptrain", rest)
    if spec is None or spec.origin is None or Path(spec.origin).resolve().parents[1] != Path(root):
        old = os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = root + (os.pathsep + old if old else "")
    return env


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` (what the spawned ranks inherit) for the launch only."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _first_real_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """The earliest rank that failed other than by a signal-driven stop (a rank the agent
    stopped after the failure exits 143 too, later)."""
    real = {r: f for r, f in failures.items() if normalized(f.exitcode) not in SIGNAL_STATUSES}
    pool = real or failures
    rank = min(pool, key=lambda r: pool[r].timestamp)
    return rank, pool[rank]
