"""``python -m lptrain.launch.torchrun ARGS``: torchrun (``torch.distributed.run``, same
arguments) in the interpreter lptrain is installed in, with the exit status a scheduler
should see. The sbatch script of ``lptrain slurm`` runs it on every node.

Why not plain ``torchrun``: (1) ``torchrun`` found by name on a node's ``PATH`` is whatever
environment happens to be active there (a job submitted from a shell without the venv failed
with exit 127); (2) torchrun exits 1 with a Python traceback whenever a rank exits non-zero,
so a preemption -- every rank saved and exited 143 -- showed in SLURM as FAILED 1:0 with one
traceback per preemption in the node log. Here:

* every failed rank stopped on a signal (143/130), or torchrun itself got SIGTERM/SIGUSR1/
  SIGINT and stopped its ranks: exit 143 (130 for SIGINT) with one line; torchrun's report
  and traceback go to ``LOG_DIR/torchrun-NODE.log`` next to the rank logs (``--log-dir``);
* a rank without progress for ``dist.distributed_timeout_minutes``: the watchdog
  (:mod:`lptrain.launch.watchdog`) names it in one line, stops this node's ranks, exit 3;
* any other rank failure: torchrun's failure report (which rank, its exit status) on stderr,
  exit 3 (lptrain's "a run that failed").
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from lptrain.errors import EXIT_RUN_FAILED, EXIT_SIGINT, EXIT_SIGTERM
from lptrain.launch.exit_status import signal_stop_status
from lptrain.launch.peers import publish_peer_exits
from lptrain.launch.watchdog import HANG_FIX, watching

_MAX_LOCAL_RANKS = 64  # slots of the progress file when --nproc-per-node is gpu/auto/cpu


def _node_log(log_dir: Optional[str]) -> Optional[Path]:
    if not log_dir:
        return None
    node = os.environ.get("SLURM_NODEID") or socket.gethostname()
    return Path(log_dir) / f"torchrun-node{node}.log"


def _to_node_log(log_dir: Optional[str], exc: BaseException) -> str:
    """Append torchrun's report and traceback to the node's log file; where it went."""
    path = _node_log(log_dir)
    text = "".join(traceback.format_exception(exc))
    if path is None:
        return "not kept (no --log-dir)"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(text)
    except OSError as e:
        return f"not kept ({path}: {e.strerror or e})"
    return str(path)


def quiet_agent_logs() -> None:
    """The elastic agent logs every teardown step ("Sending process N closing signal
    SIGTERM", "failed (exitcode: -9) local_rank: 1 ..."); the launch says what happened in one
    line of its own, so only the agent's critical messages stay."""
    import logging

    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run torchrun with ``argv``; returns the exit status (see the module docstring)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    quiet_agent_logs()
    nproc = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else _MAX_LOCAL_RANKS
    try:
        # the watchdog names a rank without progress; a survivor names how its lost peer ended
        with watching(nproc) as dog, publish_peer_exits():
            run(args)
    except SignalException as e:
        status = EXIT_SIGINT if e.sigval == signal.SIGINT else EXIT_SIGTERM
        where = _to_node_log(args.log_dir, e)
        print(f"lptrain: torchrun got {signal.Signals(e.sigval).name} and stopped its ranks; "
              f"exit {status} (its report: {where})", file=sys.stderr)
        return status
    except ChildFailedError as e:
        where = _to_node_log(args.log_dir, e)
        if dog.fired:  # it killed this node's ranks: its line is the one to say
            print(f"error: {dog.message}; fix: {HANG_FIX} (torchrun's report: {where})",
                  file=sys.stderr)
            return EXIT_RUN_FAILED
        status = signal_stop_status(f.exitcode for f in e.failures.values())
        if status is not None:
            print(f"lptrain: the ranks stopped on a signal (exit {status}) after saving; "
                  f"torchrun's report: {where}", file=sys.stderr)
            return status
        print(e.format_msg(), file=sys.stderr)
        return EXIT_RUN_FAILED
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
