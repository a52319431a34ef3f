"""Data rules: the model and the split against the dataset, when the dataset is known here.

Why: ``model.vocab_size=100`` or a ``seq_length`` longer than the held-out documents only
failed once ``pretrain`` had loaded the data. When ``data.source``/``data.paths`` name index
prefixes readable on this machine, their headers and offsets (a few KB, no tokens) give the
same answers the loader would reach; the split is computed with the loader's own functions.
The built-in corpus is only checked for what is known without preparing it (the byte
tokenizer's EOS id). A dataset that is not on this machine is a warning, not an error: a
cluster config is often checked on a laptop.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from lptrain.config.rules import Rule
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World

S = "Data against the model"

BYTE_EOS_ID = 257  # lptrain.data.tokenizer.BYTE_EOS: every byte-tokenized document ends with it
# lptrain.data.tokenizer's byte identity (that module imports numpy; validation stays light).
BYTE_TOKENIZER_SHA256 = hashlib.sha256(b"lptrain-byte-tokenizer-v1:256+bos,eos,pad").hexdigest()


def explicit_prefixes(c: LPTrainConfig) -> list[str]:
    """The index prefixes the config names directly (not the built-in corpus)."""
    if c.data.paths:
        return [str(p) for p in c.data.paths]
    if str(c.data.source).startswith("builtin:"):
        return []
    return [str(c.data.source)]


@lru_cache(maxsize=64)
def _read(prefix: str, stamp: tuple[int, ...]) -> tuple[Optional[dict[str, Any]], Any, str]:
    """(header, document lengths, problem) of one index; cached per (path, mtime, size)."""
    import numpy as np

    from lptrain.data.errors import DataError
    from lptrain.data.indexed import read_index

    try:
        header, offsets = read_index(prefix)
    except DataError as e:
        return None, None, str(e)
    bin_file = Path(f"{prefix}.bin")
    want = int(header.get("num_tokens", 0)) * np.dtype(str(header.get("dtype", "uint16"))).itemsize
    if not bin_file.is_file():
        return header, np.diff(offsets), f"token file {bin_file} not found"
    if bin_file.stat().st_size != want:  # the full checksum is left to the loader
        return header, np.diff(offsets), (
            f"{bin_file} has {bin_file.stat().st_size} bytes, its index says {want} (truncated?)")
    return header, np.diff(offsets), ""


def read_header(prefix: str) -> tuple[Optional[dict[str, Any]], Any, str]:
    """(header, document lengths, problem) of the dataset at ``prefix``; header is None when
    the index cannot be read, problem is "" when the pair looks usable."""
    idx, bin_file = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    try:
        st = idx.stat()
    except OSError:
        return None, None, f"dataset index {idx} not found on this machine"
    try:
        bst = bin_file.stat()
        bin_stamp = (bst.st_mtime_ns, bst.st_size)
    except OSError:
        bin_stamp = (0, -1)
    return _read(os.path.abspath(prefix), (st.st_mtime_ns, st.st_size, *bin_stamp))


def _unreadable(c: LPTrainConfig, w: World) -> dict[str, Any]:
    bad = [("data.paths" if c.data.paths else "data.source", p)
           for p in (read_header(x)[2] for x in explicit_prefixes(c)) if p]
    tok_problem = _tokenizer_sha(c.data.tokenizer)[1]
    if tok_problem:
        bad.append(("data.tokenizer", tok_problem))
    if not bad:
        return {}
    return {"keys": tuple(dict.fromkeys(k for k, _ in bad)), "detail": "; ".join(t for _, t in bad)}


@lru_cache(maxsize=16)
def _file_sha(path: str, stamp: tuple[int, int]) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _tokenizer_sha(spec: str) -> tuple[Optional[str], str]:
    """sha256 identity of ``data.tokenizer`` as the loader computes it, or a problem."""
    if spec == "byte":
        return BYTE_TOKENIZER_SHA256, ""
    try:
        st = Path(spec).stat()
        return _file_sha(os.path.abspath(spec), (st.st_mtime_ns, st.st_size)), ""
    except OSError:
        return None, f"tokenizer file {spec} not found on this machine"


def _mismatch(c: LPTrainConfig, w: World) -> dict[str, Any]:
    from lptrain.data.gpt_dataset import split_seed

    m, d = c.model, c.data
    bad: list[tuple[str, str]] = []
    if not explicit_prefixes(c) and d.tokenizer == "byte" and 0 < m.vocab_size <= BYTE_EOS_ID:
        bad.append(("model.vocab_size", f"the byte tokenizer's EOS id {BYTE_EOS_ID} needs "
                    f"model.vocab_size >= {BYTE_EOS_ID + 1}, got {m.vocab_size}"))
    want_sha = _tokenizer_sha(d.tokenizer)[0]  # a missing file: DATA-UNREADABLE reports it
    for k, prefix in enumerate(explicit_prefixes(c)):
        header, lengths, _ = read_header(prefix)
        if header is None:
            continue  # DATA-UNREADABLE reports it
        tok = header.get("tokenizer", {})
        if want_sha is not None and tok.get("sha256") != want_sha:
            from lptrain.data.indexed import tokenizer_fix

            bad.append(("data.tokenizer", f"{prefix} was tokenized with {tok.get('name')} but "
                        f"data.tokenizer={d.tokenizer}: {tokenizer_fix(prefix, str(tok.get('name')))}"))
        max_id = int(header.get("max_token_id", -1))
        if 0 < m.vocab_size <= max_id:
            bad.append(("model.vocab_size", f"{prefix} has token id {max_id}: needs "
                        f"model.vocab_size >= {max_id + 1}, got {m.vocab_size}"))
        if not (0 <= d.split_valid_fraction < 1 and m.seq_length >= 1 and d.seed >= 0):
            continue  # RANGE-* report these
        bad.extend(_split_problems(prefix, lengths, d.split_valid_fraction,
                                   split_seed(d.seed, k), m.seq_length))
    if not bad:
        return {}
    keys = tuple(dict.fromkeys(k for k, _ in bad))
    return {"keys": keys, "detail": "; ".join(t for _, t in bad)}


def _split_problems(
    prefix: str, lengths: Any, fraction: float, seed: int, seq_length: int
) -> list[tuple[str, str]]:
    """What the loader's document split and GPT samples would refuse for one dataset."""
    from lptrain.data.errors import DataError
    from lptrain.data.gpt_dataset import split_documents

    try:
        train_ids, valid_ids = split_documents(len(lengths), fraction, seed)
    except DataError as e:
        return [("data.split_valid_fraction", f"{prefix}: {e}")]
    out: list[tuple[str, str]] = []
    for name, ids in (("training", train_ids), ("validation", valid_ids)):
        if name == "validation" and not len(ids):
            continue
        tokens = int(lengths[ids].sum())
        if tokens - 1 < seq_length:
            out.append(("model.seq_length", f"the {name} split of {prefix} holds {tokens} tokens, "
                        f"fewer than one sample of seq_length + 1 = {seq_length + 1}"))
    return out


RULES = [
    Rule(
        id="DATA-UNREADABLE", severity="warning", keys=("data.source", "data.paths"),
        when=_unreadable,
        message="the dataset cannot be read on this machine, so it was not checked against the "
                "model: {detail}",
        fix="prepare it with `lptrain prepare-data --input ... --output PREFIX`, or fix the path "
            "(fine when the data only exists where the run happens)",
        condition="every explicit data prefix has a readable PREFIX.idx here, and data.tokenizer "
                  "(a file) exists",
        why="pretrain would stop with a data error", section=S,
    ),
    Rule(
        id="DATA-FITS-MODEL", severity="error",
        keys=("model.vocab_size", "model.seq_length", "data.tokenizer",
              "data.split_valid_fraction"),
        when=_mismatch, message="the data does not fit the model: {detail}",
        fix="raise model.vocab_size, shorten model.seq_length, lower data.split_valid_fraction or "
            "set data.tokenizer as the message says",
        condition="vocab_size > the dataset's largest token id (257 = EOS for the byte tokenizer); "
                  "data.tokenizer is the one the data was prepared with; each split holds more "
                  "than seq_length tokens; the split leaves training documents",
        why="pretrain would stop with a data error after building the model", section=S,
    ),
]
