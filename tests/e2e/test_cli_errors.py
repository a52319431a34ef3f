"""Every bad input gets one clear line and the documented exit status (issue 13's table).

Statuses (lptrain.errors): 0 ok, 1 rule violations, 2 unreadable input (recipe, override,
data, output folder), 3 a run that started and failed, 130/143 on SIGINT/SIGTERM, 70 a bug.
Commands run in-process through typer's CliRunner (stdout and stderr kept apart).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from lptrain.cli import app
from lptrain.cli.errors import LPTrainGroup, root_callback
from lptrain.data.index_header import HEADER_CHECKSUM_KEY, header_digest
from lptrain.data.indexed import MAGIC, bin_path, encode_index, idx_path, read_index
from lptrain.data.prepare import prepare_dataset
from lptrain.errors import RunFailedError

runner = CliRunner(env={"COLUMNS": "400"})


def run(*args: str, **kw):
    return runner.invoke(app, list(args), **kw)


def assert_one_line(r, status: int, *names: str) -> None:
    """Exit ``status``, exactly one stderr line ``error: ...`` naming ``names``, no traceback."""
    assert r.exit_code == status, (r.exit_code, r.output)
    assert "Traceback" not in r.output
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    for name in names:
        assert name in r.stderr, (name, r.stderr)


def assert_rule(r, rule: str, *texts: str) -> None:
    """Exit 1 with the rule's one line on stderr (``error: RULE: ...``) and the verdict,
    naming ``texts``, no traceback."""
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output and f"error: {rule}: " in r.stderr
    for text in texts:
        assert text in r.output, (text, r.output)


# --------------------------------------------------------------------------- data fixtures


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 documents of ~1.2k byte tokens (enough for tiny_cpu's seq_length 128 splits)."""
    root = tmp_path_factory.mktemp("data")
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    for i in range(12):
        (root / f"doc{i}.txt").write_text(" ".join(words[(i * j) % 5] for j in range(200)))
    prepare_dataset([root], root / "ds")
    return root / "ds"


@pytest.fixture
def ds_copy(dataset: Path, tmp_path: Path) -> Path:
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{dataset}{suffix}", tmp_path / f"ds{suffix}")
    return tmp_path / "ds"


def pretrain(prefix: Path, tmp_path: Path, *extra: str):
    return run("pretrain", "--output-dir", str(tmp_path / "run"), f"data.source={prefix}",
               "train.train_iters=1", "optimizer.warmup_iters=0", "logging.progress=false",
               "logging.plots=false", *extra)


def _rewrite_header(prefix: Path, **changes: object) -> None:
    """Edit header fields and re-sign the header, so the checks behind its checksum run."""
    header, offsets = read_index(prefix)
    header.update(changes)
    header[HEADER_CHECKSUM_KEY] = header_digest(header)
    idx_path(prefix).write_bytes(encode_index(header, offsets))


# --------------------------------------------------------------------------- recipes


def test_non_utf8_recipe(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"model:\n  num_layers: 2\n  hidden_size: 6\xff4\n")
    for cmd in ("validate-config", "pretrain"):
        assert_one_line(run(cmd, "--recipe", str(bad)), 2, f"{bad}:3", "not UTF-8", "fix:")


def test_empty_recipe(tmp_path: Path) -> None:
    for text in ("", "# only a comment\n"):
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        assert_one_line(run("validate-config", "--recipe", str(empty)), 2, f"{empty}:1", "empty")


def test_duplicated_key(tmp_path: Path) -> None:
    dup = tmp_path / "dup.yaml"
    dup.write_text("train:\n  train_iters: 5\nmodel:\n  num_layers: 2\n  num_layers: 3\n")
    assert_one_line(run("validate-config", "--recipe", str(dup)), 2,
                    f"{dup}:5", "duplicated key 'model.num_layers'", "line 4")


def test_te_version_is_parsed() -> None:
    assert_one_line(run("validate-config", "--te-version", "banana"), 2, "--te-version", "banana")
    assert run("validate-config", "--te-version", "2.8.0").exit_code == 0


# --------------------------------------------------------------------------- value ranges


@pytest.mark.parametrize("value", ["0", "-5"])
def test_seq_length_out_of_range(value: str, tmp_path: Path) -> None:
    for cmd in ("validate-config", "pretrain"):
        assert_rule(run(cmd, f"model.seq_length={value}", "--output-dir", str(tmp_path))
                    if cmd == "pretrain" else run(cmd, f"model.seq_length={value}"),
                    "RANGE-MODEL", "model.seq_length")


def test_vocab_size_below_the_data(dataset: Path) -> None:
    assert_rule(run("validate-config", "model.vocab_size=100"), "DATA-FITS-MODEL",
                "model.vocab_size >= 258")
    assert_rule(run("validate-config", "model.vocab_size=100", f"data.source={dataset}"),
                "DATA-FITS-MODEL", f"{dataset} has token id 257")


