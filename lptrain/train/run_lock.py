"""One run per folder: an exclusive ``fcntl.flock`` on ``<run folder>/.lptrain.lock``, taken
before anything else is written and held until the run ends.

Why a lock: two ``lptrain pretrain`` into one folder (a double submit, a requeue racing its
own predecessor) interleaved their steps in ``metrics.jsonl`` and fought over checkpoints.
The kernel drops a ``flock`` when its holder dies, however it dies, so a lock never outlives
its process on the same host; the file holds ``pid host`` so that a refused run can name the
holder. A file still naming a process that is gone (killed, crashed) is a stale record: the
lock is free, and the new run takes it over and says so. A clean exit empties the file
(never deletes it: deleting would let two runs lock two different files of the same name).

Re-entrant within a process (the CLI takes it, then the training loop asks again).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lptrain.checkpoint.atomic import pid_alive
from lptrain.errors import OutputDirError

LOCK_FILE = ".lptrain.lock"
_HELD: dict[str, tuple[int, int]] = {}  # realpath -> (fd, depth)


class RunFolderLocked(OutputDirError):
    """Another lptrain run holds the folder (exit 2)."""


@dataclass
class Holder:
    pid: Optional[int]
    host: str

    @classmethod
    def read(cls, path: Path) -> Optional[Holder]:
        try:
            text = path.read_text().split()
        except OSError:
            return None
        if len(text) < 2:
            return None
        pid = int(text[0]) if text[0].isdigit() else None
        return cls(pid, text[1])

    def __str__(self) -> str:
        return f"pid {self.pid} on host {self.host}"


def locked_by(out: str | Path) -> Optional[Holder]:
    """The holder of ``out``'s lock when another process holds it, else None. Writes
    nothing (``--dry-run``)."""
    path = Path(out) / LOCK_FILE
    if not path.is_file() or os.path.realpath(path) in _HELD:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            return Holder.read(path) or Holder(None, "unknown")
        return None
    finally:
        os.close(fd)
    return None


def refusal(out: Path, holder: Optional[Holder]) -> RunFolderLocked:
    who = str(holder) if holder else "another process"
    return RunFolderLocked(
        f"run folder {out} is in use by another lptrain run ({who}); wait for it to finish, "
        "stop it, or choose another --output-dir"
    )


@contextlib.contextmanager
def run_lock(out: str | Path, note: Callable[[str], None] = print) -> Iterator[None]:
    """Hold ``out``'s lock for the block (creating ``out``); raises :class:`RunFolderLocked`
    naming the holder when another process has it. ``note`` gets the take-over line."""
    out = Path(out)
    path = out / LOCK_FILE
    key = os.path.realpath(path)
    if key in _HELD:
        fd, depth = _HELD[key]
        _HELD[key] = (fd, depth + 1)
        try:
            yield
        finally:
            _release(key)
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise OutputDirError(f"cannot create the lock file {path}: {e.strerror or e}",
                             key="run.output_dir", fix="choose a writable --output-dir") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            raise refusal(out, Holder.read(path)) from None
        raise OutputDirError(f"cannot lock {path}: {e.strerror or e}", key="run.output_dir",
                             fix="put the run folder on a filesystem with flock support") from None
    stale = Holder.read(path)
    if stale is not None and stale.pid != os.getpid():
        here = stale.host == socket.gethostname()
        gone = "no longer running" if here and stale.pid and not pid_alive(stale.pid) else "its lock was released"
        note(f"note: taking over the lock of a previous run in {out} ({stale}, {gone})")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    _HELD[key] = (fd, 1)
    try:
        yield
    finally:
        _release(key)


def folder_lost(out: str | Path) -> Optional[str]:
    """Why the run folder ``out`` whose lock this process holds is no longer the one it
    locked (deleted, or replaced by another folder), else None. One ``stat``: cheap enough
    for every step. (The lock file lives in the folder, so an ``rm -rf`` of the folder
    unlinks it while the run still holds it open.)"""
    path = Path(out) / LOCK_FILE
    held = _HELD.get(os.path.realpath(path))
    if held is None:
        return None
    mine = os.fstat(held[0])
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return "was deleted" if not Path(out).exists() else f"lost its lock file {LOCK_FILE}"
    except OSError as e:
        return f"cannot be read any more ({e.strerror or e})"
    if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
        return "was replaced by another folder"
    return None


def _release(key: str) -> None:
    fd, depth = _HELD[key]
    if depth > 1:
        _HELD[key] = (fd, depth - 1)
        return
    del _HELD[key]
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)  # a clean exit: no holder to report
    os.close(fd)  # releases the flock
