"""Filesystem failures during a run (issue 20, row 7): a save that hits a full disk or a
checkpoint folder that became read-only, and a run folder that cannot take ``summary.json``.

Each exits 3 with one stderr line naming the path, what failed and the fix, and no traceback,
after writing what it can: every metrics line, ``summary.json`` (status ``failed``, the error),
and the previous checkpoint intact and loadable (a resume continues from it). The failures are
injected where lptrain writes (the test may run as root, which chmod does not stop); each
raises the ``OSError`` the kernel gives (ENOSPC, EACCES), so the handling is the real one.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from lptrain.checkpoint import store, validate, verify
from lptrain.cli import app
from lptrain.train import loop
from lptrain.train.engine import TrainEngine

N = 4


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _run(out: Path, cache: Path, *extra: str) -> Any:
    return CliRunner().invoke(app, [
        "pretrain", "--recipe", "tiny_cpu.yaml", "--output-dir", str(out), f"data.cache_dir={cache}",
        "data.builtin_max_mb=1", "logging.progress=false", "logging.plots=false", "train.eval_iters=1",
        "train.log_interval=null", f"train.train_iters={N}", "train.global_batch_size=2",
        "train.micro_batch_size=2", "model.seq_length=64", "optimizer.warmup_iters=1",
        f"checkpoint.save={out}/ckpt", "checkpoint.save_interval=2", *extra])


def _one_error_line(r: Any) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "Traceback" not in r.output and "internal error" not in r.output
    return lines[0]


def _full_disk_at_last_save(monkeypatch: pytest.MonkeyPatch) -> str:
    real = store.write_bytes_hashed

    def write(path: Path, data: bytes) -> dict[str, Any]:
        if f"iter_{N:07d}" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, data)

    monkeypatch.setattr(store, "write_bytes_hashed", write)
    return "No space left on device"


def _read_only_at_last_save(monkeypatch: pytest.MonkeyPatch) -> str:
    real = store._prepare

    def prepare(root: Path, folder: Path) -> None:
        if folder.name == f"iter_{N:07d}":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(root))
        real(root, folder)

    monkeypatch.setattr(store, "_prepare", prepare)
    return "Permission denied"


@pytest.mark.parametrize("inject", [_full_disk_at_last_save, _read_only_at_last_save])
def test_failed_save_exits_3_keeps_previous_checkpoint(
    inject: Any, tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        why = inject(m)
        r = _run(out, cache_dir)
    line = _one_error_line(r)
    assert r.exit_code == 3
    assert f"checkpoint save to {out}/ckpt/iter_{N:07d} failed: {why}" in line
    assert f"the previous checkpoint {out}/ckpt/iter_0000002 is still usable" in line and "fix:" in line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "checkpoint save" in summary["error"]
    assert summary["checkpoint"] == f"{out}/ckpt/iter_0000002"
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert not (out / "ckpt" / f"iter_{N:07d}").exists()  # the half-written folder is gone
    previous = out / "ckpt" / "iter_0000002"
    assert validate(previous) is None and verify(previous) == (None, True)
    r = _run(out, cache_dir)  # the disk is back: the same command resumes from step 2
    assert r.exit_code == 0, r.output
    assert f"resuming from {previous} (step 2)" in r.stdout


def test_unwritable_run_folder_at_the_end_exits_3(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = loop.write_atomically

    def write(path: Path, data: Any) -> Path:
        if Path(path).name == "summary.json":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, data)

    out = tmp_path / "run"
    monkeypatch.setattr(loop, "write_atomically", write)
    r = _run(out, cache_dir, f"train.train_iters={N // 2}")
    line = _one_error_line(r)
    assert r.exit_code == 3 and f"cannot write {out}/summary.json: Permission denied" in line
    assert "fix:" in line and not (out / "summary.json").exists()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == N // 2
    assert validate(out / "ckpt" / "iter_0000002") is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits: the injected cases above hold")
def test_checkpoint_folder_made_read_only_mid_run(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real thing where permission bits bind: ``chmod a-w`` on the checkpoint folder
    after step 3, so the save of step 4 fails."""
    real_step = TrainEngine.train_step
    out = tmp_path / "run"

    def step_then_chmod(self: TrainEngine, micro: Any, step: int, **kw: Any) -> Any:
        if step == 3:
            (out / "ckpt").chmod(0o555)
        return real_step(self, micro, step, **kw)

    monkeypatch.setattr(TrainEngine, "train_step", step_then_chmod)
    try:
        r = _run(out, cache_dir)
    finally:
        (out / "ckpt").chmod(0o755)
    line = _one_error_line(r)
    assert r.exit_code == 3 and "Permission denied" in line and "iter_0000002 is still usable" in line
    assert validate(out / "ckpt" / "iter_0000002") is None