def test_seq_length_longer_than_the_validation_split(dataset: Path) -> None:
    assert_rule(run("validate-config", "model.seq_length=4096", f"data.source={dataset}"),
                "DATA-FITS-MODEL", "model.seq_length", "validation split")


def test_split_valid_fraction_out_of_range(tmp_path: Path) -> None:
    assert_rule(run("validate-config", "data.split_valid_fraction=1.5"), "RANGE-DATA",
                "data.split_valid_fraction=1.5")
    assert_rule(run("pretrain", "-o", str(tmp_path), "data.split_valid_fraction=1.5"),
                "RANGE-DATA", "refusing to start")


def test_micro_batch_size_zero_has_a_sensible_fix() -> None:
    r = run("validate-config", "train.micro_batch_size=0")
    assert_rule(r, "RANGE-TRAIN", "train.micro_batch_size=0")
    assert "BATCH-DIVISIBLE" not in r.output and "multiple of 0" not in r.output


# --------------------------------------------------------------------------- data through pretrain


def test_truncated_bin(ds_copy: Path, tmp_path: Path) -> None:
    raw = bin_path(ds_copy).read_bytes()
    bin_path(ds_copy).write_bytes(raw[:-2])
    assert_one_line(pretrain(ds_copy, tmp_path), 2, f"{ds_copy}.bin", "size mismatch", "fix:")


def test_flipped_idx(ds_copy: Path, tmp_path: Path) -> None:
    raw = bytearray(idx_path(ds_copy).read_bytes())
    raw[-3] ^= 1
    idx_path(ds_copy).write_bytes(bytes(raw))
    assert_one_line(pretrain(ds_copy, tmp_path), 2, f"{ds_copy}.idx", "checksum mismatch")


def test_missing_idx(ds_copy: Path, tmp_path: Path) -> None:
    idx_path(ds_copy).unlink()
    r = pretrain(ds_copy, tmp_path)
    assert_one_line(r, 2, f"{ds_copy}.idx", "not found", "prepare-data")
    assert "warning: DATA-UNREADABLE: " in r.stdout  # validation warned before the run started


def test_corrupt_token_checksum(ds_copy: Path, tmp_path: Path) -> None:
    raw = bytearray(bin_path(ds_copy).read_bytes())
    raw[10] ^= 1
    bin_path(ds_copy).write_bytes(bytes(raw))
    assert_one_line(pretrain(ds_copy, tmp_path), 2, f"{ds_copy}.bin", "token checksum mismatch")


def test_missing_bin(ds_copy: Path, tmp_path: Path) -> None:
    bin_path(ds_copy).unlink()
    assert_one_line(pretrain(ds_copy, tmp_path), 2, f"{ds_copy}.bin", "token file not found")


@pytest.mark.parametrize(
    ("changes", "text"),
    [({"dtype": "uint32"}, "wrong dtype"), ({"dtype": "float32"}, "field 'dtype' is 'float32'"),
     ({"dtype": "uint16", "vocab_size": 100_000}, "field 'vocab_size' is 100000"),
     ({"max_token_id": "x"}, "field 'max_token_id' is 'x', not an integer"),
     ({"num_documents": 3}, "index size mismatch")],
)
def test_bad_index_header(ds_copy: Path, tmp_path: Path, changes: dict, text: str) -> None:
    _rewrite_header(ds_copy, **changes)
    assert_one_line(pretrain(ds_copy, tmp_path), 2, f"{ds_copy}", text)


@pytest.mark.parametrize(("content", "text"), [
    (MAGIC + struct.pack("<Q", 4) + b"{no}", "corrupt index header"),
    (b"garbage-garbage-garbage", "not an lptrain index"),
])
def test_garbage_index(ds_copy: Path, tmp_path: Path, content: bytes, text: str) -> None:
    idx_path(ds_copy).write_bytes(content)
    assert_one_line(pretrain(ds_copy, tmp_path), 2, f"{ds_copy}.idx", text)


def test_bpe_data_without_tokenizer(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"{i}.txt").write_text(f"words to learn a tokenizer from, number {i}. " * 200)
    prefix = tmp_path / "bpe"
    prepare_dataset([src], prefix, train_tokenizer="bpe", vocab_size=300)
    assert_rule(pretrain(prefix, tmp_path, "model.vocab_size=300"), "DATA-FITS-MODEL",
                "data.tokenizer", "refusing to start")
    r = run("validate-config", f"data.source={prefix}", "model.vocab_size=300", "--json")
    (v,) = json.loads(r.stdout)["violations"]
    assert r.exit_code == 1 and v["keys"] == ["data.tokenizer"]
    assert f"set data.tokenizer={prefix}.tokenizer.json" in v["message"]
    # Past validation (the loader's own check, e.g. when called from Python): the same fix.
    from lptrain.data.errors import DataError
    from lptrain.data.loader import open_dataset

    with pytest.raises(DataError) as exc:
        open_dataset(str(prefix), "byte", 300)
    assert exc.value.key == "data.tokenizer" and f"{prefix}.tokenizer.json" in str(exc.value)


