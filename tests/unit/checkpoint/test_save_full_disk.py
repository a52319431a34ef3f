"""A disk that fills up during a save (issue 43, failure 3): every write error of a save is the
one line "checkpoint save to ... failed: No space left on device ...; the previous checkpoint
... is still usable" (a :class:`CheckpointSaveError`, exit 3 through the CLI), and the
half-written step folder is removed.

Two ways of filling the disk:

* a real tmpfs (root only), mounted at every size between "the first checkpoint fits" and
  "the second fits too", so the second save runs out at every write point in turn -- DCP's
  files (where torch's zip writer stopped with ``RuntimeError: [enforce fail at
  inline_container.cc] unexpected pos`` and the run died with exit 70 and the folder left
  behind), the rank file, train_state.json, the config, the marker and ``latest``;
* the same failures injected at each write point, as the kernel (ENOSPC) or torch's writer
  (that ``RuntimeError`` on a filesystem with no free space) gives them: runs anywhere.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from lptrain.checkpoint import CheckpointSaveError, save_checkpoint, save_errors, store, validate

WRITER_ERROR = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
PAGE = 4096


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"global": {"model": {"w": torch.randn(64, 256, generator=g), "b": torch.randn(256, generator=g)},
                       "optimizer": {"state": {0: {"exp_avg": torch.randn(64, 256, generator=g)}}}},
            "local": {"rng": torch.get_rng_state()}}


def _save(root: Path, it: int) -> Path:
    return save_checkpoint(root, it, _state(it), {"consumed_samples": it}, "a: 1\n" * 200,
                           rank=0, world_size=1, keep_latest=2)


def _assert_one_clean_failure(root: Path, err: CheckpointSaveError) -> None:
    text = str(err)
    assert "\n" not in text and err.exit_code == 3
    assert f"checkpoint save to {root}/iter_0000002 failed: No space left on device" in text, text
    assert f"the previous checkpoint {root}/iter_0000001 is still usable" in text, text
    assert not (root / "iter_0000002").exists()  # the half-written folder is gone
    assert validate(root / "iter_0000001") is None
    assert (root / "latest").read_text().strip() == "iter_0000001"


def _mount_tmpfs(where: Path, size: int) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, check=False)
    return r.returncode == 0


def _umount(where: Path) -> None:
    subprocess.run(["umount", str(where)], capture_output=True, check=False)


def _tree_bytes(root: Path) -> int:
    """What the files of ``root`` take on a tmpfs: whole pages."""
    return sum(-(-p.stat().st_size // PAGE) * PAGE for p in root.rglob("*") if p.is_file())


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="mounting a tmpfs needs root")
def test_full_tmpfs_at_every_size_is_one_line(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    one = (_tree_bytes(_save(probe, 1).parent), _tree_bytes(_save(probe, 2).parent))
    first, both = one[0], one[1]
    mnt = tmp_path / "mnt"
    if not _mount_tmpfs(mnt, first + PAGE * 4):
        pytest.skip("this machine does not let the test mount a tmpfs")
    _umount(mnt)
    writer_failures = os_failures = 0
    for size in range(first + PAGE * 4, both + PAGE * 8, PAGE):
        assert _mount_tmpfs(mnt, size)
        try:
            root = mnt / "ck"
            _save(root, 1)
            try:
                _save(root, 2)
            except CheckpointSaveError as e:
                _assert_one_clean_failure(root, e)
                if "torch's writer stopped" in str(e):
                    writer_failures += 1
                else:
                    os_failures += 1
            else:
                assert validate(root / "iter_0000002") is None
        finally:
            _umount(mnt)
    # both shapes of the fault were met: torch's writer (the exit-70 one) and the kernel's
    assert writer_failures and os_failures, (writer_failures, os_failures)


def _writer_fails(folder: Path, state: dict[str, Any]) -> None:
    (folder / "global").mkdir()
    (folder / "global" / "__0_0.distcp").write_bytes(b"x" * 598)  # what torch got out
    raise RuntimeError(WRITER_ERROR)


def _enospc(path: Any) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize("point", ["dcp-writer", "dcp-oserror", "rank-file", "train_state",
                                   "config", "marker", "latest"])
def test_injected_full_disk_at_each_write_point(point: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ck"
    _save(root, 1)
    monkeypatch.setattr(save_errors, "free_bytes", lambda path: 0)  # the disk is full now
    if point == "dcp-writer":
        monkeypatch.setattr(store, "_write_global", _writer_fails)
    elif point == "dcp-oserror":
        monkeypatch.setattr(store, "_write_global", lambda folder, state: (_ for _ in ()).throw(_enospc(folder)))
    elif point == "rank-file":
        monkeypatch.setattr(store, "write_bytes_hashed", lambda path, data: (_ for _ in ()).throw(_enospc(path)))
    else:
        name = {"train_state": "train_state.json", "config": "resolved_config.yaml",
                "marker": "COMPLETE.json", "latest": "latest"}[point]
        real = store.write_atomically

        def write(path: Path, data: Any) -> Path:
            if Path(path).name == name and "iter_0000001" not in str(path) and (
                    name != "latest" or "iter_0000002" in str(data)):
                raise _enospc(path)
            return real(path, data)

        monkeypatch.setattr(store, "write_atomically", write)
    with pytest.raises(CheckpointSaveError) as info:
        _save(root, 2)
    _assert_one_clean_failure(root, info.value)


def test_writer_error_was_an_internal_error_without_the_fix(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The regression: with only ``OSError`` counted as a write failure (the old rule), torch's
    writer error escapes the save (the CLI's exit 70) and leaves the step folder behind."""
    root = tmp_path / "ck"
    _save(root, 1)
    monkeypatch.setattr(save_errors, "free_bytes", lambda path: 0)
    monkeypatch.setattr(store, "_write_global", _writer_fails)
    old = save_errors.classify
    monkeypatch.setattr(save_errors, "classify",
                        lambda e, folder: old(e, folder) if isinstance(e, OSError) else None)
    with pytest.raises(RuntimeError, match="unexpected pos"):
        _save(root, 2)
    assert (root / "iter_0000002").exists()


def test_writer_error_with_room_left_is_a_write_failure(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same writer error on a filesystem with room is not called a full disk."""
    root = tmp_path / "ck"
    _save(root, 1)
    monkeypatch.setattr(store, "_write_global", _writer_fails)
    with pytest.raises(CheckpointSaveError, match=r"failed: write failed \(torch's writer stopped"):
        _save(root, 2)
    assert not (root / "iter_0000002").exists()


def test_a_bug_in_the_state_is_not_a_save_failure(tmp_path: Path) -> None:
    """Only write failures become the one line; a bug still surfaces as itself."""
    bad = {"global": {"model": {(1, 2): torch.zeros(1)}}, "local": {}}
    with pytest.raises(TypeError, match="only str and int keys"):
        save_checkpoint(tmp_path, 1, bad, {}, "", rank=0, world_size=1, keep_latest=2)
