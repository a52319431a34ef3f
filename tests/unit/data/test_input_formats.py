"""Parquet, .jsonl.gz and .jsonl.zst inputs: the same documents as plain JSONL give the same
dataset (token and offset checksums equal), mixed in directories and glob patterns; every
bad input is one ``error:`` line with exit status 2 through the CLI."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
import zstandard
from typer.testing import CliRunner

from lptrain.data.commands import register
from lptrain.data.errors import DataError
from lptrain.data.formats import parquet_texts
from lptrain.data.indexed import IndexedDataset
from lptrain.data.prepare import prepare_dataset
from lptrain.data.tokenizer import ByteTokenizer

DOCS = [
    "def f(x):\n    return x + 1\n",
    "Grüße aus Köln — ünïcødé ✓ 日本語 🚀\n",
    "plain ascii line\nsecond line\n",
    "tabs\tand\r\nCRLF\r\n",
    *(f"document {i}: " + "lorem ipsum " * (i % 13) for i in range(200)),
]


def _jsonl(docs: list[str]) -> bytes:
    return "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()


def write_all(folder: Path, docs: list[str] = DOCS) -> dict[str, Path]:
    """The same documents in every format (compressed ones as two members/frames, parquet
    in several row groups)."""
    folder.mkdir(parents=True, exist_ok=True)
    half = len(docs) // 2
    paths = {k: folder / f"docs.{k}" for k in ("jsonl", "jsonl.gz", "jsonl.zst", "parquet")}
    paths["jsonl"].write_bytes(_jsonl(docs))
    paths["jsonl.gz"].write_bytes(gzip.compress(_jsonl(docs[:half])) + gzip.compress(_jsonl(docs[half:])))
    z = zstandard.ZstdCompressor(write_checksum=True)
    paths["jsonl.zst"].write_bytes(z.compress(_jsonl(docs[:half])) + z.compress(_jsonl(docs[half:])))
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, paths["parquet"], row_group_size=37)
    return paths


def _checksums(prefix: Path) -> tuple[str, str, int]:
    h = IndexedDataset(prefix).header
    return h["tokens_blake2b"], h["offsets_blake2b"], h["num_documents"]


def test_every_format_gives_the_plain_jsonl_dataset(tmp_path: Path) -> None:
    paths = write_all(tmp_path / "in")
    assert pq.ParquetFile(paths["parquet"]).metadata.num_row_groups > 3
    want = None
    for kind, path in paths.items():
        rep = prepare_dataset([path], tmp_path / kind)
        got = _checksums(tmp_path / kind)
        assert got[2] == len(DOCS), kind
        assert rep.stats.bytes_read == path.stat().st_size, kind  # progress ends at the file size
        want = want or got
        assert got == want, kind
    ds = IndexedDataset(tmp_path / "parquet")
    assert [ByteTokenizer().decode(ds.get_document(i)) for i in range(4)] == DOCS[:4]


def test_directories_and_glob_patterns_mix_formats(tmp_path: Path) -> None:
    a = write_all(tmp_path / "in" / "a", DOCS[:50])
    b = write_all(tmp_path / "in" / "b", DOCS[50:])
    (tmp_path / "in" / "a" / "docs.jsonl").unlink()  # a: gz, zst, parquet; b: all four
    by_dir = prepare_dataset([tmp_path / "in"], tmp_path / "dir")
    files = sorted([a["jsonl.gz"], a["jsonl.zst"], a["parquet"], *b.values()])
    assert by_dir.stats.files == len(files)
    prepare_dataset(files, tmp_path / "listed")
    assert _checksums(tmp_path / "dir") == _checksums(tmp_path / "listed")
    globbed = prepare_dataset([str(tmp_path / "in" / "*" / "*.parquet")], tmp_path / "glob")
    assert globbed.stats.files == 2 and globbed.header["num_documents"] == len(DOCS)
    with pytest.raises(DataError, match="no input files match the pattern"):
        prepare_dataset([str(tmp_path / "in" / "*.nothing")], tmp_path / "none")


def test_parquet_is_read_by_row_group_and_column(tmp_path: Path) -> None:
    path = write_all(tmp_path)["parquet"]
    batches = list(parquet_texts(path, "text", batch_rows=16))
    texts = [t for b, _ in batches for t in b]
    assert texts == DOCS
    assert max(len(b) for b, _ in batches) <= 16
    groups = pq.ParquetFile(path).metadata.num_row_groups
    assert sum(1 for b, n in batches if n) >= groups  # bytes reported once per row group


def test_parquet_null_texts_are_skipped_and_reported(tmp_path: Path) -> None:
    path = tmp_path / "n.parquet"
    pq.write_table(pa.table({"text": ["a", None, "b", None]}), path)
    rep = prepare_dataset([path], tmp_path / "ds")
    assert rep.header["num_documents"] == 2
    assert rep.warnings == [f"skipped 2 parquet rows whose text is null in: {path} (2)"]


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.command("noop")
    def _noop() -> None:
        pass

    return app


def _refused(args: list[str]) -> str:
    res = CliRunner().invoke(_app(), ["prepare-data", *args, "--no-progress"])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.output
    return lines[0]


def test_cli_bad_inputs_are_one_line(tmp_path: Path) -> None:
    paths = write_all(tmp_path / "in")
    out = ["-o", str(tmp_path / "ds")]
    line = _refused(["-i", str(paths["parquet"]), "--text-key", "body", *out])
    assert f"{paths['parquet']}: no column 'body' (columns: id, text)" in line and "--text-key" in line
    line = _refused(["-i", str(paths["parquet"]), "--text-key", "id", *out])
    assert "column 'id' is int64, not a text (string) column" in line

    raw = bytearray(paths["jsonl.gz"].read_bytes())
    at = len(raw) // 3
    raw[at] ^= 0xFF
    (tmp_path / "bad.jsonl.gz").write_bytes(bytes(raw))
    line = _refused(["-i", str(tmp_path / "bad.jsonl.gz"), *out])
    assert f"{tmp_path / 'bad.jsonl.gz'}: corrupt gzip stream at compressed byte offset" in line
    offset = int(line.split("compressed byte offset ")[1].split()[0])
    assert at <= offset < len(raw)  # where the decoder noticed: at or after the damaged byte

    raw = bytearray(paths["jsonl.zst"].read_bytes())
    raw[len(raw) // 4] ^= 0xFF
    (tmp_path / "bad.jsonl.zst").write_bytes(bytes(raw))
    line = _refused(["-i", str(tmp_path / "bad.jsonl.zst"), *out])
    assert "corrupt zstd stream at compressed byte offset" in line

    cut = paths["jsonl.gz"].read_bytes()[:-10]
    (tmp_path / "cut.jsonl.gz").write_bytes(cut)
    line = _refused(["-i", str(tmp_path / "cut.jsonl.gz"), *out])
    assert f"the gzip stream ends at byte {len(cut)} before its end (truncated file?)" in line

    (tmp_path / "fake.parquet").write_bytes(b"not parquet at all" * 10)
    line = _refused(["-i", str(tmp_path / "fake.parquet"), *out])
    assert "fake.parquet: not a readable parquet file" in line


@pytest.mark.parametrize(("module", "suffix"), [("pyarrow", "parquet"), ("zstandard", "jsonl.zst")])
def test_a_missing_optional_library_names_the_extra(module: str, suffix: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_all(tmp_path / "in")[suffix]
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.setitem(sys.modules, name, None)  # "import pyarrow" now raises ImportError
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(DataError) as e:
        prepare_dataset([path], tmp_path / "ds")
    assert "pip install 'lptrain[data]'" in str(e.value) and module in str(e.value)


def test_a_missing_safetensors_names_the_hf_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from lptrain.errors import InputError
    from lptrain.interop.safetensors_io import safetensors_torch

    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(InputError, match=r"pip install 'lptrain\[hf\]'"):
        safetensors_torch()
