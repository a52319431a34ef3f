"""Finding and validating checkpoint folders: step folders, the ``latest`` pointer, markers.

Everything here reads; nothing writes (the save path is :mod:`lptrain.checkpoint.store`). A
folder may vanish while it is looked at -- the trainer prunes old checkpoints while ``lptrain
export`` or another run reads them -- so every check turns an ``OSError`` into a reason the
folder is skipped, never an exception. A reader that must keep a folder while it reads it
holds a lease (:mod:`lptrain.checkpoint.lease`), which the pruner respects.

The ``latest`` pointer is a hint, read as bytes: a pointer that is not UTF-8 text, does not
name an ``iter_*`` folder (its content is never printed), is a symbolic link (never followed:
it could lead out of the checkpoint folder) or is a folder itself is ignored with a note, and
the newest valid checkpoint is used instead.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lptrain.checkpoint.integrity import listed_files, mismatch
from lptrain.errors import InputError

MARKER = "COMPLETE.json"
LATEST = "latest"
TRAIN_STATE = "train_state.json"
CONFIG = "resolved_config.yaml"
FORMAT_VERSION = 2  # 2: the marker records a checksum per file; 1: sizes only
STEP_DIR = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(InputError):
    """A checkpoint could not be found, validated or loaded (the message says which and why;
    exit 2 through the CLI)."""


def step_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def iteration_of(folder: Path) -> int:
    m = STEP_DIR.match(folder.name)
    return int(m.group(1)) if m else -1


def step_dirs(root: str | Path) -> list[Path]:
    """Step folders under ``root``, newest first (complete or not)."""
    root = Path(root)
    try:
        dirs = [p for p in root.iterdir() if STEP_DIR.match(p.name) and p.is_dir()]
    except OSError:  # not a folder (yet), or unreadable
        return []
    return sorted(dirs, key=iteration_of, reverse=True)


def _marker_files(folder: Path) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """The marker's listed files, or why there are none (one short phrase)."""
    marker = folder / MARKER
    if not marker.is_file():
        return None, "incomplete (no completion marker: the save was interrupted)"
    try:
        return listed_files(json.loads(marker.read_text())), None
    except FileNotFoundError:
        return None, "gone (removed while it was being read)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, f"corrupt ({MARKER} is unreadable)"


def validate(folder: str | Path) -> str | None:
    """``None`` when ``folder`` is a complete checkpoint, else why not (one short phrase).

    Cheap: the marker, every listed file's size, and the small ``train_state.json`` (its
    checksum and that it parses); :func:`verify` checks every checksum."""
    folder = Path(folder)
    try:
        return _validate(folder)
    except FileNotFoundError:
        return "gone (removed while it was being read)"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"


def _validate(folder: Path) -> str | None:
    files, why = _marker_files(folder)
    if files is None:
        return why
    for rel, listed in files.items():
        bad = mismatch(folder, rel, listed) if rel == TRAIN_STATE else None
        if bad is None and not (folder / rel).is_file():
            bad = f"{rel} is missing"
        elif bad is None and (folder / rel).stat().st_size != listed.size:
            bad = f"{rel} has {(folder / rel).stat().st_size} bytes, expected {listed.size}"
        if bad is not None:
            return f"corrupt ({bad})"
    if not (folder / "global" / ".metadata").is_file() or not (folder / TRAIN_STATE).is_file():
        return "corrupt (global/.metadata or train_state.json missing)"
    try:
        int(read_train_state(folder)["iteration"])
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"corrupt ({TRAIN_STATE} is unreadable)"
    return None


def verify(folder: str | Path) -> tuple[Optional[str], bool]:
    """``(problem, verified)``: the first file whose size or checksum differs from the
    marker's record (None when all match), and whether the marker had checksums to check
    (False for a checkpoint written before they were recorded)."""
    folder = Path(folder)
    files, why = _marker_files(folder)
    if files is None:
        return why, False
    for rel, listed in files.items():
        try:
            bad = mismatch(folder, rel, listed)
        except OSError as e:
            bad = f"{rel} could not be read ({e.strerror or e})"
        if bad is not None:
            return bad, True
    return None, all(f.digest is not None for f in files.values())


def is_step_dir(path: str | Path) -> bool:
    return bool(STEP_DIR.match(Path(path).name)) or (Path(path) / MARKER).exists()


def is_link(path: Path) -> bool:
    return path.is_symlink()


def read_latest(root: str | Path) -> tuple[Optional[Path], Optional[str]]:
    """The step folder ``root/latest`` names, or ``(None, why it was ignored)``; ``(None,
    None)`` without a pointer. Read as bytes: a corrupt pointer is a note, not a crash."""
    pointer = Path(root) / LATEST
    if not os.path.lexists(pointer):
        return None, None
    if is_link(pointer):  # lptrain writes a plain file: a link may lead out of the folder
        return None, (f"pointer {pointer} is a symbolic link, not the file lptrain writes there: "
                      "ignored without reading it, the newest valid checkpoint is used")
    if pointer.is_dir():
        return None, (f"pointer {pointer} is a folder, not the file lptrain writes there: "
                      "ignored (remove or rename it before the next save)")
    try:
        raw = pointer.read_bytes()
    except OSError as e:
        return None, f"pointer {pointer} is unreadable ({e.strerror or e}): ignored"
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, (f"pointer {pointer} holds bytes that are not text (corrupt): ignored, "
                      "the newest valid checkpoint is used")
    if not STEP_DIR.fullmatch(name):  # its content is not echoed: it may be anything
        return None, (f"pointer {pointer} does not name an iter_* folder ({len(raw)} bytes): "
                      "ignored, the newest valid checkpoint is used")
    return Path(root) / name, None


@dataclass
class Candidates:
    """Valid checkpoints to try, newest first, and what was skipped (for the log)."""

    valid: list[Path]
    skipped: list[str] = field(default_factory=list)


def find_checkpoints(path: str | Path) -> Candidates:
    """Valid checkpoints in ``path`` (a save folder or one step folder), newest first.

    The ``latest`` pointer, when it names a valid folder, comes first (it is normally the
    newest anyway); invalid folders, and a pointer that cannot be used, are listed in
    ``skipped`` with the reason.
    """
    path = Path(path)
    if is_step_dir(path) and not os.path.lexists(path / LATEST):
        why = validate(path)
        return Candidates([path], []) if why is None else Candidates([], [f"{path}: {why}"])
    valid: list[Path] = []
    skipped: list[str] = []
    for p in step_dirs(path):
        why = validate(p)
        if why is None:
            valid.append(p)
        else:
            skipped.append(f"{p}: {why}")
    named, note = read_latest(path)
    if note is not None:
        skipped.append(note)
    if named in valid:
        valid.remove(named)
        valid.insert(0, named)
    return Candidates(valid, skipped)


def read_train_state(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / TRAIN_STATE).read_text())
