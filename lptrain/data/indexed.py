"""Indexed token datasets on disk: ``PREFIX.bin`` (flat tokens) + ``PREFIX.idx`` (index).

``PREFIX.bin`` holds every document's tokens back to back, each document followed by the
tokenizer's EOS id, as uint16 when the vocabulary fits and uint32 otherwise. ``PREFIX.idx`` is
one small binary file::

    b"LPTIDX01" | uint64 LE header length | JSON header (space padded to 8 bytes) | int64 offsets

The JSON header records dtype, vocabulary size, EOS id, tokenizer identity (name + sha256),
document/token counts, the largest token id and blake2b checksums of the token file and of the
offsets, and a checksum of the header itself (:mod:`lptrain.data.index_header` checks every
field on open). Writers produce temp files and rename them, the index last (after removing any
old index), so a crash never leaves a pair that passes verification. Readers check sizes,
offsets and checksums before use, then read the tokens with ``pread`` (never a full load; a
file truncated or replaced under a running job is one error line, :mod:`lptrain.data.token_file`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lptrain.data.errors import DataError
from lptrain.data.index_header import HEADER_CHECKSUM_KEY, header_digest, validate_header
from lptrain.data.token_file import TokenFile
from lptrain.errors import OutputDirError

MAGIC = b"LPTIDX01"
REPREPARE = "prepare the dataset again with `lptrain prepare-data`"
FORMAT_VERSION = 1
_FULL_VERIFY_LIMIT = 1 << 30  # verify the token checksum by default below 1 GiB


def bin_path(prefix: str | os.PathLike[str]) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | os.PathLike[str]) -> Path:
    return Path(f"{prefix}.idx")


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _blake2b_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _offsets_digest(offsets: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(offsets, dtype="<i8").tobytes(), digest_size=32).hexdigest()


@dataclass
class PackedDocuments:
    """Documents back to back in the storage dtype, each followed by EOS, with their lengths
    (EOS included) and the extreme ids (for the vocabulary check)."""

    tokens: np.ndarray
    lengths: np.ndarray
    max_id: int
    min_id: int


def _outside_vocab(token_id: int, vocab_size: int) -> DataError:
    return DataError(f"token id {token_id} outside the tokenizer vocabulary ({vocab_size})")


def pack_documents(docs: list[np.ndarray], eos_id: int, dtype: np.dtype, vocab_size: int) -> PackedDocuments:
    """One contiguous ``dtype`` buffer of ``docs`` + EOS each (empty documents skipped).

    Tokenizers hand out ids in an unsigned dtype no wider than the storage one (the byte
    tokenizer uint8, ``tokenizers`` uint16/uint32 by vocabulary), which casts exactly; any
    other array (int64, say) is range-checked before the cast so nothing wraps silently.
    The work is numpy on whole buffers, so it runs in a worker thread without the GIL most
    of the time."""
    docs = [d for d in docs if len(d)]
    if not docs:
        return PackedDocuments(np.zeros(0, dtype), np.zeros(0, np.int64), -1, 0)
    for d in docs:
        if not np.can_cast(d.dtype, dtype, "safe"):
            d_min, d_max = int(d.min()), int(d.max())
            if d_min < 0 or d_max >= vocab_size:
                raise _outside_vocab(d_max if d_max >= vocab_size else d_min, vocab_size)
    eos = np.array([eos_id], dtype=dtype)
    parts: list[np.ndarray] = []
    for d in docs:
        parts.append(d)
        parts.append(eos)
    tokens = np.concatenate(parts, dtype=dtype, casting="unsafe")
    lengths = np.fromiter((len(d) + 1 for d in docs), dtype=np.int64, count=len(docs))
    packed = PackedDocuments(tokens, lengths, int(tokens.max()), int(tokens.min()))
    if packed.max_id >= vocab_size:
        raise _outside_vocab(packed.max_id, vocab_size)
    return packed


@dataclass
class IndexedDatasetWriter:
    """Streams documents into temp files; :meth:`finalize` checksums and renames them."""

    prefix: str
    vocab_size: int
    eos_id: int
    tokenizer: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.dtype = dtype_for_vocab(self.vocab_size)
        self._bin = bin_path(self.prefix)
        self._tmp_bin = self._bin.with_name(self._bin.name + f".tmp-{os.getpid()}")
        try:
            self._bin.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self._tmp_bin, "wb")  # noqa: SIM115 - closed in finalize/abort
        except OSError as e:
            raise OutputDirError(
                f"cannot write the dataset {self._bin}: {e.strerror or e}",
                fix="choose a writable --output PREFIX",
            ) from None
        self._hash = hashlib.blake2b(digest_size=32)
        self._lengths: list[np.ndarray] = []
        self._num_tokens = 0
        self._max_id = -1

    def add_documents(self, docs: list[np.ndarray]) -> None:
        """Append documents (token arrays without EOS); empty documents are skipped."""
        self.add_packed(pack_documents(docs, self.eos_id, self.dtype, self.vocab_size))

    def add_packed(self, packed: PackedDocuments) -> None:
        """Append documents packed by :func:`pack_documents` (in a worker thread, say): the
        range check, then the checksum and the write, both on the packed buffer in place."""
        if not len(packed.lengths):
            return
        if packed.max_id >= self.vocab_size or packed.min_id < 0:
            raise _outside_vocab(packed.max_id if packed.max_id >= self.vocab_size else packed.min_id, self.vocab_size)
        if packed.tokens.dtype != self.dtype:
            raise ValueError(f"packed as {packed.tokens.dtype}, the dataset stores {self.dtype}")
        self._max_id = max(self._max_id, packed.max_id)
        data = memoryview(packed.tokens).cast("B")
        self._f.write(data)
        self._hash.update(data)
        self._lengths.append(packed.lengths)
        self._num_tokens += len(packed.tokens)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def abort(self) -> None:
        """Drop the temp files (the previous dataset, if any, is left as it was)."""
        if not self._f.closed:
            self._f.close()
        self._tmp_bin.unlink(missing_ok=True)

    def finalize(self) -> dict[str, Any]:
        """Write the index, then rename: old index removed, bin moved, new index moved last."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        if len(lengths) == 0:
            self.abort()
            raise DataError(f"no non-empty documents to write for {self.prefix}")
        offsets = np.zeros(len(lengths) + 1, dtype="<i8")
        np.cumsum(lengths, out=offsets[1:])
        header: dict[str, Any] = {
            "format": "lptrain-indexed",
            "version": FORMAT_VERSION,
            "dtype": self.dtype.name,
            "vocab_size": int(self.vocab_size),
            "eos_id": int(self.eos_id),
            "eos_appended": True,
            "tokenizer": self.tokenizer,
            "num_documents": len(lengths),
            "num_tokens": int(self._num_tokens),
            "max_token_id": int(self._max_id),
            "tokens_blake2b": self._hash.hexdigest(),
            "offsets_blake2b": _offsets_digest(offsets),
            "extra": self.extra,
        }
        header[HEADER_CHECKSUM_KEY] = header_digest(header)
        idx = idx_path(self.prefix)
        tmp_idx = idx.with_name(idx.name + f".tmp-{os.getpid()}")
        with open(tmp_idx, "wb") as f:
            f.write(encode_index(header, offsets))
            f.flush()
            os.fsync(f.fileno())
        idx.unlink(missing_ok=True)
        os.replace(self._tmp_bin, self._bin)
        os.replace(tmp_idx, idx)
        return header


