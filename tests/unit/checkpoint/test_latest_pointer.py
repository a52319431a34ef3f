"""The ``latest`` pointer is a hint (issue 43, failure 5 and a smaller item): a pointer that is
not text, names no step folder or is a folder itself never stops a resume of valid checkpoints;
it is ignored with a note. A ``latest`` folder where the next save must write the pointer is
refused before the run starts (it used to fail only at that save, exit 3)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lptrain.checkpoint import find_checkpoints, folders, save_checkpoint
from lptrain.train.run_dir import RunDirRefused, plan_run


def _save(root: Path, it: int) -> Path:
    state = {"global": {"model": {"w": torch.full((2, 2), float(it))}}, "local": {}}
    return save_checkpoint(root, it, state, {"consumed_samples": it}, "a: 1\n", rank=0,
                           world_size=1, keep_latest=3)


def _cfg(save: Path) -> SimpleNamespace:
    return SimpleNamespace(checkpoint=SimpleNamespace(save=str(save), load=None),
                           train=SimpleNamespace(train_iters=10))


@pytest.fixture
def two_checkpoints(tmp_path: Path) -> Path:
    root = tmp_path / "run" / "ckpt"
    _save(root, 1)
    _save(root, 2)
    return root


@pytest.mark.parametrize("pointer", [b"iter_00\xff0002\n", b"\x80\x81", b"../../etc\n", b""])
def test_unusable_pointer_is_a_note_and_both_checkpoints_stay(two_checkpoints: Path, pointer: bytes) -> None:
    root = two_checkpoints
    (root / "latest").write_bytes(pointer)
    found = find_checkpoints(root)
    assert found.valid == [root / "iter_0000002", root / "iter_0000001"]
    assert len(found.skipped) == 1 and f"pointer {root / 'latest'}" in found.skipped[0]
    assert "ignored" in found.skipped[0]
    plan = plan_run(_cfg(root), root.parent)
    assert plan.candidates[0] == root / "iter_0000002" and plan.notes == found.skipped


def test_non_utf8_pointer_crashed_before_the_fix(two_checkpoints: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The regression: the pointer read as text raised UnicodeDecodeError (the CLI's exit 70)."""
    root = two_checkpoints
    (root / "latest").write_bytes(b"iter_00\xff0002\n")

    def read_as_text(root_: Path) -> tuple[Path | None, str | None]:
        return Path(root_) / (Path(root_) / "latest").read_text().strip(), None

    monkeypatch.setattr(folders, "read_latest", read_as_text)
    with pytest.raises(UnicodeDecodeError):
        find_checkpoints(root)


def test_pointer_to_an_older_checkpoint_still_orders_it_first(two_checkpoints: Path) -> None:
    (two_checkpoints / "latest").write_bytes(b"iter_0000001\n")
    found = find_checkpoints(two_checkpoints)
    assert found.valid[0].name == "iter_0000001" and found.skipped == []


def test_latest_folder_is_refused_before_the_run_starts(two_checkpoints: Path) -> None:
    root = two_checkpoints
    (root / "latest").unlink()
    (root / "latest").mkdir()
    found = find_checkpoints(root)  # reading still works: the folder is ignored, with a note
    assert [p.name for p in found.valid] == ["iter_0000002", "iter_0000001"]
    assert "is a folder" in found.skipped[0]
    with pytest.raises(RunDirRefused, match=r"latest is a folder.*remove or rename it") as info:
        plan_run(_cfg(root), root.parent)
    assert info.value.exit_code == 2 and "\n" not in str(info.value)


def test_a_pointer_leading_out_of_the_folder_is_not_followed_nor_echoed(
    two_checkpoints: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 52, item 21: ``latest`` linked to a file outside the checkpoint folder was read
    and its content printed (``root:x:0:0:...`` of /etc/passwd)."""
    root = two_checkpoints
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "latest").unlink()
    (root / "latest").symlink_to(secret)
    found = find_checkpoints(root)
    assert [p.name for p in found.valid] == ["iter_0000002", "iter_0000001"]
    assert found.skipped == [f"pointer {root / 'latest'} is a symbolic link, not the file lptrain "
                             "writes there: ignored without reading it, the newest valid "
                             "checkpoint is used"]
    (root / "latest").unlink()
    (root / "latest").write_text("root:x:0:0:root:/root:/bin/bash\n")  # a copy of it: not echoed
    (note,) = find_checkpoints(root).skipped
    assert "root:" not in note and "does not name an iter_* folder (32 bytes)" in note

    (root / "latest").unlink()
    (root / "latest").symlink_to(secret)
    monkeypatch.setattr(folders, "is_link", lambda path: False)  # the fix removed: followed
    (note,) = find_checkpoints(root).skipped
    assert "(32 bytes)" in note  # it read the file outside the folder


def test_pruning_a_linked_step_folder_removes_the_link_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 52, item 21: the pruner created ``.readers.lock`` inside the target of a step
    folder that was a symbolic link to a checkpoint outside the run."""
    from lptrain.checkpoint import lease, prune

    outside = tmp_path / "elsewhere"
    _save(outside, 1)
    root = tmp_path / "run" / "ckpt"
    (root).mkdir(parents=True)
    (root / "iter_0000001").symlink_to(outside / "iter_0000001")
    for it in (2, 3, 4):
        _save(root, it)  # keep_latest=3: iter_0000001 goes
    assert not (root / "iter_0000001").exists() and not (root / "iter_0000001").is_symlink()
    target = outside / "iter_0000001"
    assert sorted(p.name for p in target.iterdir()) == sorted(
        ["COMPLETE.json", "global", "local", "resolved_config.yaml", "train_state.json"])
    assert not (target / lease.LEASE).exists()

    (root / "iter_0000002").rename(root / "moved")  # the fix removed: the lease goes into the target
    (root / "iter_0000002").symlink_to(root / "moved")
    monkeypatch.setattr(lease, "unlinked_if_link", lambda folder: False)
    prune(root, keep_latest=2)
    assert (root / "moved" / lease.LEASE).exists()
