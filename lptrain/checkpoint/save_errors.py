"""Failures during a checkpoint save: one line on every rank, the half-written folder removed.

A write can fail in two shapes. The usual one is an ``OSError`` with its errno (ENOSPC,
EDQUOT, EACCES, EROFS). The other comes from torch's zip writer (``torch.save``, which DCP
uses for some of its files): on a full disk it does not raise the ``OSError`` but stops with
``RuntimeError: [enforce fail at inline_container.cc:...] unexpected pos 704 vs 598`` once the
bytes it counted and the bytes on disk disagree. That one used to escape as an internal error
(exit 70) and leave the half-written step folder behind. Here it is a write failure like the
other: "No space left on device" when the filesystem is full (its free space is read back
right after the failure), "write failed" otherwise; either way :class:`CheckpointSaveError`
(exit 3), the folder removed, the previous checkpoint named as still usable.

Anything else (a ``TypeError`` in the state, say) is a bug and propagates.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from lptrain.checkpoint.folders import step_dirs, validate
from lptrain.errors import RunFailedError

# What torch's stream writer says when the bytes it wrote did not all reach the file.
_WRITER_FAILURES = ("inline_container", "pytorchstreamwriter", "unexpected pos", "file write failed")
# Below this much free space after a failed write, the filesystem is full.
FULL_BELOW_BYTES = 1 << 20

Failure = tuple[str, str]  # (what failed, fix)


class CheckpointSaveError(RunFailedError):
    """A save failed during the run (exit 3): the message names the path, what failed, the
    previous checkpoint that stays usable, and the fix. Every rank raises the same one."""

    every_rank = True


def raise_unwrapped(fn: Callable[[], Any]) -> Any:
    """Call ``fn``; a DCP ``CheckpointException`` (a ``BaseException``, which ``except
    Exception`` misses) is re-raised as the first rank's underlying exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return fn()
    except CheckpointException as e:
        inner = next(iter(e.failures.values()), (None, None))[0]
        if isinstance(inner, Exception):
            raise inner from None
        raise RuntimeError(describe(e)) from None


def describe(e: BaseException) -> str:
    """One short line for an exception (DCP's carries every rank's traceback in ``str``)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    if isinstance(e, OSError) and e.strerror:
        text = f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    else:
        text = f"{type(e).__name__}: {e}"
    text = " ".join(text.split())
    return text if len(text) <= 240 else text[:237] + "..."


_FIXES = {
    errno.ENOSPC: "free space on that filesystem or point checkpoint.save at a larger one",
    errno.EDQUOT: "free space within your quota or point checkpoint.save elsewhere",
    errno.EACCES: "make it writable (chmod u+w) or point checkpoint.save at a writable folder",
    errno.EPERM: "make it writable (chmod u+w) or point checkpoint.save at a writable folder",
    errno.EROFS: "point checkpoint.save at a folder on a writable filesystem",
}
_GENERIC_FIX = "check that checkpoint.save is a writable folder with room"


def free_bytes(path: Path) -> Optional[int]:
    """Free bytes for an unprivileged writer on the filesystem of ``path`` (or of its
    nearest existing parent); None when it cannot be read."""
    probe = Path(os.path.abspath(path))
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _is_writer_failure(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(marker in text for marker in _WRITER_FAILURES)


def classify(e: BaseException, folder: Path) -> Optional[Failure]:
    """``(what failed, fix)`` for a write failure of a save into ``folder``; None for an
    exception that is not one (a bug, which the caller re-raises)."""
    if isinstance(e, OSError):
        return describe(e), _FIXES.get(e.errno or -1, _GENERIC_FIX)
    if not _is_writer_failure(e):
        return None
    free = free_bytes(folder)
    detail = " ".join(str(e).split())[:160]
    if free is not None and free < FULL_BELOW_BYTES:
        return (f"{os.strerror(errno.ENOSPC)} ({free} bytes free after torch's writer stopped: "
                f"{detail})", _FIXES[errno.ENOSPC])
    return f"write failed (torch's writer stopped: {detail})", _GENERIC_FIX


def attempt(fn: Callable[[], Any], folder: Path) -> Optional[Failure]:
    """``None`` when ``fn`` ran, else ``(what failed, fix)`` for a write failure."""
    try:
        fn()
    except Exception as e:
        failure = classify(e, folder)
        if failure is None:
            raise
        return failure
    return None


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def agree(err: Optional[Failure], root: Path, folder: Path,
          payload: Optional[dict[str, Any]] = None) -> list[Optional[dict[str, Any]]]:
    """Every rank's ``(err, payload)``; if any rank failed, every rank raises the same
    :class:`CheckpointSaveError` (rank 0 first removes the half-written folder)."""
    d = _dist()
    if d is None or d.get_world_size() == 1:
        results = [(err, payload)]
    else:
        results = [None] * d.get_world_size()
        d.all_gather_object(results, (err, payload))
    failed = [(r, e) for r, (e, _) in enumerate(results) if e is not None]
    if failed:
        rank, (what, fix) = failed[0]
        if d is None or d.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
        prev = next((p for p in step_dirs(root) if p != folder and validate(p) is None), None)
        keeps = (f"the previous checkpoint {prev} is still usable" if prev
                 else "no earlier checkpoint exists")
        who = f" (rank {rank})" if len(results) > 1 else ""
        raise CheckpointSaveError(f"checkpoint save to {folder} failed{who}: {what}; {keeps}",
                                  fix=fix)
    return [p for _, p in results]
