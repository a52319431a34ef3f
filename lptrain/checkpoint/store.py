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
                                            with its size and checksum (xxh3_64)

Why a marker and not a rename: DCP writes one file per rank straight into the folder, so a
half-written folder is indistinguishable from a finished one except by the marker. A folder
without a marker, or whose files do not match the sizes in the marker, is reported and
skipped; the previous valid one is used. ``latest`` is only a hint (written after the
marker): validation decides. Sizes (and the small ``train_state.json``'s checksum) are
checked when folders are listed (:func:`validate`, cheap); every file's checksum is checked
when one is loaded (:func:`verify`), and a mismatch there, or any error while reading it,
makes the caller fall back to the previous checkpoint (:mod:`lptrain.checkpoint.integrity`).

A save that fails on any rank (a full disk, a folder that became read-only) fails on every
rank with one :class:`CheckpointSaveError` (exit 3) naming the path and the fix: the ranks
agree after each phase, the half-written folder is removed, and the previous checkpoint stays
the one a resume uses.

DCP runs without an initialised process group too (single process: no collectives). Loading
reads the whole "global" state on every rank (``_EmptyStateDictLoadPlanner``: no template
needed, so optimizer state that a freshly built engine does not have yet is still read), which
is what makes it reshardable: the engine receives canonical, unsharded names.
"""

from __future__ import annotations

import errno
import io
import json
import re
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from lptrain.checkpoint.atomic import write_atomically
from lptrain.checkpoint.integrity import (
    ALGORITHM,
    digest_bytes,
    entry,
    file_entry,
    listed_files,
    mismatch,
    write_bytes_hashed,
)
from lptrain.errors import InputError, RunFailedError

MARKER = "COMPLETE.json"
LATEST = "latest"
TRAIN_STATE = "train_state.json"
CONFIG = "resolved_config.yaml"
FORMAT_VERSION = 2  # 2: the marker records a checksum per file; 1: sizes only
_STEP_DIR = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(InputError):
    """A checkpoint could not be found, validated or loaded (the message says which and why;
    exit 2 through the CLI)."""


class CheckpointSaveError(RunFailedError):
    """A save failed during the run (exit 3): the message names the path, what failed, the
    previous checkpoint that stays usable, and the fix."""


def step_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _barrier() -> None:
    d = _dist()
    if d is not None:
        d.barrier()


def _atomic_write(path: Path, text: str) -> dict[str, Any]:
    """Write ``text`` atomically (readers see the old file or the new one); its marker entry."""
    data = text.encode()
    write_atomically(path, data)
    return entry(len(data), digest_bytes(data))


def _folder_files(folder: Path) -> list[str]:
    return [
        str(p.relative_to(folder)) for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MARKER and not (p.name.startswith(".") and ".tmp" in p.name)
    ]


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
    checksums gathered -> marker -> ``latest`` -> prune. A crash anywhere before the marker
    leaves a folder that :func:`validate` rejects, so the previous checkpoint stays the one
    used; a failure (an ``OSError``) raises :class:`CheckpointSaveError` on every rank.
    """
    root = Path(save_dir)
    folder = root / step_dir_name(iteration)
    _agree(_attempt(lambda: _prepare(root, folder)) if rank == 0 else None, root, folder)
    err = _attempt(lambda: _write_global(folder, encode_keys(engine_state["global"])))
    if err is None and HOOKS.after_global is not None:
        HOOKS.after_global(folder)
    written: dict[str, Any] = {}
    if err is None:
        err = _attempt(lambda: written.update(
            _write_rank_files(folder, engine_state, train_state, config_yaml, iteration,
                              rank, world_size)))
    parts = _agree(err, root, folder, written)
    if rank == 0:
        if HOOKS.before_marker is not None:
            HOOKS.before_marker(folder)
        err = _attempt(lambda: _commit(root, folder, iteration, world_size, parts, keep_latest))
    _agree(err if rank == 0 else None, root, folder)
    return folder


def _prepare(root: Path, folder: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    if folder.exists():  # a half-written leftover of a crashed save of this very step
        shutil.rmtree(folder)
    (folder / "local").mkdir(parents=True)


def _write_global(folder: Path, state: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        raise_unwrapped(lambda: dcp.save(state, checkpoint_id=str(folder / "global")))


def _write_rank_files(folder: Path, engine_state: dict[str, Any], train_state: dict[str, Any],
                      config_yaml: str, iteration: int, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's local file (hashed from memory as it is written), the DCP files it wrote
    (hashed now, from the page cache) and on rank 0 the train state and config."""
    buf = io.BytesIO()
    torch.save(engine_state.get("local") or {}, buf)
    rel = f"local/rank_{rank:05d}.pt"
    written = {rel: write_bytes_hashed(folder / rel, buf.getvalue())}
    for p in sorted((folder / "global").glob(f"__{rank}_*")):
        written[f"global/{p.name}"] = file_entry(p)
    if rank == 0:
        state = {**train_state, "iteration": iteration, "world_size": world_size,
                 "format": FORMAT_VERSION}
        written[TRAIN_STATE] = _atomic_write(folder / TRAIN_STATE, json.dumps(state, indent=2) + "\n")
        written[CONFIG] = _atomic_write(folder / CONFIG, config_yaml)
    return written


def _commit(root: Path, folder: Path, iteration: int, world_size: int,
            parts: list[dict[str, Any]], keep_latest: int) -> None:
    """Rank 0: the marker over every file in the folder (checksums the ranks computed, the
    rest -- DCP's ``.metadata`` -- read back now), then ``latest``, then pruning."""
    known: dict[str, Any] = {}
    for part in parts:
        known.update(part or {})
    files = {rel: known.get(rel) or file_entry(folder / rel) for rel in _folder_files(folder)}
    marker = {"iteration": iteration, "world_size": world_size, "time": time.time(),
              "format": FORMAT_VERSION, "checksum": ALGORITHM, "files": files}
    _atomic_write(folder / MARKER, json.dumps(marker, indent=1) + "\n")
    _atomic_write(root / LATEST, folder.name + "\n")
    prune(root, keep_latest)


# --------------------------------------------------------------- failures during a save


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


def _attempt(fn: Callable[[], Any]) -> Optional[tuple[str, str]]:
    """``None`` when ``fn`` ran, else ``(what failed, fix)`` for a filesystem error."""
    try:
        fn()
    except OSError as e:
        fix = _FIXES.get(e.errno or -1, "check that checkpoint.save is a writable folder with room")
        return describe(e), fix
    return None


def _agree(err: Optional[tuple[str, str]], root: Path, folder: Path,
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


def _marker_files(folder: Path) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """The marker's listed files, or why there are none (one short phrase)."""
    marker = folder / MARKER
    if not marker.is_file():
        return None, "incomplete (no completion marker: the save was interrupted)"
    try:
        return listed_files(json.loads(marker.read_text())), None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, f"corrupt ({MARKER} is unreadable)"


def validate(folder: str | Path) -> str | None:
    """``None`` when ``folder`` is a complete checkpoint, else why not (one short phrase).

    Cheap: the marker, every listed file's size, and the small ``train_state.json`` (its
    checksum and that it parses); :func:`verify` checks every checksum."""
    folder = Path(folder)
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
        bad = mismatch(folder, rel, listed)
        if bad is not None:
            return bad, True
    return None, all(f.digest is not None for f in files.values())


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
    """``({"global": ..., "local": ... or None, "verified": bool}, train_state)`` of one
    complete step folder whose files match their checksums.

    ``local`` is None when the checkpoint was written at another world size (RNG streams per
    rank do not map across sizes; the engine re-seeds them). ``verified`` is False for a
    checkpoint without checksums (written before lptrain recorded them). Any failure --
    a checksum mismatch, DCP's ``CheckpointException`` (a ``BaseException``), a torn pickle --
    is one :class:`CheckpointError` naming the file and what failed.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    folder = Path(folder)
    why = validate(folder)
    if why is not None:
        raise CheckpointError(f"checkpoint {folder} is {why}")
    problem, verified = verify(folder)
    if problem is not None:
        raise CheckpointError(f"checkpoint {folder}: {problem}")
    train_state = read_train_state(folder)
    state: dict[str, Any] = {}
    try:
        # Every rank reads the full replicated state on its own: no collective, no template.
        _load_state_dict(state, storage_reader=FileSystemReader(str(folder / "global")),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"checkpoint {folder}/global could not be read ({describe(e)})") from None
    local = None
    local_file = folder / "local" / f"rank_{rank:05d}.pt"
    if train_state.get("world_size") == world_size and local_file.is_file():
        try:
            local = torch.load(local_file, map_location="cpu", weights_only=False)
        except Exception as e:
            raise CheckpointError(f"checkpoint {local_file} could not be read ({describe(e)})") from None
    return {"global": decode_keys(state), "local": local, "verified": verified}, train_state
