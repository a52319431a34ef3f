"""``lptrain export`` of a run that is still training, and of a folder a killed export left
(issue 43, failure 4).

* The trainer saves a newer checkpoint and prunes while the export reads the newest one: the
  export keeps its checkpoint (a reader lease the pruner respects) and succeeds; without the
  lease the pruner deleted it under DCP's reader (``FileNotFoundError .../global/.metadata``,
  exit 70). After the export the folder is pruned as usual.
* A checkpoint the pruner holds when the export starts is skipped for the next complete one,
  with one note.
* A SIGKILLed export leaves nothing in ``--output`` (it used to leave safetensors' hidden temp
  file, so a plain re-export was refused as "not empty"); the re-export works and removes the
  killed one's staging folder. Every exported file has the same mode (``model.safetensors``
  was 0600, its siblings 0644).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from lptrain.checkpoint import find_checkpoints, prune, validate
from lptrain.checkpoint import lease as lease_mod
from lptrain.cli import app
from lptrain.interop import hf_export
from lptrain.testing.inject import injected_env


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 3-step run that kept a checkpoint of every step."""
    out = tmp_path_factory.mktemp("export") / "run"
    r = CliRunner().invoke(app, [
        "pretrain", "--recipe", "tiny_cpu.yaml", "--output-dir", str(out), "data.builtin_max_mb=1",
        "logging.progress=false", "logging.plots=false", "train.eval_iters=1",
        "train.log_interval=null", "train.train_iters=3", "train.global_batch_size=2",
        "train.micro_batch_size=2", "model.seq_length=32", "optimizer.warmup_iters=1",
        "checkpoint.save_interval=1", "checkpoint.keep_latest=3"])
    assert r.exit_code == 0, r.output
    return out


def _copy_run(run: Path, dst: Path) -> Path:
    shutil.copytree(run, dst)
    return dst / "checkpoints"


def _export(source: Path, output: Path, *extra: str) -> object:
    return CliRunner().invoke(app, ["export", str(source), "--format", "hf", "--output", str(output),
                                    "--no-progress", *extra])


def _save_and_prune_during_read(monkeypatch: pytest.MonkeyPatch, ckpt: Path) -> list[Path]:
    """While the export reads the masters: the trainer's next save (a newer complete
    checkpoint) and its pruning to keep_latest=1."""
    pruned: list[Path] = []
    real = hf_export.read_masters

    def read_while_the_trainer_prunes(step: Path) -> dict:
        shutil.copytree(ckpt / "iter_0000003", ckpt / "iter_0000004")  # a newer complete save
        pruned.extend(prune(ckpt, keep_latest=1))
        return real(step)

    monkeypatch.setattr(hf_export, "read_masters", read_while_the_trainer_prunes)
    return pruned


def test_export_pins_its_checkpoint_while_the_trainer_prunes(
        run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = _copy_run(run, tmp_path / "run")
    pruned = _save_and_prune_during_read(monkeypatch, ckpt)
    r = _export(tmp_path / "run", tmp_path / "hf")
    assert r.exit_code == 0, r.output
    assert f"exported {ckpt / 'iter_0000003'} (step 3)" in r.stdout
    assert pruned == [ckpt / "iter_0000002", ckpt / "iter_0000001"]  # not the one being read
    assert validate(ckpt / "iter_0000003") is None
    assert prune(ckpt, keep_latest=1) == [ckpt / "iter_0000003"]  # the lease went with the export
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()}
    assert len(set(modes.values())) == 1, modes  # model.safetensors like its siblings
    assert modes["model.safetensors"] == 0o666 & ~_umask()


def test_without_the_lease_the_pruner_deleted_it_under_the_reader(
        run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The regression: a pruner that ignores leases deletes the checkpoint mid-read and the
    export ends in an internal error (exit 70)."""
    ckpt = _copy_run(run, tmp_path / "run")
    _save_and_prune_during_read(monkeypatch, ckpt)
    import lptrain.checkpoint.store as store

    def remove_regardless(folder: Path) -> bool:
        shutil.rmtree(folder, ignore_errors=True)
        return True

    monkeypatch.setattr(store, "remove_unless_read", remove_regardless)
    r = _export(tmp_path / "run", tmp_path / "hf")
    assert r.exit_code != 0 and not (tmp_path / "hf").exists(), r.output


def test_a_checkpoint_being_pruned_is_skipped_for_the_next(run: Path, tmp_path: Path) -> None:
    ckpt = _copy_run(run, tmp_path / "run")
    fd = os.open(ckpt / "iter_0000003" / lease_mod.LEASE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the pruner is deleting iter_0000003 right now
        r = _export(tmp_path / "run", tmp_path / "hf")
    finally:
        os.close(fd)
    assert r.exit_code == 0, r.output
    assert f"exported {ckpt / 'iter_0000002'} (step 2)" in r.stdout
    notes = [line for line in r.stdout.splitlines() if "iter_0000003" in line]
    assert notes == [f"note: checkpoint {ckpt / 'iter_0000003'} is being removed by the run that "
                     f"saved it (pruned) (the run is saving and pruning); exporting "
                     f"{ckpt / 'iter_0000002'} instead"], r.stdout


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_KILL_AFTER_FIRST_SHARD = """
import os, signal
import safetensors.torch as st
_real = st.save_file
def _save_then_die(*args, **kwargs):
    _real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
st.save_file = _save_then_die
"""


def test_killed_export_does_not_block_a_plain_re_export(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    killed = subprocess.run(
        [sys.executable, "-m", "lptrain", "export", str(run), "--output", str(out), "--no-progress"],
        env=injected_env(tmp_path / "inject", _KILL_AFTER_FIRST_SHARD), capture_output=True,
        text=True, timeout=300, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not out.exists()  # nothing half-written where the model goes
    stale = list(tmp_path.glob(".hf.partial-*"))
    assert len(stale) == 1 and (stale[0] / ".model.safetensors.tmp").is_file()
    r = _export(run, out)  # the same command again, no --overwrite
    assert r.exit_code == 0, r.output
    assert not list(tmp_path.glob(".hf.partial-*"))  # the killed export's staging is gone
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json",
                                                     "model.safetensors"]
    assert find_checkpoints(run / "checkpoints").valid[0].name == "iter_0000003"
