"""Checkpoint folders on disk: write, validate, find, load, prune.

Layout of ``checkpoint.save`` (``SAVE``)::

    SAVE/latest                      name of the newest complete step folder (written last)
    SAVE/iter_0000004/global/        torch.distributed.checkpoint (DCP) files of the engine's
                                     "global" state (identical on every rank; DCP dedups it)
    SAVE/iter_0000004/local/rank_00000.pt   torch.save of each rank's "local" state (RNG)
    SAVE/iter_0000004/train_state.json      iteration, consumed samples/tokens, data position,
                                            W&B run id, world size
    SAVE/iter_0000004/resolved_config.yaml  the config of the run that wrote it
    SAVE/iter_0000004/COMPLETE.json         completion marker, written last, listing every file
                                            and its size

Why a marker and not a rename: DCP writes one file per rank straight into the folder, so a
half-written folder is indistinguishable from a finished one except by the marker. A folder
without a marker, or whose files do not match the sizes in the marker, is reported and
skipped; the previous valid one is used. ``latest`` is only a hint (written after the
marker): validation decides.

DCP runs without an initialised process group too (single process: no collectives). Loading
reads the whole "global" state on every rank (``_EmptyStateDictLoadPlanner``: no template
needed, so optimizer state that a freshly built engine does not have yet is still read), which
is what makes it reshardable: the engine receives canonical, unsharded names.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lptrain.errors import InputError

MARKER = "COMPLETE.json"
LATEST = "latest"
TRAIN_STATE = "train_state.json"
CONFIG = "resolved_config.yaml"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(InputError):
    """A checkpoint could not be found, validated or loaded (the message says which and why;
    exit 2 through the CLI)."""


def step_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _barrier() -> None:
    d = _dist()
    if d is not None:
        d.barrier()


def _atomic_write(path: Path, text: str) -> None:
    """Write ``text`` so that readers see the old file or the whole new one, never a prefix."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _file_sizes(folder: Path) -> dict[str, int]:
    return {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MARKER and not p.name.startswith(".tmp")
    }


# ------------------------------------------------------------------------ DCP key encoding

_INT = "#int:"
_EMPTY = "#empty-dict"


def encode_keys(obj: Any) -> Any:
    """Make a nested state DCP-safe and reversible.

    DCP flattens nested dicts by ``str(key)`` and drops empty dicts, so an optimizer's
    ``state`` keyed by ``0, 1, ...`` would come back keyed by ``"0"`` (silently ignored by
    ``Optimizer.load_state_dict``) and a not-yet-stepped optimizer's ``state: {}`` would not
    come back at all. Int keys become ``"#int:<k>"`` and empty dicts a sentinel string.
    """
    if isinstance(obj, dict):
        if not obj:
            return _EMPTY
        out = {}
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (int, str)):
                raise TypeError(f"checkpoint state key {k!r}: only str and int keys are supported")
            if isinstance(k, str) and k.startswith(_INT):
                raise ValueError(f"checkpoint state key {k!r} uses the reserved prefix {_INT!r}")
            out[f"{_INT}{k}" if isinstance(k, int) else k] = encode_keys(v)
        return out
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        return [encode_keys(v) for v in obj]
    return obj


