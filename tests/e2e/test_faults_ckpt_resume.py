"""Faults in checkpoints and in resumed configs (issue 20, rows 1-5), through ``lptrain
pretrain`` in-process.

One straight run of N steps saves every step (the baseline). Each test copies the first
checkpoints of it into a fresh run folder, damages them or changes the config, and runs the
same command again:

* rows 1-3 -- a bit flipped in a DCP file, a same-size scramble of one (in a checkpoint
  without checksums, so DCP itself fails with its ``CheckpointException``), a same-size
  garbage ``train_state.json`` -- fall back, naming each file, to the oldest checkpoint (one
  written without checksums, which loads saying it could not be verified), and the resumed
  run is the baseline bitwise (metrics and final state);
* rows 4-5 -- a changed model width, a changed optimizer (both ways) -- are refused with one
  line naming the key, the folder byte for byte as before; ``checkpoint.load_optimizer=false``
  resumes the saved weights with a fresh optimizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from lptrain.checkpoint import load_checkpoint, store
from lptrain.cli import app
from lptrain.testing.parity import first_difference

N = 5  # steps of the baseline; the damaged runs resume from step 1 and redo 2..5


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # the tiny model's GEMMs gain nothing from a second thread


def _args(out: Path, cache: Path, *extra: str) -> list[str]:
    return ["pretrain", "--recipe", "tiny_cpu.yaml", "--output-dir", str(out),
            f"data.cache_dir={cache}", "data.builtin_max_mb=1", "logging.progress=false",
            "logging.plots=false", "train.eval_iters=1", "train.log_interval=null",
            f"train.train_iters={N}", "train.global_batch_size=2", "train.micro_batch_size=2",
            "model.seq_length=64", "optimizer.warmup_iters=1", f"checkpoint.save={out}/ckpt",
            "checkpoint.save_interval=1", f"checkpoint.keep_latest={N}", *extra]


def _run(out: Path, cache: Path, *extra: str) -> Any:
    return CliRunner().invoke(app, _args(out, cache, *extra))


def _metrics(out: Path) -> list[tuple]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in recs]


def _state(out: Path, step: int) -> dict[str, Any]:
    state, _ = load_checkpoint(out / "ckpt" / f"iter_{step:07d}", rank=0, world_size=1)
    return state["global"]


def _one_error_line(r: Any) -> str:
    """The run's stderr is exactly one ``error:`` line, and no traceback anywhere."""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.output
    return lines[0]


