"""Every kind of bad input raises DataError (or warns) with a message naming what is wrong."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from lptrain.data.errors import DataError
from lptrain.data.index_header import HEADER_CHECKSUM_KEY, header_digest
from lptrain.data.indexed import MAGIC, IndexedDataset, bin_path, encode_index, idx_path
from lptrain.data.loader import open_dataset
from lptrain.data.prepare import prepare_dataset
from lptrain.data.tokenizer import ByteTokenizer


def _ds(tmp_path: Path) -> Path:
    (tmp_path / "a.txt").write_text("hello world, " * 20)
    (tmp_path / "b.txt").write_text("second document")
    prepare_dataset([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "ds")
    return tmp_path / "ds"


def test_missing_input(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=f"input path not found: {missing}"):
        prepare_dataset([missing], tmp_path / "ds")


def test_empty_input_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=f"input file is empty: {empty}"):
        prepare_dataset([empty], tmp_path / "ds")


def test_directory_without_matching_files(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.bin").write_bytes(b"1")
    with pytest.raises(DataError, match=r"no input files matching .* under directory"):
        prepare_dataset([tmp_path / "d"], tmp_path / "ds")


def test_invalid_utf8_is_replaced_counted_and_reported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    # Two invalid sequences (lone continuation byte, truncated 3-byte sequence) and one valid U+FFFD.
    bad.write_bytes(b"ok \x80 mid \xef\xbf\xbd end \xe2\x82")
    (tmp_path / "good.txt").write_text("fine")
    rep = prepare_dataset([bad, tmp_path / "good.txt"], tmp_path / "ds")
    assert rep.stats.invalid_utf8 == {str(bad): 2}
    assert rep.warnings == [f"replaced 2 invalid UTF-8 sequences with U+FFFD in: {bad} (2)"]
    ds = IndexedDataset(tmp_path / "ds")
    assert ByteTokenizer().decode(ds.get_document(0)) == "ok \ufffd mid \ufffd end \ufffd"


def test_jsonl_missing_key_and_invalid_json(tmp_path: Path) -> None:
    f = tmp_path / "data.jsonl"
    f.write_text(
        json.dumps({"text": "good one"}) + "\n" + json.dumps({"body": "x"}) + "\n" + "{not json\n"
        + json.dumps({"text": 5}) + "\n" + json.dumps({"text": "good two"}) + "\n"
    )
    with pytest.raises(DataError, match=rf"bad JSONL line {f}:2: no 'text' key .*--skip-bad-lines"):
        prepare_dataset([f], tmp_path / "ds")
    assert not idx_path(tmp_path / "ds").exists()
    rep = prepare_dataset([f], tmp_path / "ds", skip_bad_lines=True)
    assert rep.stats.bad_lines == [
        f"{f}:2: no 'text' key",
        f"{f}:3: invalid JSON (Expecting property name enclosed in double quotes)",
        f"{f}:4: 'text' is not a string",
    ]
    assert rep.warnings[0].startswith("skipped 3 bad JSONL lines: ")
    ds = IndexedDataset(tmp_path / "ds")
    assert [ByteTokenizer().decode(ds.get_document(i)) for i in range(len(ds))] == ["good one", "good two"]


def test_jsonl_custom_text_key(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"content": "abc"}) + "\n")
    with pytest.raises(DataError, match="no 'text' key"):
        prepare_dataset([f], tmp_path / "ds")
    prepare_dataset([f], tmp_path / "ds", text_key="content")
    assert ByteTokenizer().decode(IndexedDataset(tmp_path / "ds").get_document(0)) == "abc"


def test_token_id_beyond_model_vocab(tmp_path: Path) -> None:
    prefix = _ds(tmp_path)
    with pytest.raises(DataError) as exc:
        open_dataset(str(prefix), "byte", vocab_size=200)
    msg = str(exc.value)
    assert f"dataset {prefix} has token id 257" in msg  # EOS = 257 is the largest id
    assert "vocab 259" in msg and "model vocabulary of 200" in msg
    open_dataset(str(prefix), "byte", vocab_size=259)  # fits exactly


def test_tokenizer_mismatch(tmp_path: Path) -> None:
    prefix = _ds(tmp_path)
    tok = tmp_path / "t.json"
    from lptrain.data.tokenizer import train_bpe

    train_bpe(["some text to learn from"] * 5, 280, tok)
    with pytest.raises(DataError, match=r"was tokenized with byte .* but data.tokenizer is hf:t.json"):
        open_dataset(str(prefix), str(tok), vocab_size=1000)


def test_missing_index(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"dataset index not found: .*nothing.idx .*prepare-data"):
        IndexedDataset(tmp_path / "nothing")


def test_corrupt_token_file_checksum(tmp_path: Path) -> None:
    prefix = _ds(tmp_path)
    raw = bytearray(bin_path(prefix).read_bytes())
    raw[10] ^= 1
    bin_path(prefix).write_bytes(bytes(raw))
    with pytest.raises(DataError, match=f"token checksum mismatch for {bin_path(prefix)}"):
        IndexedDataset(prefix)
    IndexedDataset(prefix, verify=False)  # explicit opt-out of the full checksum still opens


def test_truncated_token_file(tmp_path: Path) -> None:
    prefix = _ds(tmp_path)
    raw = bin_path(prefix).read_bytes()
    bin_path(prefix).write_bytes(raw[:-2])
    with pytest.raises(DataError, match=r"size mismatch for .*ds.bin: \d+ bytes on disk"):
        IndexedDataset(prefix, verify=False)


def _rewrite_header(prefix: Path, **changes: object) -> None:
    """Edit header fields and re-sign the header, so the checks behind its checksum run."""
    raw = idx_path(prefix).read_bytes()
    (hlen,) = struct.unpack("<Q", raw[8:16])
    header = json.loads(raw[16 : 16 + hlen])  # unchecked: a previous edit may be invalid
    offsets = np.frombuffer(raw[16 + hlen :], dtype="<i8")
    header.update(changes)
    header[HEADER_CHECKSUM_KEY] = header_digest(header)
    idx_path(prefix).write_bytes(encode_index(header, offsets))


def test_wrong_dtype_in_index(tmp_path: Path) -> None:
    prefix = _ds(tmp_path)
    _rewrite_header(prefix, dtype="uint32")
    with pytest.raises(DataError, match=r"size mismatch .*wrong dtype"):
        IndexedDataset(prefix)
    _rewrite_header(prefix, dtype="float32")
    with pytest.raises(DataError, match="field 'dtype' is 'float32', not one of"):
        IndexedDataset(prefix)
    _rewrite_header(prefix, dtype="uint16", vocab_size=100_000)
    with pytest.raises(DataError, match=r"field 'vocab_size' is 100000, outside 1..65536 for uint16"):
        IndexedDataset(prefix)


def test_corrupt_offsets_and_header(tmp_path: Path) -> None:
    prefix = _ds(tmp_path)
    raw = bytearray(idx_path(prefix).read_bytes())
    raw[-3] ^= 1
    idx_path(prefix).write_bytes(bytes(raw))
    with pytest.raises(DataError, match="offsets checksum mismatch"):
        IndexedDataset(prefix)
    idx_path(prefix).write_bytes(MAGIC + struct.pack("<Q", 4) + b"{no}")
    with pytest.raises(DataError, match="corrupt index header"):
        IndexedDataset(prefix)
    idx_path(prefix).write_bytes(b"garbage-garbage-garbage")
    with pytest.raises(DataError, match="not an lptrain index"):
        IndexedDataset(prefix)


def test_index_with_wrong_document_count(tmp_path: Path) -> None:
    prefix = _ds(tmp_path)
    _rewrite_header(prefix, num_documents=3)
    with pytest.raises(DataError, match=r"index size mismatch .* for 3 documents"):
        IndexedDataset(prefix)


def test_bpe_needs_vocab_size(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(DataError, match="--train-tokenizer bpe needs --vocab-size"):
        prepare_dataset([tmp_path / "a.txt"], tmp_path / "ds", train_tokenizer="bpe")


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(DataError, match=r"tokenizer file not found: .*missing.json"):
        prepare_dataset([tmp_path / "a.txt"], tmp_path / "ds", tokenizer=str(tmp_path / "missing.json"))


def test_jsonl_lone_surrogate_escape_is_replaced_and_counted(tmp_path: Path) -> None:
    f = tmp_path / "s.jsonl"
    # A lone surrogate (not encodable as UTF-8) and a valid surrogate pair (an emoji).
    f.write_text('{"text": "a\\ud800b"}\n{"text": "rocket \\ud83d\\ude80"}\n')
    rep = prepare_dataset([f], tmp_path / "ds")
    assert rep.stats.invalid_utf8 == {str(f): 1}
    ds = IndexedDataset(tmp_path / "ds")
    assert [ByteTokenizer().decode(ds.get_document(i)) for i in range(2)] == ["a\ufffdb", "rocket 🚀"]
