"""Starting a multi-process run on this host.

:func:`launch_local` is what ``lptrain pretrain --nproc-per-node N`` does: it runs N copies
of ``python -m lptrain pretrain ...`` through torch's elastic launcher (the API behind
``torchrun``) with a c10d rendezvous on this host. When any rank fails, the agent ends the
others and the failure is reported with that rank's exit status. Each rank then joins the
world from its environment (:mod:`lptrain.distributed.launch_env`, which also provides
:func:`world_from_env`).
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Sequence

from lptrain.distributed.launch_env import world_from_env
from lptrain.errors import RunFailedError

__all__ = ["launch_local", "world_from_env"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_local(nproc: int, args: Sequence[str]) -> int:
    """Run ``python -m lptrain *args`` on ``nproc`` local ranks; 0 when all succeed.

    A failing rank makes the elastic agent stop the others (no hang); the rank's own error
    line is on its stderr, and this raises :class:`RunFailedError` naming the rank and its
    exit status (the CLI exits 3).
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
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        elastic_launch(config, sys.executable)("-m", "lptrain", *args)
    except SignalException as e:
        # SIGTERM/SIGINT to the launcher: the agent forwarded it to the ranks (which save a
        # checkpoint and stop) and stopped them; exit as the ranks do, 128 + signal number.
        raise SystemExit(128 + int(e.sigval)) from None
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        raise RunFailedError(
            f"rank {rank} of {nproc} failed with exit status {failure.exitcode}; the other "
            "ranks were stopped (its error is printed above)",
            fix="see the failing rank's error line above",
        ) from None
    return 0