# --------------------------------------------------------------------------- output folder


def test_output_dir_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "taken"
    f.write_text("x")
    for extra in ((), ("--dry-run",)):
        assert_one_line(run("pretrain", "--output-dir", str(f), *extra), 2, str(f), "not a folder")
    assert_one_line(run("pretrain", "--output-dir", str(f / "sub")), 2, str(f / "sub"), "is a file")


def test_output_dir_read_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[object] = []
    monkeypatch.setattr("lptrain.train.pretrain", lambda cfg, out: called.append(cfg))
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        target = ro / "run"
    else:  # root writes through permission bits; /sys refuses even root
        target = Path("/sys/lptrain-test-run")
        if target.exists() or not Path("/sys").is_dir():
            pytest.skip("no read-only location available as root")
    assert_one_line(run("pretrain", "--output-dir", str(target)), 2, str(target), "fix:")
    assert called == []


# --------------------------------------------------------------------------- prepare-data


def test_prepare_data_refuses_binary_file(tmp_path: Path) -> None:
    blob = tmp_path / "blob.txt"
    blob.write_bytes(bytes(range(256)) * 8)
    r = run("prepare-data", "-i", str(blob), "-o", str(tmp_path / "x"), "--no-progress")
    assert_one_line(r, 2, str(blob), "binary")
    assert not idx_path(tmp_path / "x").exists()


def test_prepare_data_unwritable_output(tmp_path: Path) -> None:
    src = tmp_path / "a.txt"
    src.write_text("hello")
    (tmp_path / "file").write_text("x")
    r = run("prepare-data", "-i", str(src), "-o", str(tmp_path / "file" / "ds"), "--no-progress")
    assert_one_line(r, 2, str(tmp_path / "file"))


# --------------------------------------------------------------------------- the error surface


def test_dry_run_checks_everything_and_writes_nothing(dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = run("pretrain", "--dry-run", "-o", str(out), f"data.source={dataset}")
    assert r.exit_code == 0, r.output
    assert "built on the meta device" in r.stdout and "dry run ok" in r.stdout
    assert not out.exists()


def test_debug_shows_the_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    for args, env in (((("--debug", "validate-config")), {}),
                      (("validate-config", "--debug"), {}),
                      (("validate-config",), {"LPTRAIN_DEBUG": "1"})):
        r = runner.invoke(app, [*args, "model.hiden_size=3"], env=env)
        assert r.exit_code == 2 and "Traceback" in r.stderr, (args, r.output)
        assert r.stderr.rstrip().splitlines()[-1].startswith("error: ")


def test_unexpected_exception_asks_for_a_bug_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(cfg: object, out: object) -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr("lptrain.train.pretrain", boom)
    r = run("pretrain", "-o", str(tmp_path / "run"))
    assert r.exit_code == 70
    assert "Traceback" in r.stderr and "ZeroDivisionError" in r.stderr
    assert r.stderr.rstrip().splitlines()[-1].startswith("error: internal error")
    assert "report" in r.stderr


def test_run_failure_exits_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def diverge(cfg: object, out: object) -> None:
        raise RunFailedError("step 3: loss is nan; stopping", fix="lower optimizer.lr")

    monkeypatch.setattr("lptrain.train.pretrain", diverge)
    assert_one_line(run("pretrain", "-o", str(tmp_path / "run")), 3, "step 3", "lower optimizer.lr")


def _signal_app(action) -> typer.Typer:
    """A throwaway app with lptrain's group, whose one command does ``action``."""
    a = typer.Typer(cls=LPTrainGroup)
    a.callback()(root_callback)

    @a.command("go")
    def go() -> None:
        action()

    @a.command("other")
    def other() -> None:  # pragma: no cover - only there to keep a group of two commands
        pass

    return a


def test_sigterm_exits_143_and_sigint_130() -> None:
    before = signal.getsignal(signal.SIGTERM)
    r = runner.invoke(_signal_app(lambda: os.kill(os.getpid(), signal.SIGTERM)), ["go"])
    assert r.exit_code == 143 and r.stderr == "error: terminated (SIGTERM)\n", r.output
    assert signal.getsignal(signal.SIGTERM) == before  # handler restored

    def interrupt() -> None:
        raise KeyboardInterrupt

    r = runner.invoke(_signal_app(interrupt), ["go"])
    assert r.exit_code == 130 and r.stderr == "error: interrupted (Ctrl-C)\n", r.output