def _fingerprint(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lptrain.lock"}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    cache = tmp_path_factory.mktemp("cache")
    out = tmp_path_factory.mktemp("baseline") / "run"
    r = _run(out, cache)
    assert r.exit_code == 0, r.output
    return out, cache


def _copy_until(base: Path, dest: Path, last: int) -> Path:
    """A run folder as the baseline's was after step ``last`` (checkpoints 1..last)."""
    (dest / "ckpt").mkdir(parents=True)
    for step in range(1, last + 1):
        name = f"iter_{step:07d}"
        shutil.copytree(base / "ckpt" / name, dest / "ckpt" / name)
    (dest / "ckpt" / "latest").write_text(f"iter_{last:07d}\n")
    lines = (base / "metrics.jsonl").read_text().splitlines()[:last]
    (dest / "metrics.jsonl").write_text("".join(x + "\n" for x in lines))
    shutil.copy(base / "resolved_config.yaml", dest / "resolved_config.yaml")
    return dest


def _strip_checksums(folder: Path) -> None:
    """Make ``folder`` a checkpoint of before checksums (format 1: the marker lists sizes)."""
    marker = json.loads((folder / store.MARKER).read_text())
    marker["files"] = {rel: info["bytes"] for rel, info in marker["files"].items()}
    del marker["checksum"], marker["format"]
    (folder / store.MARKER).write_text(json.dumps(marker))


def test_damaged_checkpoints_fall_back_and_resume_bitwise(baseline: tuple[Path, Path], tmp_path: Path) -> None:
    base, cache = baseline
    out = _copy_until(base, tmp_path / "run", 4)
    ck = out / "ckpt"
    distcp = ck / "iter_0000004" / "global" / "__0_0.distcp"
    data = bytearray(distcp.read_bytes())
    data[len(data) // 2] ^= 0x10  # row 1: one bit in the middle of the tensor data
    distcp.write_bytes(bytes(data))
    _strip_checksums(ck / "iter_0000003")  # row 2: DCP itself must fail, and be caught
    scrambled = ck / "iter_0000003" / "global" / "__0_0.distcp"
    scrambled.write_bytes(os.urandom(scrambled.stat().st_size))
    state_file = ck / "iter_0000002" / "train_state.json"  # row 3: same-size garbage
    state_file.write_bytes(b"#" * state_file.stat().st_size)
    _strip_checksums(ck / "iter_0000001")  # the one left loads, unverified

    r = _run(out, cache)
    assert r.exit_code == 0, r.output
    assert r.stderr == "" and "Traceback" not in r.output
    log = r.stdout
    assert f"{ck}/iter_0000002: corrupt (train_state.json fails its checksum" in log
    assert f"could not load checkpoint {ck}/iter_0000004" in log
    assert "global/__0_0.distcp fails its checksum" in log
    assert f"could not load checkpoint {ck}/iter_0000003 (checkpoint {ck}/iter_0000003/global could not be read" in log
    assert f"{ck}/iter_0000001 has no checksums" in log and "could not be verified" in log
    assert f"resuming from {ck}/iter_0000001 (step 1)" in log
    assert _metrics(out) == _metrics(base)  # losses, grad norms, lrs: float equality
    diff = first_difference(_state(out, N), _state(base, N))  # fp32 masters, optimizer state
    assert diff is None, diff


def test_incompatible_resume_refused_and_fresh_optimizer_override(
    baseline: tuple[Path, Path], tmp_path: Path
) -> None:
    """Rows 4-5; ``checkpoint.load_optimizer=false`` is the documented way to switch."""
    base, cache = baseline
    out = _copy_until(base, tmp_path / "run", 2)
    before = _fingerprint(out)
    r = _run(out, cache, "model.hidden_size=128")
    line = _one_error_line(r)
    assert r.exit_code == 2 and "model.hidden_size is 64 there, 128 now" in line
    assert "model.hidden_size=64" in line  # the fix
    r = _run(out, cache, "optimizer.name=muon")
    line = _one_error_line(r)
    assert r.exit_code == 2 and "optimizer.name is 'adamw' there, 'muon' now" in line
    assert "checkpoint.load_optimizer=false" in line
    assert _fingerprint(out) == before  # resolved_config.yaml included: nothing changed

    # (optimizer.decay_iters: the saved run's decay length, as a shorter train_iters would change it)
    r = _run(out, cache, "optimizer.name=muon", "checkpoint.load_optimizer=false", "train.train_iters=3",
             f"optimizer.decay_iters={N}")
    assert r.exit_code == 0, r.output
    assert "the optimizer starts fresh from the saved weights" in r.stdout
    # step 3's loss is the forward pass of the weights saved at step 2 on the same batch
    assert _metrics(out)[2][1] == _metrics(base)[2][1]
    muon = _state(out, 3)["optimizer"]
    assert any("momentum_buffer" in entry for entry in muon.values())
    assert not any("momentum_buffer" in entry for entry in _state(base, 3)["optimizer"].values())

    before = _fingerprint(out)  # now a Muon run: back to AdamW is refused the same way
    r = _run(out, cache, "train.train_iters=4", f"optimizer.decay_iters={N}")
    line = _one_error_line(r)
    assert r.exit_code == 2 and "optimizer.name is 'muon' there, 'adamw' now" in line
    assert _fingerprint(out) == before
