"""Data faults after preparation: a bit flipped anywhere in an ``.idx`` header, an EOS id that
disagrees with the tokenizer, a token file truncated or replaced while a reader holds it.

Each is one :class:`DataError` (exit 2, before the run) or :class:`DatasetChangedError` (exit
3, during the run) naming the file, never a ``KeyError``/``TypeError`` or a ``SIGBUS``.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from lptrain.data.errors import DataError
from lptrain.data.gpt_dataset import GPTDataset
from lptrain.data.index_header import HEADER_CHECKSUM_KEY
from lptrain.data.indexed import MAGIC, IndexedDataset, bin_path, encode_index, idx_path, read_index
from lptrain.data.loader import open_dataset
from lptrain.data.prepare import prepare_dataset
from lptrain.data.token_file import DatasetChangedError
from lptrain.errors import EXIT_RUN_FAILED


def _ds(tmp_path: Path) -> Path:
    for k in range(4):
        (tmp_path / f"d{k}.txt").write_text(f"document {k} " * (40 + 10 * k))
    prepare_dataset([tmp_path / f"d{k}.txt" for k in range(4)], tmp_path / "ds")
    return tmp_path / "ds"


def _header_span(raw: bytes) -> tuple[int, int]:
    (hlen,) = struct.unpack("<Q", raw[len(MAGIC) : len(MAGIC) + 8])
    return len(MAGIC) + 8, len(MAGIC) + 8 + hlen


def test_every_single_bit_flip_in_the_header_is_refused(tmp_path: Path) -> None:
    """One bit flipped at each header byte (bit = byte index mod 8): refused with DataError,
    inside the checksum's own key name too (issue 43: ``headar_blake2b`` made the index look
    unsigned, and its header went unverified)."""
    prefix = _ds(tmp_path)
    good = idx_path(prefix).read_bytes()
    start, end = _header_span(good)
    key_at = good.index(f'"{HEADER_CHECKSUM_KEY}"'.encode())
    accepted = []
    for pos in range(0, end):
        raw = bytearray(good)
        raw[pos] ^= 1 << (pos % 8)
        idx_path(prefix).write_bytes(bytes(raw))
        try:
            read_index(prefix)
        except DataError as e:
            assert "\n" not in str(e) and "ds.idx" in str(e), str(e)
            continue
        accepted.append(pos)
    assert accepted == [], [(p, chr(good[p])) for p in accepted]
    assert start < key_at < end


def test_renamed_checksum_key_is_refused_naming_it(tmp_path: Path) -> None:
    prefix = _ds(tmp_path)
    raw = idx_path(prefix).read_bytes()
    idx_path(prefix).write_bytes(raw.replace(b'"header_blake2b"', b'"headar_blake2b"'))
    with pytest.raises(DataError, match="field 'headar_blake2b' is not one lptrain writes"):
        read_index(prefix)


def _unsigned(prefix: Path, **changes: object) -> None:
    """Rewrite the header as an index written before header checksums existed."""
    header, offsets = read_index(prefix)
    header.pop(HEADER_CHECKSUM_KEY, None)
    for key, value in changes.items():
        if value is None:
            header.pop(key)
        else:
            header[key] = value
    idx_path(prefix).write_bytes(encode_index(header, offsets))


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_tokens": None, "num_tokena": 1}, "field 'num_tokens' is missing"),
    ({"num_documents": None, "num_docu-ents": 4}, "field 'num_documents' is missing"),
    ({"dtype": "uint06"}, "field 'dtype' is 'uint06', not one of"),
    ({"eos_id": 300}, "field 'eos_id' is 300, outside the vocabulary"),
    ({"max_token_id": "257"}, "field 'max_token_id' is '257', not an integer"),
    ({"tokens_blake2b": "x" * 64}, "field 'tokens_blake2b' is 'xxx"),
    ({"num_documents": 10**9}, "fields 'num_documents' 1000000000 and 'num_tokens'"),
])
def test_an_unsigned_header_is_checked_field_by_field(tmp_path: Path, changes: dict, message: str) -> None:
    prefix = _ds(tmp_path)
    _unsigned(prefix, **changes)
    with pytest.raises(DataError, match=f"corrupt index header in .*ds.idx: {message}"):
        IndexedDataset(prefix)


def test_eos_id_that_disagrees_with_the_tokenizer_is_refused(tmp_path: Path) -> None:
    """257 -> 256 (one bit) is inside the vocabulary, so only the tokenizer can tell."""
    prefix = _ds(tmp_path)
    header, _ = read_index(prefix)
    assert header["eos_id"] == 257
    _unsigned(prefix)
    open_dataset(str(prefix), "byte", vocab_size=512)  # the unsigned header itself is fine
    _unsigned(prefix, eos_id=256)
    with pytest.raises(DataError, match=r"records EOS id 256 but its tokenizer byte has EOS id 257"):
        open_dataset(str(prefix), "byte", vocab_size=512)


def test_truncated_under_a_reader_is_one_error_not_sigbus(tmp_path: Path) -> None:
    prefix = _ds(tmp_path)
    ds = IndexedDataset(prefix)
    n = ds.num_tokens
    last = ds.get_document(len(ds) - 1)
    os.truncate(bin_path(prefix), n)  # half the bytes of the uint16 tokens
    ds.get_document(0)  # still inside the file
    with pytest.raises(DatasetChangedError, match=r"ds.bin changed under the running job: it ends before"):
        ds.get_document(len(ds) - 1)
    assert DatasetChangedError.exit_code == EXIT_RUN_FAILED and len(last) > 0


def test_replaced_file_is_caught_at_the_next_epoch(tmp_path: Path) -> None:
    """A same-size file renamed over the dataset: reads still see the opened file, and the
    next epoch's layout checks the path and refuses."""
    prefix = _ds(tmp_path)
    ds = IndexedDataset(prefix)
    gpt = GPTDataset(ds, np.arange(len(ds)), seq_length=16, seed=1)
    first = gpt.sample(0)
    other = tmp_path / "other.bin"
    other.write_bytes(bin_path(prefix).read_bytes()[::-1])
    os.replace(other, bin_path(prefix))
    assert np.array_equal(gpt.sample(0), first)  # the open file, epoch 0 (cached)
    with pytest.raises(DatasetChangedError, match="it was replaced by another file"):
        gpt.sample(gpt.samples_per_epoch)  # epoch 1


