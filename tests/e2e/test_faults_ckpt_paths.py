"""Filesystem problems found before a run starts (issue 20, rows 6 and 11): ``checkpoint.save``
under a file, equal to a file, on a read-only filesystem, without room for a checkpoint, and
an ``--output-dir`` with a 300-character name. ``pretrain --dry-run`` and ``pretrain`` refuse
each with one line naming the key, the path and the fix, exit 2, before anything is written
(no training starts: the loop is replaced by a recorder)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from lptrain.cli import app, preflight
from lptrain.config import World, compose, derive


@pytest.fixture
def trained(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []
    monkeypatch.setattr("lptrain.train.pretrain", lambda cfg, out: calls.append(out))
    return calls


def _pretrain(out: Path, *extra: str, dry_run: bool) -> Any:
    args = ["pretrain", "--recipe", "tiny_cpu.yaml", "--output-dir", str(out), *extra]
    return CliRunner().invoke(app, [*args, "--dry-run"] if dry_run else args)


def _refused(r: Any, *words: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "Traceback" not in r.output
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("dry_run", [True, False])
def test_unusable_checkpoint_folder_refused_before_start(
    tmp_path: Path, trained: list[Any], monkeypatch: pytest.MonkeyPatch, dry_run: bool
) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder\n")
    out = tmp_path / "run"
    r = _pretrain(out, f"checkpoint.save={a_file}/ckpt", dry_run=dry_run)  # under a file
    _refused(r, "checkpoint.save", f"{a_file} is a file", "fix:")
    r = _pretrain(out, f"checkpoint.save={a_file}", dry_run=dry_run)  # equal to a file
    _refused(r, "checkpoint.save", "is a file, not a folder")

    read_only = tmp_path / "ro"  # a read-only mount, as statvfs reports it
    read_only.mkdir()
    real_access = os.access
    monkeypatch.setattr(preflight.os, "access",
                        lambda p, mode: False if Path(p) == read_only else real_access(p, mode))
    monkeypatch.setattr(preflight, "_read_only", lambda p: Path(p) == read_only)
    r = _pretrain(out, f"checkpoint.save={read_only}/ckpt", dry_run=dry_run)
    _refused(r, "checkpoint.save", "read-only filesystem")

    if Path("/proc/self").is_dir():  # a virtual filesystem: said so, not "0.0 MiB free"
        r = _pretrain(out, "checkpoint.save=/proc/lptrain-ckpt", dry_run=dry_run)
        _refused(r, "checkpoint.save", "/proc is on a filesystem without storage",
                 "fix: point checkpoint.save at a folder on a disk")

    size = preflight.checkpoint_bytes(derive(compose("tiny_cpu.yaml", []), World.detect()))
    assert size and size > 12 * 150_000  # fp32 masters and two AdamW moments of 0.16M params
    monkeypatch.setattr("shutil.disk_usage", lambda p: SimpleNamespace(free=size // 2, total=10 * size))
    r = _pretrain(out, f"checkpoint.save={tmp_path}/ckpt", dry_run=dry_run)
    _refused(r, "checkpoint.save", "MiB free, a checkpoint needs about")
    assert trained == [] and not out.exists()  # nothing written, nothing trained


@pytest.mark.parametrize("dry_run", [True, False])
def test_output_dir_name_too_long_refused(tmp_path: Path, trained: list[Any], dry_run: bool) -> None:
    out = tmp_path / ("x" * 300) / "run"
    r = _pretrain(out, dry_run=dry_run)
    _refused(r, "run.output_dir", "has 300 bytes", "limit of 255")
    assert trained == []
