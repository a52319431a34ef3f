"""What a hostile operator broke (issue 52, items 15-17, 20 and 21), through ``lptrain`` in-process
on one tiny run (2 steps, a checkpoint of each) copied per test.

* item 15: a crafted ``global/.metadata`` and a crafted ``local/rank_00000.pt``, their sizes
  and checksums re-sealed in ``COMPLETE.json``, run nothing on resume or on ``lptrain export``:
  the resume falls back past both and then refuses in one line (exit 2), the export refuses in
  one line (exit 2);
* item 16: a rollback past a checkpoint with a flipped byte falls back to the older valid one,
  as a resume does; with none loadable the run stops, exit 3;
* item 17: a byte that is not UTF-8 in ``metrics.jsonl`` is one line, exit 2, on resume and in
  ``replay``;
* item 20: ``export --output LINK`` writes into the link's target and leaves the link; a link
  to a missing place is one line, exit 2;
* item 21: a missing dataset is refused before the run folder or its lock exist; ``replay`` of
  a copied run folder reads the copy's checkpoints; a run folder deleted mid-run stops the run
  within the step (exit 3) without recreating anything; a full disk at the end leaves no
  0-byte plot and the error line names every end file not written.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from lptrain.checkpoint import store
from lptrain.checkpoint.integrity import file_entry
from lptrain.cli import app

ARGS = ["--recipe", "tiny_cpu.yaml", "data.builtin_max_mb=1", "logging.progress=false",
        "logging.plots=false", "train.eval_iters=1", "train.log_interval=null",
        "train.global_batch_size=2", "train.micro_batch_size=2", "model.seq_length=32",
        "optimizer.warmup_iters=1", "checkpoint.save_interval=1", "checkpoint.keep_latest=4",
        "optimizer.decay_iters=8"]  # resumes lengthen train_iters: the lr schedule stays the same


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _pretrain(out: Path, *extra: str) -> Any:
    return CliRunner().invoke(app, ["pretrain", *ARGS, "--output-dir", str(out), *extra])


def _one_error(r: Any) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "Traceback" not in r.output
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "run"
    r = _pretrain(out, "train.train_iters=2")
    assert r.exit_code == 0, r.output
    return out


def _copy(run: Path, dst: Path) -> Path:
    shutil.copytree(run, dst)  # resolved_config.yaml's checkpoint.save is the original's
    return dst


class _Payload:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def _craft(folder: Path, rel: str, data: bytes) -> None:
    """Replace ``rel`` and re-seal the marker with its size and xxh3."""
    (folder / rel).write_bytes(data)
    marker = json.loads((folder / store.MARKER).read_text())
    marker["files"][rel] = file_entry(folder / rel)
    (folder / store.MARKER).write_text(json.dumps(marker))


def test_crafted_checkpoint_files_run_nothing_on_resume_or_export(run: Path, tmp_path: Path) -> None:
    out = _copy(run, tmp_path / "run")
    ck = out / "checkpoints"
    sentinel = tmp_path / "ran"
    _craft(ck / "iter_0000002", "global/.metadata", pickle.dumps(_Payload(sentinel)))
    local = torch.serialization.io.BytesIO()  # type: ignore[attr-defined]
    torch.save({"torch_rng": torch.get_rng_state(), "x": _Payload(sentinel)}, local)
    _craft(ck / "iter_0000001", "local/rank_00000.pt", local.getvalue())

    r = _pretrain(out, "train.train_iters=3")
    assert r.exit_code == 2, r.output
    refusal = ("refused: it names posix.system, which no checkpoint lptrain writes holds (crafted, "
               "or written by another program)")
    line = _one_error(r)
    assert line.startswith("error: no checkpoint could be loaded: ")
    assert f"{ck}/iter_0000002/global/.metadata: {refusal}" in line
    assert f"{ck}/iter_0000001/local/rank_00000.pt: {refusal}" in line
    assert f"falling back to {ck}/iter_0000001" in r.stdout
    r = CliRunner().invoke(app, ["export", str(out), "--format", "hf", "--output", str(tmp_path / "hf")])
    assert r.exit_code == 2 and f"{ck}/iter_0000002/global/.metadata: {refusal}" in _one_error(r)
    assert not sentinel.exists() and not (tmp_path / "hf").exists()


def test_damaged_metrics_are_one_line_on_resume_and_replay(run: Path, tmp_path: Path) -> None:
    out = _copy(run, tmp_path / "run")
    with (out / "metrics.jsonl").open("ab") as f:
        f.write(b'{"step": 2, "loss": 5.0, "x": "\xff"}\n')
    want = f"error: {out}/metrics.jsonl:3: byte 0xff at column 32 is not UTF-8 text"
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lptrain.lock"}
    r = _pretrain(out, "train.train_iters=3")
    assert r.exit_code == 2 and _one_error(r).startswith(want), r.output
    r = CliRunner().invoke(app, ["replay", str(out), "--step", "2"])
    assert r.exit_code == 2 and _one_error(r).startswith(want), r.output
    assert {p: p.read_bytes() for p in before} == before  # the resume changed nothing


def test_export_through_a_symlink_writes_into_its_target(run: Path, tmp_path: Path) -> None:
    target = tmp_path / "models" / "tiny"
    target.mkdir(parents=True)
    link = tmp_path / "latest-model"
    link.symlink_to(target)
    r = CliRunner().invoke(app, ["export", str(run), "--format", "hf", "--output", str(link)])
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert (target / "config.json").is_file() and (target / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest-model", "models"]  # no .old-PID
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "no" / "such" / "folder")
    r = CliRunner().invoke(app, ["export", str(run), "--format", "hf", "--output", str(dangling)])
    assert r.exit_code == 2
    assert _one_error(r) == (
        f"error: --output {dangling} is a symbolic link to {tmp_path}/no/such/folder, which does "
        f"not exist (nor does its folder {tmp_path}/no/such); fix: create the link's target "
        "folder, point the link elsewhere, or pass another --output")


def test_a_missing_dataset_leaves_nothing_behind(tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["pretrain", "--recipe", "tiny_cpu.yaml", "--output-dir", str(out),
                                 f"data.source={tmp_path}/corpus"])
    assert r.exit_code == 2
    assert _one_error(r).startswith(f"error: dataset index not found: {tmp_path}/corpus.idx")
    assert not out.exists()  # no run folder, no resolved_config.yaml, no lock


def test_replay_of_a_copied_run_reads_the_copys_checkpoints(run: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from lptrain.train import replay, run_dir

    copy = _copy(run, tmp_path / "copy")
    assert str(run) in (copy / "resolved_config.yaml").read_text()  # the original's absolute path
    assert replay._run_config(copy).checkpoint.save == str(copy / "checkpoints")
    monkeypatch.setattr(run_dir, "rebase_on_output_dir", lambda cfg, out: cfg)  # the fix, removed
    assert replay._run_config(copy).checkpoint.save == str(run / "checkpoints")


def test_a_run_folder_deleted_mid_run_stops_within_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lptrain.train.outputs import RunOutputs

    out = tmp_path / "run"
    real = RunOutputs.write

    def write(self: RunOutputs, rec: dict[str, Any]) -> None:
        real(self, rec)
        if rec["step"] == 1:
            shutil.rmtree(out)  # rm -rf of the run folder while step 1 is being recorded

    monkeypatch.setattr(RunOutputs, "write", write)
    r = _pretrain(out, "train.train_iters=3")
    assert r.exit_code == 3, r.output
    assert _one_error(r) == (
        f"error: the run folder {out} was deleted while the run was writing to it (found after "
        "step 1): its metrics and lock went with it, so the run stops here; fix: restore the "
        "folder and resume (the same command), or start again in a new --output-dir")
    assert not out.exists()  # no checkpoints/ recreated, no summary written nowhere


def test_a_full_disk_at_the_end_names_every_file_not_written(run: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.figure

    from lptrain.train import loop
    from lptrain.train.metrics import MetricsWriter

    out = _copy(run, tmp_path / "run")
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def append(self: MetricsWriter, rec: dict[str, Any]) -> None:
        if rec["step"] == 3:
            from lptrain.errors import RunFailedError

            raise RunFailedError(f"cannot append step 3 to {self.path}: {full.strerror}")
        return real_append(self, rec)

    def savefig(self: Any, fname: Any, **kw: Any) -> None:
        Path(fname).write_bytes(b"")  # matplotlib opened the file, then the disk was full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_append, real_write = MetricsWriter.write, loop.write_atomically

    def write_atomically(path: Path, data: Any) -> Path:
        if Path(path).name == "summary.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(path, data)

    monkeypatch.setattr(MetricsWriter, "write", append)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    monkeypatch.setattr(loop, "write_atomically", write_atomically)
    r = _pretrain(out, "train.train_iters=3", "logging.plots=true")
    assert r.exit_code == 3, r.output
    assert _one_error(r) == (
        f"error: cannot append step 3 to {out}/metrics.jsonl: No space left on device; not written "
        "either: loss.png, summary.json")
    assert not (out / "loss.png").exists() and not list(out.glob(".loss.png.tmp*"))  # no 0-byte plot


NAN_AT = ["train.on_anomaly=rollback", "debug.nan_module=layers.1.mlp.linear_fc2"]  # + nan_sample


def _flip_after_save(monkeypatch: pytest.MonkeyPatch, steps: set[int]) -> None:
    """Flip one byte of the DCP data of the checkpoints of ``steps`` right after each is saved."""
    from lptrain.train import loop

    real = loop.save_checkpoint

    def save(save_dir: Any, iteration: int, *args: Any, **kw: Any) -> Path:
        folder = real(save_dir, iteration, *args, **kw)
        if iteration in steps:
            data = folder / "global" / "__0_0.distcp"
            raw = bytearray(data.read_bytes())
            raw[len(raw) // 2] ^= 0x01
            data.write_bytes(bytes(raw))
        return folder

    monkeypatch.setattr(loop, "save_checkpoint", save)


def test_a_rollback_falls_back_past_a_corrupt_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The NaN at step 4 (sample 6): iter_0000003 has a flipped byte, so the rollback goes to
    iter_0000002, as a resume would, and the run completes."""
    out = tmp_path / "run"
    _flip_after_save(monkeypatch, {3})
    r = _pretrain(out, "train.train_iters=4", *NAN_AT, "debug.nan_sample=6")
    assert r.exit_code == 0, r.output
    ck = out / "checkpoints"
    assert (f"warning: could not load checkpoint {ck}/iter_0000003 (checkpoint {ck}/iter_0000003: "
            "global/__0_0.distcp fails its checksum") in r.stdout
    assert f"falling back to {ck}/iter_0000002" in r.stdout
    assert f"resuming from {ck}/iter_0000002 (step 2)" in r.stdout
    assert r.stdout.index("; rolled back to step 2") < r.stdout.index("could not load checkpoint")
    (record,) = [json.loads(x) for x in (out / "anomalies.jsonl").read_text().splitlines()]
    assert record["action"] == "rollback" and record["to_step"] == 2
    assert record["skipped_samples"] == [4, 8]  # the samples read since step 2's checkpoint
    assert f"rolled back to step 2 ({ck}/iter_0000002)" in record["action_text"]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_a_rollback_with_no_loadable_checkpoint_stops_exit_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    _flip_after_save(monkeypatch, {1})
    r = _pretrain(out, "train.train_iters=2", *NAN_AT, "debug.nan_sample=2")
    assert r.exit_code == 3, r.output  # a run that started: not 2 ("unreadable input")
    line = _one_error(r)
    assert line.startswith("error: step 2, rank 0: ")
    assert ("stopping (train.on_anomaly=rollback; no checkpoint before step 2 could be loaded (no "
            f"checkpoint could be loaded: checkpoint {out}/checkpoints/iter_0000001: "
            "global/__0_0.distcp fails its checksum") in line
