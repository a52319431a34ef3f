"""Tokenizers: the built-in byte tokenizer and Hugging Face ``tokenizers`` JSON files.

The byte tokenizer needs nothing installed (256 byte values + BOS/EOS/PAD = 259 ids). A
``tokenizers`` JSON file is loaded lazily (optional dependency). Every tokenizer has an
``identity`` (name + sha256 of its definition) that the dataset index records, so a dataset
is never read with a tokenizer other than the one that wrote it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from lptrain.data.errors import DataError

BYTE_BOS, BYTE_EOS, BYTE_PAD = 256, 257, 258
BYTE_VOCAB_SIZE = 259
_BYTE_IDENTITY = hashlib.sha256(b"lptrain-byte-tokenizer-v1:256+bos,eos,pad").hexdigest()

_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|end_of_text|>", "[EOS]", "[SEP]")
_BOS_NAMES = ("<|bos|>", "<s>", "<bos>", "<|begin_of_text|>", "[BOS]", "[CLS]")
_PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]")
BPE_SPECIAL_TOKENS = ["<|endoftext|>", "<|bos|>", "<|pad|>"]

_INSTALL_HINT = (
    "the Hugging Face `tokenizers` package is needed for BPE tokenizers; "
    "install it with `pip install 'lptrain[bpe]'` (or `pip install tokenizers`)"
)


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    sha256: str
    vocab_size: int
    eos_id: int
    bos_id: int | None
    pad_id: int | None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...

    def spec(self) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids; BOS=256, EOS=257, PAD=258. Exact round trip of any text."""

    name = "byte"
    sha256 = _BYTE_IDENTITY
    vocab_size = BYTE_VOCAB_SIZE
    eos_id = BYTE_EOS
    bos_id: int | None = BYTE_BOS
    pad_id: int | None = BYTE_PAD

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        arr = np.asarray(ids, dtype=np.int64)
        arr = arr[arr < 256]  # specials carry no text
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def spec(self) -> str:
        return "byte"


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise DataError(_INSTALL_HINT) from exc
    return tokenizers


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file; EOS/BOS/PAD found among common special names."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"tokenizer file not found: {p}")
        tokenizers = _import_tokenizers()
        raw = p.read_bytes()
        try:
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:
            raise DataError(f"cannot load tokenizer {p}: {exc}") from exc
        self.path = str(p.resolve())
        self.name = f"hf:{p.name}"
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        eos = self._find(_EOS_NAMES)
        if eos is None:
            raise DataError(
                f"tokenizer {p} has no end-of-document token (looked for {', '.join(_EOS_NAMES)}); "
                "documents need an EOS separator"
            )
        self.eos_id: int = eos
        self.bos_id = self._find(_BOS_NAMES)
        self.pad_id = self._find(_PAD_NAMES)
        self._dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        self._encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        # Text that spells a special token ("<|endoftext|>" in a document) is ordinary text:
        # only the pipeline inserts EOS, so document boundaries cannot be forged by content.
        if hasattr(self._tok, "encode_special_tokens"):
            self._tok.encode_special_tokens = True

    def _find(self, names: Iterable[str]) -> int | None:
        for n in names:
            i = self._tok.token_to_id(n)
            if i is not None:
                return int(i)
        return None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids per text, as the narrowest unsigned dtype the vocabulary fits (what the
        dataset stores). ``encode_batch_fast`` (tokenizers >= 0.20) skips the character
        offsets nobody here reads; the ids are the same."""
        encs = self._encode(list(texts), add_special_tokens=False)
        return [np.array(e.ids, dtype=self._dtype) for e in encs]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of ``token_id`` (special tokens by their names)."""
        token = self._tok.id_to_token(int(token_id))
        return None if token is None else str(token)

    def spec(self) -> str:
        return self.path


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` or a path to a ``tokenizers`` JSON file."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str | os.PathLike[str]) -> HFTokenizer:
    """Train a byte-level BPE (exact round trip) on ``texts`` and save it to ``out_path``.

    Byte-level pre-tokenization and decoding keep every input byte recoverable; the special
    tokens are ``<|endoftext|>`` (EOS), ``<|bos|>`` and ``<|pad|>``.
    """
    tokenizers = _import_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(BPE_SPECIAL_TOKENS):
        raise DataError(f"--vocab-size {vocab_size} is too small for a byte-level BPE (>= 259)")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=BPE_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(out_path)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, out)
    return HFTokenizer(out)
