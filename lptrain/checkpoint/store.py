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
the one a resume uses (:mod:`lptrain.checkpoint.save_errors`). Finding and validating folders
is :mod:`lptrain.checkpoint.folders`; pruning skips a folder a reader holds a lease on
(:mod:`lptrain.checkpoint.lease`).

DCP runs without an initialised process group too (single process: no collectives). Loading
reads the whole "global" state on every rank (``_EmptyStateDictLoadPlanner``: no template
needed, so optimizer state that a freshly built engine does not have yet is still read), which
is what makes it reshardable: the engine receives canonical, unsharded names.
"""

from __future__ import annotations

import io
import json
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lptrain.checkpoint.atomic import write_atomically
from lptrain.checkpoint.folders import (
    CONFIG,
    FORMAT_VERSION,
    LATEST,
    MARKER,
    TRAIN_STATE,
    Candidates,
    CheckpointError,
    find_checkpoints,
    is_step_dir,
    iteration_of,
    read_latest,
    read_train_state,
    step_dir_name,
    step_dirs,
    validate,
    verify,
)
from lptrain.checkpoint.integrity import (
    ALGORITHM,
    digest_bytes,
    entry,
    file_entry,
    write_bytes_hashed,
)
from lptrain.checkpoint.lease import LEASE, reading, remove_unless_read
from lptrain.checkpoint.save_errors import (
    CheckpointSaveError,
    agree,
    attempt,
    describe,
    raise_unwrapped,
)

__all__ = [
    "CONFIG", "LATEST", "MARKER", "TRAIN_STATE", "Candidates", "CheckpointError",
    "CheckpointSaveError", "decode_keys", "describe", "encode_keys", "find_checkpoints",
    "is_step_dir", "load_checkpoint", "prune", "raise_unwrapped", "read_latest",
    "read_train_state", "save_checkpoint", "step_dir_name", "step_dirs", "validate", "verify",
    "write_bytes_hashed",
]


def _atomic_write(path: Path, text: str) -> dict[str, Any]:
    """Write ``text`` atomically (readers see the old file or the new one); its marker entry."""
    data = text.encode()
    write_atomically(path, data)
    return entry(len(data), digest_bytes(data))


def _folder_files(folder: Path) -> list[str]:
    return [
        str(p.relative_to(folder)) for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in (MARKER, LEASE)
        and not (p.name.startswith(".") and ".tmp" in p.name)
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
    used; a write failure raises :class:`CheckpointSaveError` on every rank.
    """
    root = Path(save_dir)
    folder = root / step_dir_name(iteration)
    agree(attempt(lambda: _prepare(root, folder), folder) if rank == 0 else None, root, folder)
    err = attempt(lambda: _write_global(folder, encode_keys(engine_state["global"])), folder)
    if err is None and HOOKS.after_global is not None:
        HOOKS.after_global(folder)
    written: dict[str, Any] = {}
    if err is None:
        err = attempt(lambda: written.update(
            _write_rank_files(folder, engine_state, train_state, config_yaml, iteration,
                              rank, world_size)), folder)
    parts = agree(err, root, folder, written)
    if rank == 0:
        if HOOKS.before_marker is not None:
            HOOKS.before_marker(folder)
        err = attempt(lambda: _commit(root, folder, iteration, world_size, parts, keep_latest),
                      folder)
    agree(err if rank == 0 else None, root, folder)
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


def prune(root: Path, keep_latest: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_latest`` and incomplete folders
    older than the newest complete one (leftovers of crashed saves); returns what went. A
    folder a reader holds a lease on (an export, another run resuming from it) stays until a
    later save prunes it."""
    complete = [p for p in step_dirs(root) if validate(p) is None]
    if not complete:
        return []
    newest = iteration_of(complete[0])
    removed = []
    keep = set(complete[:keep_latest])
    for p in step_dirs(root):
        if p in keep:
            continue
        if (p in complete or iteration_of(p) < newest) and remove_unless_read(p):
            removed.append(p)
    return removed


# ------------------------------------------------------------------------------------ load


def load_checkpoint(folder: str | Path, rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``({"global": ..., "local": ... or None, "verified": bool}, train_state)`` of one
    complete step folder whose files match their checksums.

    ``local`` is None when the checkpoint was written at another world size (RNG streams per
    rank do not map across sizes; the engine re-seeds them). ``verified`` is False for a
    checkpoint without checksums (written before lptrain recorded them). Any failure --
    a checksum mismatch, DCP's ``CheckpointException`` (a ``BaseException``), a torn pickle --
    is one :class:`CheckpointError` naming the file and what failed, and so is a file whose
    pickle names anything outside lptrain's allow-lists (:mod:`lptrain.checkpoint.restricted`:
    a checkpoint never runs code). The folder is read under
    a reader lease (:mod:`lptrain.checkpoint.lease`): a run still saving into it does not
    prune it meanwhile.
    """
    from lptrain.checkpoint.restricted import load_local, read_global

    folder = Path(folder)
    with reading(folder) as why:  # pinned: a live run's pruner leaves it until this returns
        if why is not None:
            raise CheckpointError(f"checkpoint {folder} is {why}")
        problem, verified = verify(folder)
        if problem is not None:
            raise CheckpointError(f"checkpoint {folder}: {problem}")
        train_state = read_train_state(folder)
        # Every rank reads the full replicated state on its own: no collective, no template;
        # nothing is unpickled outside an allow-list (lptrain.checkpoint.restricted).
        state = read_global(folder / "global")
        local = None
        local_file = folder / "local" / f"rank_{rank:05d}.pt"
        if train_state.get("world_size") == world_size and local_file.is_file():
            local = load_local(local_file)
        return {"global": decode_keys(state), "local": local, "verified": verified}, train_state
