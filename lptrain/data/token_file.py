"""The token file of a dataset, read with ``pread`` so that a file changed under a running job
is one error line instead of a silent ``SIGBUS``.

Why not ``numpy.memmap``: when a mapped file is truncated (``truncate``, a re-prepare that
rewrites it in place, a shrinking network share), touching a page past the new end kills the
process with ``SIGBUS`` (exit 135) -- no message, no summary, and Python cannot catch it. A
``pread`` past the end returns short instead, which :class:`TokenFile` turns into
:class:`DatasetChangedError` (exit 3, "a run that failed") naming the file. A file *replaced*
(renamed over, or rewritten at the same size) is caught by :meth:`TokenFile.check_unchanged`,
which compares size, mtime and inode with what was verified on open; the data pipeline calls
it at every epoch boundary of every dataset.

Reads go through the page cache like the mapping did, one system call per slice (samples are
one or a few slices), and the file is never loaded whole.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from lptrain.errors import RunFailedError

_FIX = ("do not modify a dataset while a job reads it: prepare into a new prefix, then point "
        "data.source/data.paths at it and resume")


class DatasetChangedError(RunFailedError):
    """The token file was truncated or replaced after the run opened it (exit 3)."""


def _stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


class TokenFile:
    """Read-only view of ``num_tokens`` tokens of ``dtype`` in ``path``: ``len`` and slices."""

    def __init__(self, path: str | os.PathLike[str], dtype: np.dtype, num_tokens: int) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.num_tokens = int(num_tokens)
        self._open()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._stamp = _stamp(os.fstat(self._fd))

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice):
            raise TypeError(f"TokenFile takes slices, not {type(key).__name__}")
        start, stop, step = key.indices(self.num_tokens)
        if step != 1:
            raise ValueError("TokenFile slices are contiguous (step 1)")
        count = max(0, stop - start)
        size = self.dtype.itemsize
        data = os.pread(self._fd, count * size, start * size)
        if len(data) != count * size:
            raise self._changed(f"it ends before token {start + len(data) // size} that its index "
                                f"promises ({self.num_tokens} tokens); it was truncated")
        return np.frombuffer(data, dtype=self.dtype)

    def check_unchanged(self) -> None:
        """Raise :class:`DatasetChangedError` when the path no longer holds the opened file."""
        try:
            now = _stamp(os.stat(self.path))
        except OSError as e:
            raise self._changed(f"it cannot be read any more ({e.strerror or e})") from None
        if now != self._stamp:
            size, mtime, ino, _ = now
            was = self._stamp
            what = ("replaced by another file" if ino != was[2]
                    else f"truncated to {size} bytes" if size < was[0]
                    else "rewritten" if size == was[0] else f"grown to {size} bytes")
            touched = ", modified since" if mtime != was[1] else ""
            raise self._changed(f"it was {what} (size {was[0]} -> {size} bytes{touched})")

    def _changed(self, why: str) -> DatasetChangedError:
        return DatasetChangedError(f"dataset token file {self.path} changed under the running job: {why}",
                                   fix=_FIX)

    def close(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            self.close()

    def __getstate__(self) -> dict[str, Any]:
        """DataLoader workers started with ``spawn`` reopen the file (and keep the stamp the
        parent verified, so a file changed in between is still caught)."""
        return {"path": self.path, "dtype": self.dtype, "num_tokens": self.num_tokens,
                "stamp": self._stamp}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.dtype, self.num_tokens = state["path"], state["dtype"], state["num_tokens"]
        self._open()
        if self._stamp != state["stamp"]:
            self._stamp = state["stamp"]
            self.check_unchanged()