def decode_keys(obj: Any) -> Any:
    """Inverse of :func:`encode_keys`."""
    if isinstance(obj, str) and obj == _EMPTY:
        return {}
    if isinstance(obj, dict):
        return {
            (int(k[len(_INT):]) if isinstance(k, str) and k.startswith(_INT) else k): decode_keys(v)
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [decode_keys(v) for v in obj]
    return obj


# ------------------------------------------------------------------------------------ save


@dataclass
class SaveHooks:
    """Test seams: called between the phases of a save (a raise there = a crash there)."""

    after_global: Callable[[Path], None] | None = None
    before_marker: Callable[[Path], None] | None = None


HOOKS = SaveHooks()


def save_checkpoint(
    save_dir: str | Path,
    iteration: int,
    engine_state: dict[str, Any],
    train_state: dict[str, Any],
    config_yaml: str,
    *,
    rank: int,
    world_size: int,
    keep_latest: int,
) -> Path:
    """Write step ``iteration`` (every rank calls this; rank 0 writes the shared files).

    Order: (stale folder removed) -> DCP global -> per-rank local -> train state + config ->
    barrier -> marker -> ``latest`` -> prune. A crash anywhere before the marker leaves a
    folder that :func:`validate` rejects, so the previous checkpoint stays the one used.
    """
    import torch.distributed.checkpoint as dcp

    root = Path(save_dir)
    folder = root / step_dir_name(iteration)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if folder.exists():  # a half-written leftover of a crashed save of this very step
            shutil.rmtree(folder)
        (folder / "local").mkdir(parents=True)
    _barrier()
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(encode_keys(engine_state["global"]), checkpoint_id=str(folder / "global"))
    if HOOKS.after_global is not None:
        HOOKS.after_global(folder)
    torch.save(engine_state.get("local") or {}, folder / "local" / f"rank_{rank:05d}.pt")
    if rank == 0:
        state = {**train_state, "iteration": iteration, "world_size": world_size,
                 "format": FORMAT_VERSION}
        _atomic_write(folder / TRAIN_STATE, json.dumps(state, indent=2) + "\n")
        _atomic_write(folder / CONFIG, config_yaml)
    _barrier()
    if rank == 0:
        if HOOKS.before_marker is not None:
            HOOKS.before_marker(folder)
        marker = {"iteration": iteration, "world_size": world_size, "time": time.time(),
                  "files": _file_sizes(folder)}
        _atomic_write(folder / MARKER, json.dumps(marker, indent=1) + "\n")
        _atomic_write(root / LATEST, folder.name + "\n")
        prune(root, keep_latest)
    _barrier()
    return folder


def prune(root: Path, keep_latest: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_latest`` and incomplete folders
    older than the newest complete one (leftovers of crashed saves); returns what went."""
    complete = [p for p in step_dirs(root) if validate(p) is None]
    if not complete:
        return []
    newest = _iteration_of(complete[0])
    removed = []
    keep = set(complete[:keep_latest])
    for p in step_dirs(root):
        if p in keep:
            continue
        if p in complete or _iteration_of(p) < newest:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


# ------------------------------------------------------------------------------- discover


def _iteration_of(folder: Path) -> int:
    m = _STEP_DIR.match(folder.name)
    return int(m.group(1)) if m else -1


def step_dirs(root: str | Path) -> list[Path]:
    """Step folders under ``root``, newest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(dirs, key=_iteration_of, reverse=True)


def validate(folder: str | Path) -> str | None:
    """``None`` when ``folder`` is a complete checkpoint, else why not (one short phrase)."""
    folder = Path(folder)
    marker = folder / MARKER
    if not marker.is_file():
        return "incomplete (no completion marker: the save was interrupted)"
    try:
        info = json.loads(marker.read_text())
        files = info["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"corrupt ({MARKER} is unreadable)"
    for rel, size in files.items():
        p = folder / rel
        if not p.is_file():
            return f"corrupt ({rel} is missing)"
        if p.stat().st_size != size:
            return f"corrupt ({rel} has {p.stat().st_size} bytes, expected {size})"
    if not (folder / "global" / ".metadata").is_file() or not (folder / TRAIN_STATE).is_file():
        return "corrupt (global/.metadata or train_state.json missing)"
    return None


def is_step_dir(path: str | Path) -> bool:
    return bool(_STEP_DIR.match(Path(path).name)) or (Path(path) / MARKER).exists()


@dataclass
class Candidates:
    """Valid checkpoints to try, newest first, and what was skipped (for the log)."""

    valid: list[Path]
    skipped: list[str]


def find_checkpoints(path: str | Path) -> Candidates:
    """Valid checkpoints in ``path`` (a save folder or one step folder), newest first.

    The ``latest`` pointer, when it names a valid folder, comes first (it is normally the
    newest anyway); invalid folders are listed in ``skipped`` with the reason.
    """
    path = Path(path)
    if is_step_dir(path) and not (path / LATEST).exists():
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
    pointer = path / LATEST
    if pointer.is_file():
        named = path / pointer.read_text().strip()
        if named in valid:
            valid.remove(named)
            valid.insert(0, named)
    return Candidates(valid, skipped)


def read_train_state(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / TRAIN_STATE).read_text())


# ------------------------------------------------------------------------------------ load


def load_checkpoint(folder: str | Path, rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``({"global": ..., "local": ... or None}, train_state)`` of one complete step folder.

    ``local`` is None when the checkpoint was written at another world size (RNG streams per
    rank do not map across sizes; the engine re-seeds them).
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    folder = Path(folder)
    why = validate(folder)
    if why is not None:
        raise CheckpointError(f"checkpoint {folder} is {why}")
    train_state = read_train_state(folder)
    state: dict[str, Any] = {}
    try:
        # Every rank reads the full replicated state on its own: no collective, no template.
        _load_state_dict(state, storage_reader=FileSystemReader(str(folder / "global")),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {folder} could not be read: {type(e).__name__}: {e}") from e
    local = None
    local_file = folder / "local" / f"rank_{rank:05d}.pt"
    if train_state.get("world_size") == world_size and local_file.is_file():
        try:
            local = torch.load(local_file, map_location="cpu", weights_only=False)
        except Exception as e:
            raise CheckpointError(f"checkpoint {local_file} could not be read: {e}") from e
    return {"global": decode_keys(state), "local": local}, train_state
