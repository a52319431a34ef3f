"""Reader leases: a checkpoint being read is not pruned under its reader.

Why: the trainer prunes old checkpoints after every save (``checkpoint.keep_latest``). An
``lptrain export`` of a run that is still training picked the newest checkpoint, then the
trainer's next save pruned it while DCP was reading it, and the export died with
``FileNotFoundError .../global/.metadata`` (exit 70, 4 times out of 4).

How: ``iter_NNNNNNN/.readers.lock``, inside the step folder (so it goes with it and leaves
nothing behind), is a lock file. A reader holds a shared ``flock`` on it while it reads
(:func:`reading`); the pruner deletes a folder only while it holds the exclusive lock, taken
without waiting (:func:`remove_unless_read`), and keeps a folder a reader holds until a later
save prunes it. The kernel drops a ``flock`` when its
holder dies, so a killed reader never pins a folder for good. A reader that takes its lease
after the pruner started, or on a folder that changed, sees the folder invalid once it holds
the lease and moves on to the next checkpoint. A save folder the reader may not write to (a
read-only copy) cannot be pruned by anyone either: reading it needs no lease.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from lptrain.checkpoint.folders import validate

LEASE = ".readers.lock"  # not a checkpoint file: the completion marker never lists it


def _open_lease(folder: Path) -> int | None:
    try:
        return os.open(folder / LEASE, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError:  # gone, or not ours to write
        return None


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            return False
        raise
    return True


@contextlib.contextmanager
def reading(folder: str | Path) -> Iterator[str | None]:
    """Hold a reader lease on the step folder ``folder`` for the block; yields None when the
    folder is a complete checkpoint that stays until the block ends, else why it cannot be
    read (being pruned, gone or invalid by now)."""
    folder = Path(folder)
    fd = _open_lease(folder)
    if fd is None:  # gone (validate says so), or read-only: nobody prunes it then either
        yield validate(folder)
        return
    try:
        if not _try_lock(fd, fcntl.LOCK_SH):
            yield "being removed by the run that saved it (pruned)"
            return
        yield validate(folder)  # after the lease: a folder pruned just before is seen gone
    finally:
        os.close(fd)


def unlinked_if_link(folder: Path) -> bool:
    """Remove ``folder`` if it is a symbolic link (the link, never its target); whether it was."""
    if not folder.is_symlink():
        return False
    with contextlib.suppress(FileNotFoundError):
        folder.unlink()
    return True


def remove_unless_read(folder: Path) -> bool:
    """Delete the step folder ``folder`` unless a reader holds its lease; whether it went.
    A step folder that is a symbolic link loses the link only: nothing is created or deleted
    in its target, which lies outside the run."""
    if unlinked_if_link(folder):
        return True
    fd = _open_lease(folder)
    if fd is None:
        shutil.rmtree(folder, ignore_errors=True)
        return True
    try:
        if not _try_lock(fd, fcntl.LOCK_EX):
            return False
        shutil.rmtree(folder, ignore_errors=True)  # the lease file with it
        return True
    finally:
        os.close(fd)