def test_header_written_with_its_checksum(tmp_path: Path) -> None:
    prefix = _ds(tmp_path)
    raw = idx_path(prefix).read_bytes()
    start, end = _header_span(raw)
    assert len(json.loads(raw[start:end])[HEADER_CHECKSUM_KEY]) == 64


def test_token_file_reopens_in_a_worker_and_keeps_the_opened_identity(tmp_path: Path) -> None:
    """A DataLoader worker started with spawn unpickles the reader: it reopens the path, and a
    file replaced since the parent opened it is refused there too."""
    import pickle

    prefix = _ds(tmp_path)
    ds = IndexedDataset(prefix)
    blob = pickle.dumps(ds.tokens)
    again = pickle.loads(blob)
    assert np.array_equal(again[5:50], ds.tokens[5:50])
    other = tmp_path / "other.bin"
    other.write_bytes(bin_path(prefix).read_bytes())
    os.replace(other, bin_path(prefix))
    with pytest.raises(DatasetChangedError, match="replaced by another file"):
        pickle.loads(blob)


def test_truncation_seen_by_a_loader_worker_is_still_one_line(tmp_path: Path) -> None:
    """With data.num_workers > 0 the fault surfaces in a worker; the iterator re-checks the
    file in the main process, so the error is the one-line message, not the worker's
    re-raised traceback text."""
    from lptrain.config.schema import DataConfig
    from lptrain.data.loader import build_train_valid_loaders

    prefix = _ds(tmp_path)
    cfg = DataConfig(source=str(prefix), split_valid_fraction=0.0, num_workers=1)
    train, _ = build_train_valid_loaders(cfg, 16, 2, 2, 0, 1, 512)
    next(train)
    os.truncate(bin_path(prefix), 64)
    with pytest.raises(DatasetChangedError) as info:
        for _ in range(200):
            next(train)
    assert "Traceback" not in str(info.value) and "\n" not in str(info.value)
    assert "ds.bin changed under the running job: it was truncated" in str(info.value)
