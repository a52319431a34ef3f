"""A checkpoint never runs code (issue 52, item 15): every pickle in it is read through an
allow-list (:mod:`lptrain.checkpoint.restricted`).

Each crafted file below carries a pickle whose ``__reduce__`` runs ``touch SENTINEL`` through
``os.system``, and the completion marker is re-sealed with the file's new size and xxh3 (what
an attacker who can write the folder does: the checksums catch accident, not intent). The
load must refuse it naming the global, and the sentinel must not appear; each test also runs
the same load with the restriction monkeypatched away, to show the crafted file really does
run its command through the unrestricted reader the fix replaced.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from lptrain.checkpoint import CheckpointError, load_checkpoint, restricted, save_checkpoint, store
from lptrain.checkpoint.integrity import file_entry


class _Payload:
    """Unpickling this runs ``touch <path>`` (the crafted file's code)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def _checkpoint(root: Path) -> Path:
    state = {"global": {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optimizer": {}, "scaling": {}},
             "local": {"torch_rng": torch.get_rng_state()}}
    return save_checkpoint(root, 1, state, {"consumed_samples": 2}, "a: 1\n", rank=0,
                           world_size=1, keep_latest=2)


def _reseal(folder: Path, rel: str) -> None:
    """Record ``rel``'s new size and checksum in the marker, as a crafting attacker would."""
    marker = json.loads((folder / store.MARKER).read_text())
    marker["files"][rel] = file_entry(folder / rel)
    (folder / store.MARKER).write_text(json.dumps(marker))


def _unrestricted_torch_load(path: Any, where: str) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


def test_a_crafted_local_file_is_refused_and_runs_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _checkpoint(tmp_path / "ckpt")
    sentinel = tmp_path / "ran"
    torch.save({"torch_rng": torch.get_rng_state(), "x": _Payload(sentinel)}, folder / "local" / "rank_00000.pt")
    _reseal(folder, "local/rank_00000.pt")

    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder, rank=0, world_size=1)
    assert str(err.value) == (
        f"{folder}/local/rank_00000.pt: refused: it names posix.system, which no checkpoint "
        "lptrain writes holds (crafted, or written by another program); fix: resume from or "
        "export another checkpoint; only load checkpoints from sources you trust")
    assert not sentinel.exists()

    monkeypatch.setattr(restricted, "load_weights_only", _unrestricted_torch_load)  # the fix, removed
    load_checkpoint(folder, rank=0, world_size=1)
    assert sentinel.exists()  # torch.load(weights_only=False) ran the file's command


def test_crafted_dcp_metadata_is_refused_and_runs_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _checkpoint(tmp_path / "ckpt")
    sentinel = tmp_path / "ran"
    (folder / "global" / ".metadata").write_bytes(pickle.dumps(_Payload(sentinel)))
    _reseal(folder, "global/.metadata")

    with pytest.raises(CheckpointError, match=r"global/\.metadata: refused: it names posix\.system"):
        load_checkpoint(folder, rank=0, world_size=1)
    assert not sentinel.exists()

    def unrestricted(path: Path) -> Any:  # what DCP's FileSystemReader.read_metadata does
        return pickle.loads(path.read_bytes())

    monkeypatch.setattr(restricted, "read_metadata", unrestricted)  # the fix, removed
    with pytest.raises(CheckpointError):
        load_checkpoint(folder, rank=0, world_size=1)
    assert sentinel.exists()


def test_a_crafted_dcp_byte_item_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP saves a non-tensor value as a ``torch.save`` blob that its default planner reads
    back with ``weights_only=False``."""
    import torch.distributed.checkpoint as dcp

    sentinel = tmp_path / "ran"
    with pytest.warns(UserWarning):  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.ones(2), "note": _Payload(sentinel)}, checkpoint_id=str(tmp_path / "g"))
    assert not sentinel.exists()
    with pytest.raises(CheckpointError, match=r"\(note\): refused: it names posix\.system"):
        restricted.read_global(tmp_path / "g")
    assert not sentinel.exists()

    monkeypatch.setattr(restricted, "load_weights_only", _unrestricted_torch_load)  # the fix, removed
    restricted.read_global(tmp_path / "g")
    assert sentinel.exists()


def test_te_extra_state_is_checked_before_te_unpickles_it(tmp_path: Path) -> None:
    """Transformer Engine's ``set_extra_state`` unpickles its byte tensor itself: a crafted
    state is refused before TE sees it. (The state TE's own modules write passes the check:
    tests/unit/precision/test_te_manifest.py, which builds them.)"""
    sentinel = tmp_path / "ran"
    bad = torch.frombuffer(bytearray(pickle.dumps({"recipe": _Payload(sentinel)})), dtype=torch.uint8)
    with pytest.raises(CheckpointError, match=r"m \(Transformer Engine extra state\): refused: it names posix\.system"):
        restricted.check_te_extra_state(bad, "m")
    # a tensor's storage travels as a nested torch.save blob: read weights-only as well
    nested = io.BytesIO()
    torch.save(_Payload(sentinel), nested)
    blob = pickle.dumps(_StorageBlob(nested.getvalue()))
    with pytest.raises(CheckpointError, match=r"refused: it names posix\.system"):
        restricted.check_te_extra_state(torch.frombuffer(bytearray(blob), dtype=torch.uint8), "m")
    assert not sentinel.exists()


class _StorageBlob:
    """Pickles as ``torch.storage._load_from_bytes(blob)``, as a tensor's storage does."""

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def __reduce__(self) -> tuple[Any, ...]:
        from torch.storage import _load_from_bytes

        return (_load_from_bytes, (self.blob,))


def test_a_scrambled_metadata_is_one_error_without_tracebacks(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 52, item 18: in a checkpoint without checksums a scrambled ``.metadata`` reached
    DCP, which logged two tracebacks (26 lines on stderr) while it tried a per-rank file; now
    it is read (restricted) before DCP starts, and is one error naming it."""
    import logging

    folder = _checkpoint(tmp_path / "ckpt")
    marker = json.loads((folder / store.MARKER).read_text())  # a marker with sizes only
    marker["files"] = {rel: info["bytes"] for rel, info in marker["files"].items()}
    del marker["checksum"], marker["format"]
    (folder / store.MARKER).write_text(json.dumps(marker))
    meta = folder / "global" / ".metadata"
    meta.write_bytes(bytes(range(256)) * (meta.stat().st_size // 256) + b"\0" * (meta.stat().st_size % 256))
    capfd.readouterr()
    caplog.set_level(logging.INFO)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder, rank=0, world_size=1)
    assert str(err.value).startswith(f"{meta} could not be read (UnpicklingError: ")
    assert capfd.readouterr().err == ""
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
