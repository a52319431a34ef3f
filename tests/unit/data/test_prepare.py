"""prepare-data round trips (byte and BPE), parallel determinism and atomic writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lptrain.data.errors import DataError
from lptrain.data.indexed import IndexedDataset, bin_path, idx_path
from lptrain.data.prepare import prepare_dataset
from lptrain.data.tokenizer import BYTE_EOS, ByteTokenizer, HFTokenizer


def _write_inputs(root: Path, docs: list[str]) -> list[str]:
    """First two docs as .txt files in a subdirectory, the rest as one JSONL file."""
    (root / "dir" / "sub").mkdir(parents=True)
    (root / "dir" / "a.txt").write_text(docs[0], encoding="utf-8")
    (root / "dir" / "sub" / "b.txt").write_text(docs[1], encoding="utf-8")
    (root / "dir" / "ignored.bin").write_bytes(b"\x00\x01")
    with open(root / "c.jsonl", "w", encoding="utf-8") as f:
        for d in docs[2:]:
            f.write(json.dumps({"text": d, "meta": 1}, ensure_ascii=False) + "\n")
    return [str(root / "dir"), str(root / "c.jsonl")]


def test_byte_round_trip_text_dirs_and_jsonl(tmp_path: Path, text_docs: list[str]) -> None:
    inputs = _write_inputs(tmp_path, text_docs)
    rep = prepare_dataset(inputs, tmp_path / "out" / "ds")
    ds = IndexedDataset(tmp_path / "out" / "ds")
    tok = ByteTokenizer()
    assert [tok.decode(ds.get_document(i)) for i in range(len(ds))] == text_docs
    # Every document is followed by exactly one EOS in the token file.
    assert all(ds.get_document(i, strip_eos=False)[-1] == BYTE_EOS for i in range(len(ds)))
    h = rep.header
    assert h["dtype"] == "uint16" and h["vocab_size"] == 259 and h["tokenizer"]["name"] == "byte"
    assert h["num_documents"] == 4
    assert h["num_tokens"] == sum(len(d.encode()) + 1 for d in text_docs)
    assert bin_path(tmp_path / "out" / "ds").stat().st_size == 2 * h["num_tokens"]
    assert not list((tmp_path / "out").glob("*.tmp-*"))


def test_parallel_workers_write_identical_dataset(tmp_path: Path) -> None:
    for i in range(30):
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / f"f{i:02d}.txt").write_text(f"document {i} " * (i + 1) + "é")
    prepare_dataset([tmp_path / "in"], tmp_path / "w1", workers=1, chunk_bytes=64)
    prepare_dataset([tmp_path / "in"], tmp_path / "w2", workers=2, chunk_bytes=64)
    assert bin_path(tmp_path / "w1").read_bytes() == bin_path(tmp_path / "w2").read_bytes()
    assert idx_path(tmp_path / "w1").read_bytes() == idx_path(tmp_path / "w2").read_bytes()


def test_bpe_train_and_round_trip(tmp_path: Path, text_docs: list[str]) -> None:
    inputs = _write_inputs(tmp_path, text_docs * 3)
    rep = prepare_dataset(inputs, tmp_path / "bpe", train_tokenizer="bpe", vocab_size=300)
    assert rep.tokenizer_path == f"{tmp_path / 'bpe'}.tokenizer.json"
    tok = HFTokenizer(rep.tokenizer_path)
    ds = IndexedDataset(tmp_path / "bpe")
    assert [tok.decode(ds.get_document(i)) for i in range(len(ds))] == text_docs * 3
    assert ds.header["tokenizer"]["sha256"] == tok.sha256
    assert ds.header["eos_id"] == tok.eos_id
    # BPE merges shorten the stream compared with one token per byte.
    assert ds.num_tokens < sum(len(d.encode()) + 1 for d in text_docs * 3)
    # Re-using the saved tokenizer file gives the same tokens.
    prepare_dataset(inputs, tmp_path / "bpe2", tokenizer=rep.tokenizer_path)
    assert bin_path(tmp_path / "bpe").read_bytes() == bin_path(tmp_path / "bpe2").read_bytes()


def test_crash_mid_write_leaves_previous_dataset_valid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "a.txt"
    src.write_text("old contents")
    prepare_dataset([src], tmp_path / "ds")
    src.write_text("new contents " * 100)

    from lptrain.data import indexed

    def boom(self: object, packed: indexed.PackedDocuments) -> None:
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(indexed.IndexedDatasetWriter, "add_packed", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare_dataset([src], tmp_path / "ds")
    ds = IndexedDataset(tmp_path / "ds")
    assert ByteTokenizer().decode(ds.get_document(0)) == "old contents"
    assert not list(tmp_path.glob("*.tmp-*"))


def test_crash_between_renames_is_detected(tmp_path: Path) -> None:
    """A new .bin next to an old .idx (crash after the bin rename) fails verification."""
    (tmp_path / "a.txt").write_text("aaaa")
    (tmp_path / "b.txt").write_text("bbbb")
    prepare_dataset([tmp_path / "a.txt"], tmp_path / "x")
    prepare_dataset([tmp_path / "b.txt"], tmp_path / "y")
    bin_path(tmp_path / "x").write_bytes(bin_path(tmp_path / "y").read_bytes())
    with pytest.raises(DataError, match="token checksum mismatch"):
        IndexedDataset(tmp_path / "x")


def test_special_token_text_is_not_a_document_boundary(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("before <|endoftext|> after " * 5)
    rep = prepare_dataset([tmp_path / "a.txt"], tmp_path / "bpe", train_tokenizer="bpe", vocab_size=280)
    tok = HFTokenizer(str(rep.tokenizer_path))
    doc = IndexedDataset(tmp_path / "bpe").get_document(0)
    assert tok.eos_id not in doc.tolist()
    assert tok.decode(doc) == "before <|endoftext|> after " * 5


def test_worker_threads_give_the_same_bpe_dataset_and_leave_tokenizers_as_found(
    tmp_path: Path, text_docs: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    inputs = _write_inputs(tmp_path, text_docs * 5)
    rep = prepare_dataset(inputs, tmp_path / "w1", train_tokenizer="bpe", vocab_size=300, workers=1)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    rep3 = prepare_dataset(inputs, tmp_path / "w3", tokenizer=str(rep.tokenizer_path), workers=3, chunk_bytes=40)
    assert rep3.workers == 3
    assert bin_path(tmp_path / "w1").read_bytes() == bin_path(tmp_path / "w3").read_bytes()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"  # restored after the run
    assert prepare_dataset(inputs, tmp_path / "auto", workers=0).workers >= 1  # 0: every CPU


def test_a_bad_line_read_ahead_on_a_thread_still_fails_cleanly(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(300)) + "{broken\n")
    with pytest.raises(DataError, match=rf"bad JSONL line {f}:301: invalid JSON"):
        prepare_dataset([f], tmp_path / "ds", workers=2, chunk_bytes=256)
    assert not list(tmp_path.glob("*.tmp-*")) and not idx_path(tmp_path / "ds").exists()


def test_packing_checks_ids_before_narrowing(tmp_path: Path) -> None:
    from lptrain.data.indexed import pack_documents

    docs = [np.array([1, 2, 3], dtype=np.int64), np.array([], dtype=np.int64), np.array([4], dtype=np.uint8)]
    packed = pack_documents(docs, 9, np.dtype(np.uint16), 10)
    assert packed.tokens.tolist() == [1, 2, 3, 9, 4, 9] and packed.lengths.tolist() == [4, 2]
    with pytest.raises(DataError, match=r"token id 70000 outside the tokenizer vocabulary \(10\)"):
        pack_documents([np.array([70000], dtype=np.int64)], 9, np.dtype(np.uint16), 10)  # would wrap to 4464
    with pytest.raises(DataError, match="token id -1 outside"):
        pack_documents([np.array([-1], dtype=np.int64)], 9, np.dtype(np.uint16), 10)
