"""Small files written whole or not at all: a temp file in the same folder, ``fsync``, then
``os.replace``.

Why: a full disk or a kill in the middle of ``write_text`` leaves a truncated (often 0-byte)
``summary.json`` or ``train_state.json`` behind, and the previous good one is lost with it.
With a rename, readers see the old file or the whole new one; a failed write removes its
temp file and leaves the old file as it was.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_atomically(path: str | Path, data: bytes | str) -> Path:
    """Replace ``path`` with ``data`` atomically; raises ``OSError`` (old file intact)."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path
