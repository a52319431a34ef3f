"""Starting and joining a multi-process run on the engines that already exist.

* :func:`launch_local` is what ``lptrain pretrain --nproc-per-node N`` does: it runs N copies
  of ``python -m lptrain pretrain ...`` through torch's elastic launcher (the API behind
  ``torchrun``) with a c10d rendezvous on this host. When any rank fails, the agent ends the
  others and the failure is reported with that rank's exit status.
* :func:`init_process_group_from_env` joins the world a launcher described (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``, as set by torchrun, this
  launcher or an sbatch script running torchrun): gloo on CPU, NCCL on CUDA. Idempotent.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
import uuid
from collections.abc import Sequence

import torch

from lptrain.errors import RunFailedError


def world_from_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from the launcher's environment (0, 1, 0 without)."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
        int(os.environ.get("LOCAL_RANK", "0")),
    )


def init_process_group_from_env(device: torch.device, timeout_s: float = 600.0) -> bool:
    """Join the launcher's world when ``WORLD_SIZE > 1``; returns whether a group exists."""
    import torch.distributed as dist

    if dist.is_initialized():
        return True
    _, world, local_rank = world_from_env()
    if world <= 1:
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    atexit.register(_destroy)
    return True


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


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
