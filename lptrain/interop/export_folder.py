"""The output folder of ``lptrain export``: written whole in a staging folder, then renamed.

Why: the export used to write straight into ``--output``. A killed export (Ctrl-C twice, a
SIGKILL, a full disk) left safetensors' own hidden temp file (``.tmpXXXXXX``, from its
writer) in it, so a plain re-export was refused ("is not empty") until the user found and
removed it; and ``model.safetensors`` kept that temp file's mode 0600 while its siblings were
0644.

Now every file is written into ``.<name>.partial-<pid>`` next to ``--output`` and the folder
is renamed into place at the end: ``--output`` holds a whole export or nothing new. A
``--output`` that is a symbolic link is followed: the model goes into the link's target. A
staging folder left by a killed export (its pid gone) is removed by the next export. With
``--overwrite`` the old folder is renamed aside, the new one in, and the old one removed.
Files get the mode ``open()`` gives (0666 less the umask), as ``transformers`` writes them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from lptrain.checkpoint.atomic import pid_alive
from lptrain.errors import OutputDirError

_PARTIAL = ".partial-"


def resolve_output(out: Path) -> Path:
    """``--output`` with a symbolic link followed to its target: the export goes into the
    folder the link names, and the link stays (renaming the staged folder onto the link's
    own path replaced the link and left the target empty). A link to nothing, or to itself,
    is :class:`OutputDirError` (exit 2)."""
    if not out.is_symlink():
        return out
    target = Path(os.path.realpath(out))
    if not target.exists() and not target.parent.is_dir():
        raise OutputDirError(
            f"--output {out} is a symbolic link to {os.readlink(out)}, which does not exist "
            f"(nor does its folder {target.parent})",
            fix="create the link's target folder, point the link elsewhere, or pass another --output")
    if target.is_symlink():  # a loop: realpath gave up
        raise OutputDirError(f"--output {out} is a symbolic link that loops",
                             fix="remove the link or pass another --output")
    return target


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse before anything is read: ``--output`` a file, or non-empty without
    ``--overwrite`` (exit 2). ``out`` is :func:`resolve_output`'s."""
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"--output {out} is a file", fix="choose a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputDirError(f"--output {out} is not empty", fix="choose a new folder, or pass --overwrite")


def remove_stale_staging(out: Path) -> list[Path]:
    """Staging folders of ``out`` left by exports that are no longer running; what went."""
    removed = []
    with contextlib.suppress(OSError):
        for p in out.parent.glob(f".{out.name}{_PARTIAL}*"):
            pid = p.name.rsplit("-", 1)[-1]
            if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def _plain_modes(folder: Path) -> None:
    """The mode ``open()`` would give every file (safetensors' temp files are 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for p in folder.iterdir():
        if p.is_file():
            p.chmod(0o666 & ~umask)


def _install(stage: Path, out: Path) -> None:
    """Rename ``stage`` to ``out``; an existing ``out`` (empty, or being overwritten) is
    renamed aside first and removed after."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
    try:
        os.rename(stage, out)
    except OSError:
        if old is not None:
            os.rename(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_output(out: Path) -> Iterator[Path]:
    """A fresh staging folder for ``out``; renamed to ``out`` when the block succeeds, removed
    when it fails. Filesystem errors are :class:`OutputDirError` (exit 2)."""
    out = Path(os.path.abspath(out))
    remove_stale_staging(out)
    stage = out.with_name(f".{out.name}{_PARTIAL}{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir()
    except OSError as e:
        raise OutputDirError(f"cannot create --output {out}: {e.strerror or e}",
                             fix="choose a folder in a writable place") from None
    try:
        yield stage
        _plain_modes(stage)
        _install(stage, out)
    except OSError as e:
        raise OutputDirError(f"cannot write --output {out}: {e.strerror or e}"
                             + (f" ({e.filename})" if e.filename else ""),
                             fix="free space there or choose another folder") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
