"""What a ``PREFIX.idx`` header must hold, checked field by field when the index is opened.

Why: the header is JSON, so one flipped bit turns a key name or a value into something else
that still parses (``num_tokens`` -> ``num_tokena``, ``uint16`` -> ``uint06``, an EOS id of
257 -> 256). Two checks catch that before any token is read:

* ``header_blake2b``, a checksum over the canonical JSON of every other field, written by
  :class:`~lptrain.data.indexed.IndexedDatasetWriter` (indexes written before it existed have
  none and get only the next check);
* every field present, of its type and in its range (counts positive, ids inside the
  vocabulary, the dtype one that can hold it, checksums 64 hex digits), and no field lptrain
  does not write: a flipped bit in the checksum's own key name (``headar_blake2b``) used to
  leave an index that looked unsigned, so its header was not verified at all.

An EOS id that is in range but disagrees with the tokenizer is refused where the tokenizer is
known (:func:`lptrain.data.loader.open_dataset`).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from lptrain.data.errors import DataError

HEADER_CHECKSUM_KEY = "header_blake2b"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_DTYPE_LIMIT = {"uint16": 1 << 16, "uint32": 1 << 32}


def header_digest(header: dict[str, Any]) -> str:
    """blake2b of the header's canonical JSON, its own checksum field left out."""
    body = {k: v for k, v in header.items() if k != HEADER_CHECKSUM_KEY}
    return hashlib.blake2b(json.dumps(body, sort_keys=True).encode("utf-8"), digest_size=32).hexdigest()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


REQUIRED = ("dtype", "vocab_size", "eos_id", "tokenizer", "num_documents", "num_tokens",
            "max_token_id", "tokens_blake2b", "offsets_blake2b")
OPTIONAL = ("format", "version", "eos_appended", "extra", HEADER_CHECKSUM_KEY)


def _field_problem(header: dict[str, Any]) -> str:
    """The first field that is missing, unknown, mistyped or out of range ("" when all are
    fine)."""
    missing = [k for k in REQUIRED if k not in header]
    if missing:
        return f"field {missing[0]!r} is missing"
    unknown = sorted(k for k in header if k not in REQUIRED and k not in OPTIONAL)
    if unknown:  # a flipped byte in a key name: "headar_blake2b" would skip the checksum
        return f"field {unknown[0]!r} is not one lptrain writes (a corrupt key name?)"
    for key in ("vocab_size", "eos_id", "num_documents", "num_tokens", "max_token_id"):
        if not _is_int(header[key]):
            return f"field {key!r} is {header[key]!r}, not an integer"
    dtype, vocab = header["dtype"], header["vocab_size"]
    if dtype not in _DTYPE_LIMIT:
        return f"field 'dtype' is {dtype!r}, not one of {sorted(_DTYPE_LIMIT)}"
    if not 0 < vocab <= _DTYPE_LIMIT[dtype]:
        return f"field 'vocab_size' is {vocab}, outside 1..{_DTYPE_LIMIT[dtype]} for {dtype}"
    for key in ("eos_id", "max_token_id"):
        if not 0 <= header[key] < vocab:
            return f"field {key!r} is {header[key]}, outside the vocabulary 0..{vocab - 1}"
    if header["max_token_id"] < header["eos_id"]:
        return f"field 'max_token_id' {header['max_token_id']} is below eos_id {header['eos_id']}"
    if not 0 < header["num_documents"] <= header["num_tokens"]:
        return (f"fields 'num_documents' {header['num_documents']} and 'num_tokens' "
                f"{header['num_tokens']} are inconsistent (every document holds >= 1 token)")
    tok = header["tokenizer"]
    if not isinstance(tok, dict) or not isinstance(tok.get("name"), str):
        return f"field 'tokenizer' is {tok!r}, not a name and a sha256"
    for key, value in (("tokenizer.sha256", tok.get("sha256")),
                       ("tokens_blake2b", header["tokens_blake2b"]),
                       ("offsets_blake2b", header["offsets_blake2b"])):
        if not isinstance(value, str) or not _HEX64.fullmatch(value):
            return f"field {key!r} is {value!r}, not 64 hex digits"
    if "eos_appended" in header and not isinstance(header["eos_appended"], bool):
        return f"field 'eos_appended' is {header['eos_appended']!r}, not true/false"
    if "extra" in header and not isinstance(header["extra"], dict):
        return f"field 'extra' is {header['extra']!r}, not a mapping"
    return ""


def validate_header(header: Any, path: Path, fix: str) -> None:
    """Raise :class:`DataError` naming ``path`` and the field unless ``header`` is whole."""
    if not isinstance(header, dict):
        raise DataError(f"corrupt index header in {path}: not a JSON object", fix=fix)
    saved = header.get(HEADER_CHECKSUM_KEY)
    if saved is not None and saved != header_digest(header):
        raise DataError(f"header checksum mismatch in {path}: the index is corrupt", fix=fix)
    problem = _field_problem(header)
    if problem:
        raise DataError(f"corrupt index header in {path}: {problem}", fix=fix)
