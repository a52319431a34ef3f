"""A save that fails on one rank fails on every rank, the same way (two gloo ranks, one
spawn): rank 1's local file hits a full disk, both ranks raise the same
:class:`CheckpointSaveError` naming rank 1, the half-written folder is gone and the previous
checkpoint is still valid -- nobody waits forever in a barrier for the rank that failed."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from lptrain.testing.dist import run_distributed


def _save_twice_rank1_disk_full(rank: int, world_size: int, root: str) -> tuple[str, str | None, bool]:
    from lptrain.checkpoint import CheckpointSaveError, save_checkpoint, store, validate, verify

    state = {"global": {"model": {"w": torch.arange(64.0)}}, "local": {"rank": torch.tensor(rank)}}
    save_checkpoint(root, 1, state, {}, "a: 1\n", rank=rank, world_size=world_size, keep_latest=2)
    real = store.write_bytes_hashed

    def full_on_rank1(path: Path, data: bytes) -> dict:
        if rank == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, data)

    store.write_bytes_hashed = full_on_rank1
    try:
        save_checkpoint(root, 2, state, {}, "a: 1\n", rank=rank, world_size=world_size, keep_latest=2)
    except CheckpointSaveError as e:
        message = str(e)
    else:
        message = "no error"
    torch.distributed.barrier()  # rank 0 removes the half-written folder on its way out
    first = Path(root) / "iter_0000001"
    problem, verified = verify(first)
    return message, validate(first) or problem, verified and not (Path(root) / "iter_0000002").exists()


@pytest.mark.dist
def test_a_failed_save_on_one_rank_fails_on_all(tmp_path: Path) -> None:
    results = run_distributed(_save_twice_rank1_disk_full, 2, args=(str(tmp_path / "ckpt"),), timeout_s=120)
    (m0, bad0, gone0), (m1, bad1, gone1) = results
    assert m0 == m1 and f"checkpoint save to {tmp_path}/ckpt/iter_0000002 failed (rank 1): No space left" in m0
    assert f"the previous checkpoint {tmp_path}/ckpt/iter_0000001 is still usable" in m0
    assert bad0 is None and bad1 is None and gone0 and gone1