def tokenizer_fix(prefix: str, name: str) -> str:
    """How to point ``data.tokenizer`` at the tokenizer a dataset was prepared with."""
    if name == "byte":
        return "set data.tokenizer=byte"
    trained = Path(f"{prefix}.tokenizer.json")  # where prepare-data --train-tokenizer saves it
    if trained.is_file():
        return f"set data.tokenizer={trained}"
    return f"set data.tokenizer to the path of the tokenizers JSON file {name.removeprefix('hf:')}"


def encode_index(header: dict[str, Any], offsets: np.ndarray) -> bytes:
    body = json.dumps(header, sort_keys=True).encode("utf-8")
    pad = (-(len(MAGIC) + 8 + len(body))) % 8
    body += b" " * pad
    return MAGIC + struct.pack("<Q", len(body)) + body + np.ascontiguousarray(offsets, "<i8").tobytes()


def check_present(prefix: str | os.PathLike[str]) -> None:
    """:class:`DataError` unless ``PREFIX.idx`` and ``PREFIX.bin`` exist: cheap, so a run
    checks it before it takes or writes its folder (opening the dataset checks the rest)."""
    path = idx_path(prefix)
    if not path.is_file():
        raise DataError(
            f"dataset index not found: {path} (not prepared yet, or a wrong path?)",
            fix="prepare it with `lptrain prepare-data --input ... --output PREFIX`, or fix data.source/data.paths",
        )
    if not bin_path(prefix).is_file():
        raise DataError(f"token file not found: {bin_path(prefix)} (its index exists: {path})",
                        fix=REPREPARE)


