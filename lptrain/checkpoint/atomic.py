"""Small files written whole or not at all: a temp file in the same folder, ``fsync``, then
``os.replace``.

Why: a full disk or a kill in the middle of ``write_text`` leaves a truncated (often 0-byte)
``summary.json`` or ``train_state.json`` behind, and the previous good one is lost with it.
With a rename, readers see the old file or the whole new one; a failed write removes its
temp file and leaves the old file as it was. A writer killed mid-write (SIGKILL) cannot remove
it: :func:`remove_stale_temps` does, when the next run starts.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

_TEMP = re.compile(r"^\..+\.tmp(\d+)$")


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


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (signal 0; another user's process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(folder: str | Path) -> list[Path]:
    """Delete the temp files :func:`write_atomically` left in ``folder`` when its writer was
    killed (``.NAME.tmpPID`` whose process is gone); what went."""
    removed = []
    with contextlib.suppress(OSError):
        for p in Path(folder).iterdir():
            m = _TEMP.match(p.name)
            if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))) and p.is_file():
                with contextlib.suppress(OSError):
                    p.unlink()
                    removed.append(p)
    return removed
