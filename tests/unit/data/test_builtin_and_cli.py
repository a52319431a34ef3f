"""The built-in python-stdlib corpus (build once, reuse, rebuild) and the prepare-data CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from lptrain.data import builtin
from lptrain.data.builtin import default_cache_dir, ensure_builtin_dataset, stdlib_files
from lptrain.data.commands import register
from lptrain.data.indexed import IndexedDataset, idx_path
from lptrain.data.tokenizer import ByteTokenizer

CAP = 300_000  # a capped corpus (first 300 kB in sorted order) keeps the test fast


def test_stdlib_files_sorted_capped_without_tests() -> None:
    files = stdlib_files(CAP)
    assert sum(f.stat().st_size for f in files) <= CAP and len(files) > 3
    parts = {p for f in files for p in f.parts}
    assert not parts & {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    assert files == stdlib_files(CAP)
    rel = [str(f) for f in files]
    assert rel == sorted(rel)  # one root, so sorted paths = sorted relative paths


def test_ensure_builtin_builds_once_and_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    import lptrain.data.prepare as prep

    real = prep.prepare_dataset

    def counting(*a: object, **k: object) -> object:
        calls.append(1)
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(prep, "prepare_dataset", counting)
    p1 = ensure_builtin_dataset("python-stdlib", tmp_path, max_bytes=CAP)
    mtime = idx_path(p1).stat().st_mtime_ns
    p2 = ensure_builtin_dataset("python-stdlib", tmp_path, max_bytes=CAP)
    assert p1 == p2 and len(calls) == 1 and idx_path(p2).stat().st_mtime_ns == mtime
    ds = IndexedDataset(p1)
    files = stdlib_files(CAP)
    assert len(ds) == len(files)
    assert ByteTokenizer().decode(ds.get_document(0)) == files[0].read_text(encoding="utf-8")
    assert ds.header["extra"]["identity"]["python"] == sys.version

    # Another interpreter (identity change) is another dataset, under another name.
    with monkeypatch.context() as m:
        m.setattr(builtin.sys, "version", "9.9.9 (other interpreter)")
        assert ensure_builtin_dataset("python-stdlib", tmp_path, max_bytes=CAP) != p1
    assert len(calls) == 2
    # A corrupt cached dataset is rebuilt instead of used.
    raw = bytearray(Path(f"{p1}.bin").read_bytes())
    raw[0] ^= 1
    Path(f"{p1}.bin").write_bytes(bytes(raw))
    ensure_builtin_dataset("python-stdlib", tmp_path, max_bytes=CAP)
    assert len(calls) == 3
    IndexedDataset(p1)  # verifies again


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LPTRAIN_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "c"  # lptrain's own variable first
    monkeypatch.delenv("LPTRAIN_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "lptrain"  # then the XDG base directory
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the spec: relative ones are ignored
    assert default_cache_dir() == Path("~/.cache/lptrain").expanduser()
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path("~/.cache/lptrain").expanduser()


def test_each_cap_is_its_own_cached_dataset(tmp_path: Path) -> None:
    """Content-addressed names: two caps are two datasets, and preparing one never touches the
    files of the other (a reader of the first keeps its inode, size and mtime)."""
    small = ensure_builtin_dataset("python-stdlib", tmp_path, max_bytes=CAP)
    stamp = [(p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
             for p in (Path(f"{small}.bin"), idx_path(small))]
    big = ensure_builtin_dataset("python-stdlib", tmp_path, max_bytes=2 * CAP)
    assert big != small and Path(small).name.startswith("python-stdlib-byte-")
    assert [(p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
            for p in (Path(f"{small}.bin"), idx_path(small))] == stamp
    assert len(IndexedDataset(big)) > len(IndexedDataset(small))
    assert ensure_builtin_dataset("python-stdlib", tmp_path, max_bytes=CAP) == small  # reused
    # no temp files left behind: each name was written to a temp file and renamed
    assert not [p.name for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_loader_uses_xdg_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lptrain.config.schema import DataConfig
    from lptrain.data.loader import resolve_prefixes

    monkeypatch.delenv("LPTRAIN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    (prefix,) = resolve_prefixes(DataConfig(builtin_max_mb=CAP / 1e6))
    assert Path(prefix).parent == tmp_path / "xdg" / "lptrain"


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.command("noop")
    def _noop() -> None:  # a second command keeps prepare-data a named subcommand
        pass

    return app


def test_cli_prepare_text_and_jsonl(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("héllo\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "from json"}) + "\n")
    out = tmp_path / "o" / "ds"
    res = CliRunner().invoke(
        _app(),
        ["prepare-data", "--input", str(tmp_path / "a.txt"), "--input", str(tmp_path / "b.jsonl"),
         "--output", str(out), "--text-key", "body", "--no-progress"],
    )
    assert res.exit_code == 0, res.output
    assert "wrote" in res.output and "2 documents" in res.output and "tokenizer byte" in res.output
    ds = IndexedDataset(out)
    assert [ByteTokenizer().decode(ds.get_document(i)) for i in range(2)] == ["héllo\n", "from json"]


def test_cli_reports_bad_input(tmp_path: Path) -> None:
    missing = tmp_path / "missing.txt"
    res = CliRunner().invoke(_app(), ["prepare-data", "--input", str(missing), "--output", str(tmp_path / "x")])
    assert res.exit_code == 2  # unusable input (lptrain.errors.InputError)
    assert f"error: input path not found: {missing}" in res.output
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a\xffb")
    res = CliRunner().invoke(
        _app(), ["prepare-data", "-i", str(bad), "-o", str(tmp_path / "x"), "--no-progress"]
    )
    assert res.exit_code == 0, res.output
    assert f"warning: replaced 1 invalid UTF-8 sequences with U+FFFD in: {bad} (1)" in res.output


def test_cli_train_bpe_with_workers(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"{i}.md").write_text(f"# Title {i}\n\nSome markdown text number {i}.\n" * 4)
    out = tmp_path / "bpe"
    res = CliRunner().invoke(
        _app(),
        ["prepare-data", "-i", str(src), "-o", str(out), "--train-tokenizer", "bpe",
         "--vocab-size", "320", "--workers", "2", "--no-progress"],
    )
    assert res.exit_code == 0, res.output
    assert f"trained tokenizer saved to {out}.tokenizer.json" in res.output
    from lptrain.data.tokenizer import HFTokenizer

    tok = HFTokenizer(f"{out}.tokenizer.json")
    ds = IndexedDataset(out)
    assert tok.decode(ds.get_document(0)) == (src / "0.md").read_text()


def test_cli_builtin_into_cache(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        _app(),
        ["prepare-data", "--builtin", "python-stdlib", "--cache-dir", str(tmp_path), "--max-mb", "0.2",
         "--no-progress"],
    )
    assert res.exit_code == 0, res.output
    assert f"built-in dataset python-stdlib ready at {tmp_path / 'python-stdlib-byte-'}" in res.output
    res = CliRunner().invoke(_app(), ["prepare-data", "--builtin", "nope", "--output", str(tmp_path / "n")])
    assert res.exit_code == 2 and "unknown built-in dataset 'nope'" in res.output


def test_commands_module_import_is_light() -> None:
    import subprocess

    code = "import sys, lptrain.data.commands; print(sorted(m for m in ('numpy', 'torch', 'tokenizers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_loader_builds_builtin_into_env_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lptrain.config.schema import DataConfig
    from lptrain.data.loader import build_train_valid_loaders

    monkeypatch.setenv("LPTRAIN_CACHE_DIR", str(tmp_path / "envcache"))
    tr, va = build_train_valid_loaders(DataConfig(builtin_max_mb=CAP / 1e6), 32, 2, 4, 0, 1, 259)
    assert len(list((tmp_path / "envcache").glob("python-stdlib-byte-*.idx"))) == 1
    assert va is not None and next(tr)["tokens"].shape == (2, 32)