def read_index(prefix: str | os.PathLike[str]) -> tuple[dict[str, Any], np.ndarray]:
    """Header and offsets of ``PREFIX.idx``; raises :class:`DataError` on any inconsistency."""
    path = idx_path(prefix)
    check_present(prefix)
    raw = path.read_bytes()
    if raw[: len(MAGIC)] != MAGIC or len(raw) < len(MAGIC) + 8:
        raise DataError(f"{path} is not an lptrain index (bad magic bytes)", fix=REPREPARE)
    (hlen,) = struct.unpack("<Q", raw[len(MAGIC) : len(MAGIC) + 8])
    start = len(MAGIC) + 8
    try:
        header = json.loads(raw[start : start + hlen].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"corrupt index header in {path}: {exc}", fix=REPREPARE) from None
    if not isinstance(header, dict):
        raise DataError(f"corrupt index header in {path}: not a JSON object", fix=REPREPARE)
    if header.get("format") != "lptrain-indexed" or header.get("version") != FORMAT_VERSION:
        raise DataError(
            f"{path}: unsupported index format {header.get('format')!r} v{header.get('version')!r}",
            fix=REPREPARE,
        )
    validate_header(header, path, REPREPARE)
    n_docs = int(header["num_documents"])
    body = raw[start + hlen :]
    if len(body) != 8 * (n_docs + 1):
        raise DataError(
            f"index size mismatch in {path}: {len(body)} offset bytes for {n_docs} documents "
            f"(expected {8 * (n_docs + 1)})",
            fix=REPREPARE,
        )
    offsets = np.frombuffer(body, dtype="<i8").astype(np.int64)
    if _offsets_digest(offsets) != header["offsets_blake2b"]:
        raise DataError(f"offsets checksum mismatch in {path}: the index is corrupt", fix=REPREPARE)
    if offsets[0] != 0 or offsets[-1] != header["num_tokens"] or np.any(np.diff(offsets) <= 0):
        raise DataError(f"inconsistent document offsets in {path}", fix=REPREPARE)
    return header, offsets


class IndexedDataset:
    """Read-only, memory-mapped view of a prepared dataset (documents include their EOS)."""

    def __init__(self, prefix: str | os.PathLike[str], verify: bool | None = None) -> None:
        self.prefix = str(prefix)
        self.header, self.offsets = read_index(prefix)
        h = self.header
        bpath = bin_path(prefix)
        if h["dtype"] not in ("uint16", "uint32"):
            raise DataError(f"{idx_path(prefix)}: unsupported token dtype {h['dtype']!r}", fix=REPREPARE)
        self.dtype = np.dtype(h["dtype"])
        if h["max_token_id"] > np.iinfo(self.dtype).max or h["vocab_size"] > np.iinfo(self.dtype).max + 1:
            raise DataError(
                f"wrong dtype in {idx_path(prefix)}: {h['dtype']} cannot hold vocabulary {h['vocab_size']}",
                fix=REPREPARE,
            )
        if not bpath.is_file():
            raise DataError(
                f"token file not found: {bpath} (its index exists: {idx_path(prefix)})", fix=REPREPARE
            )
        size = bpath.stat().st_size
        expected = h["num_tokens"] * self.dtype.itemsize
        if size != expected:
            raise DataError(
                f"size mismatch for {bpath}: {size} bytes on disk, the index says "
                f"{h['num_tokens']} tokens x {self.dtype.itemsize} bytes = {expected} "
                "(wrong dtype, truncated or from another dataset)",
                fix=REPREPARE,
            )
        self.tokens = TokenFile(bpath, self.dtype, h["num_tokens"])  # opened first: verified = read
        if verify is None:
            verify = size <= _FULL_VERIFY_LIMIT
        if verify and _blake2b_file(bpath) != h["tokens_blake2b"]:
            raise DataError(
                f"token checksum mismatch for {bpath}: the dataset is corrupt or was replaced", fix=REPREPARE
            )
        self.doc_lengths = np.diff(self.offsets)

    def check_unchanged(self) -> None:
        """Raise :class:`~lptrain.data.token_file.DatasetChangedError` (exit 3) when the token
        file was truncated or replaced since it was opened (called at epoch boundaries)."""
        self.tokens.check_unchanged()

    @property
    def vocab_size(self) -> int:
        return int(self.header["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.header["eos_id"])

    @property
    def num_tokens(self) -> int:
        return int(self.header["num_tokens"])

    def __len__(self) -> int:
        return len(self.doc_lengths)

    def get_document(self, i: int, strip_eos: bool = True) -> np.ndarray:
        """Token ids of document ``i`` (a copy), without its trailing EOS by default."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        if strip_eos:
            b -= 1
        return np.array(self.tokens[a:b], dtype=np.int64)

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raise unless every token id is a row of a model with ``model_vocab_size`` rows."""
        if self.header["max_token_id"] >= model_vocab_size:
            raise DataError(
                f"dataset {self.prefix} has token id {self.header['max_token_id']} (tokenizer "
                f"{self.header['tokenizer'].get('name')}, vocab {self.vocab_size}) beyond the model "
                f"vocabulary of {model_vocab_size}",
                key="model.vocab_size",
                fix=f"set model.vocab_size >= {self.header['max_token_id'] + 1}",
            )
