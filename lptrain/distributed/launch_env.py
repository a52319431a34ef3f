"""Joining the world a launcher described in the environment.

``torchrun``, :func:`lptrain.launch.local.launch_local` and an sbatch script running torchrun
all describe a rank by ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``MASTER_ADDR`` /
``MASTER_PORT``. :func:`init_process_group_from_env` joins that world (gloo on CPU, NCCL on
CUDA) so the engine can build its groups; it is idempotent, and a single process
(``WORLD_SIZE`` 1 or unset) joins nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os

import torch


def use_one_cuda_work_queue(tensor_parallel_size: int) -> None:
    """Under tensor parallelism, ``CUDA_DEVICE_MAX_CONNECTIONS=1``: one hardware queue, so a
    TP/SP collective launched before a GEMM runs before it and overlaps the next (Megatron's
    launch scripts set it; TE's TP layers warn without it). Read when the CUDA context is
    created, so called before the first CUDA call; an explicit value wins."""
    if tensor_parallel_size > 1:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def world_from_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from the launcher's environment (0, 1, 0 without)."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
        int(os.environ.get("LOCAL_RANK", "0")),
    )


def init_process_group_from_env(device: torch.device, timeout_s: float = 600.0) -> bool:
    """Join the launcher's world when ``WORLD_SIZE > 1``; returns whether a group exists.

    ``timeout_s`` (``dist.distributed_timeout_minutes``) is the process group's timeout, and
    the time the launcher's watchdog gives a rank without progress (published from here on:
    :mod:`lptrain.distributed.progress`)."""
    import torch.distributed as dist

    from lptrain.distributed.orphans import die_with_launcher
    from lptrain.distributed.progress import publish

    if dist.is_initialized():
        return True
    _, world, local_rank = world_from_env()
    if world <= 1:
        return False
    die_with_launcher()
    publish(timeout_s)
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


def leave_world() -> None:
    """End of a run that finished on every rank: one barrier, then the group is destroyed.

    Why: without it the first rank to finish exits and closes its sockets while a slower
    rank may still be inside its last collective or its own teardown; on a loaded machine
    gloo then aborts that rank at exit ("terminate called without an active exception",
    SIGABRT) and a run that trained to the end reports a failure. Only the success path
    calls this: a failing rank must not wait on peers that are still training (the atexit
    teardown of :func:`init_process_group_from_env` covers it)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
