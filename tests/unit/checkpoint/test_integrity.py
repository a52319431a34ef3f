"""Checksums in the completion marker, atomic small files, and the resume compatibility
check -- on small hand-made states and config dicts (no model, no training)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from lptrain.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
    store,
    validate,
    verify,
)
from lptrain.checkpoint.atomic import write_atomically
from lptrain.checkpoint.compat import (
    IncompatibleCheckpointError,
    check_resume_compatible,
    incompatible_lines,
)
from lptrain.checkpoint.integrity import ALGORITHM, digest_bytes, digest_file


def _save(root: Path, it: int = 2) -> Path:
    state = {"global": {"model": {"w": torch.arange(4096, dtype=torch.float32)}}, "local": {"x": torch.ones(3)}}
    return save_checkpoint(root, it, state, {"consumed_samples": it}, "model:\n  hidden_size: 64\n",
                           rank=0, world_size=1, keep_latest=2)


def test_marker_lists_every_file_with_its_checksum(tmp_path: Path) -> None:
    folder = _save(tmp_path)
    marker = json.loads((folder / store.MARKER).read_text())
    on_disk = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != store.MARKER}
    assert marker["checksum"] == ALGORITHM and set(marker["files"]) == on_disk
    assert {"global/.metadata", "train_state.json", "resolved_config.yaml", "local/rank_00000.pt"} <= on_disk
    for rel, info in marker["files"].items():
        assert info == {"bytes": (folder / rel).stat().st_size, ALGORITHM: digest_file(folder / rel)}
    assert digest_file(folder / "resolved_config.yaml") == digest_bytes(b"model:\n  hidden_size: 64\n")
    assert verify(folder) == (None, True)


def test_any_changed_byte_is_named_and_refused(tmp_path: Path) -> None:
    folder = _save(tmp_path)
    for rel in ("local/rank_00000.pt", "resolved_config.yaml"):
        p = folder / rel
        original = p.read_bytes()
        p.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # same size, one bit
        assert validate(folder) is None  # sizes match: only the checksum tells
        problem, _ = verify(folder)
        assert problem.startswith(f"{rel} fails its checksum")
        with pytest.raises(CheckpointError, match=f"{rel} fails its checksum"):
            load_checkpoint(folder, rank=0, world_size=1)
        p.write_bytes(original)
    state_file = folder / "train_state.json"  # small: checked when folders are listed
    state_file.write_bytes(b" " * state_file.stat().st_size)
    assert "train_state.json fails its checksum" in validate(folder)


def test_checkpoint_without_checksums_loads_unverified(tmp_path: Path) -> None:
    folder = _save(tmp_path)
    marker = json.loads((folder / store.MARKER).read_text())
    marker["files"] = {rel: info["bytes"] for rel, info in marker["files"].items()}
    (folder / store.MARKER).write_text(json.dumps(marker))
    assert validate(folder) is None and verify(folder) == (None, False)
    state, _ = load_checkpoint(folder, rank=0, world_size=1)
    assert state["verified"] is False and torch.equal(state["global"]["model"]["w"], torch.arange(4096.0))
    (folder / "train_state.json").write_text("{not json" + " " * 10)  # no checksum: parse fails
    marker["files"]["train_state.json"] = (folder / "train_state.json").stat().st_size
    (folder / store.MARKER).write_text(json.dumps(marker))
    assert validate(folder) == "corrupt (train_state.json is unreadable)"


def test_dcp_checkpoint_exception_becomes_one_line(tmp_path: Path) -> None:
    """DCP's CheckpointException is a BaseException: it must still become a CheckpointError."""
    folder = _save(tmp_path)
    data = folder / "global" / "__0_0.distcp"
    data.write_bytes(os.urandom(data.stat().st_size))
    marker = json.loads((folder / store.MARKER).read_text())
    marker["files"] = {rel: info["bytes"] for rel, info in marker["files"].items()}
    (folder / store.MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="global could not be read") as info:
        load_checkpoint(folder, rank=0, world_size=1)
    assert "\n" not in str(info.value) and "Traceback" not in str(info.value)


def test_atomic_write_keeps_the_old_file_on_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "summary.json"
    write_atomically(path, '{"status": "completed"}\n')

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("lptrain.checkpoint.atomic.os.fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_atomically(path, '{"status": "failed"}\n')
    assert path.read_text() == '{"status": "completed"}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temp file left


def _cfg(**changes: object) -> dict:
    cfg = {"model": {"hidden_size": 64, "num_layers": 2, "moe": {"num_experts": 0}},
           "optimizer": {"name": "muon"}, "train": {"global_batch_size": 8},
           "precision": {"fp8_format": "hybrid", "fp8_recipe": "delayed", "fp8_amax_history_len": 16,
                         "backend": "emulated"},
           "checkpoint": {"load_optimizer": True}}
    for dotted, value in changes.items():
        node = cfg
        *head, last = dotted.split("__")
        for part in head:
            node = node[part]
        node[last] = value
    return cfg


def test_compatibility_one_line_per_key_with_its_fix() -> None:
    saved = _cfg()
    assert incompatible_lines(saved, _cfg(train__global_batch_size=16), "ck") == []  # carries over
    lines = incompatible_lines(saved, _cfg(model__hidden_size=128, model__moe__num_experts=8,
                                           optimizer__name="adamw", precision__fp8_amax_history_len=4), "ck")
    assert len(lines) == 4
    keys = ["model.hidden_size", "model.moe.num_experts", "optimizer.name", "precision.fp8_amax_history_len"]
    for line, key in zip(lines, keys, strict=True):
        assert line.startswith(f"cannot resume from ck: {key} is ") and "fix: resume with" in line
    assert "checkpoint.load_optimizer=false" in lines[2]
    fresh = _cfg(optimizer__name="adamw", checkpoint__load_optimizer=False)
    assert incompatible_lines(saved, fresh, "ck") == []  # the documented override
    # amax histories only exist under delayed scaling
    assert incompatible_lines(_cfg(precision__fp8_recipe="tensorwise"),
                              _cfg(precision__fp8_recipe="tensorwise", precision__fp8_amax_history_len=4), "ck") == []


def test_compatibility_reads_the_checkpoints_resolved_config(tmp_path: Path) -> None:
    folder = _save(tmp_path)
    check_resume_compatible(folder, {"model": {"hidden_size": 64}})
    with pytest.raises(IncompatibleCheckpointError) as info:
        check_resume_compatible(folder, {"model": {"hidden_size": 32}})
    assert info.value.lines == [
        f"cannot resume from {folder}: model.hidden_size is 64 there, 32 now (the saved weights have "
        "other shapes); fix: resume with model.hidden_size=64, or start a new run in another --output-dir"]
