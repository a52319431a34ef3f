"""Synthetic token datasets for the data tests (a plain module: test dirs are not packages)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lptrain.data.indexed import IndexedDataset, IndexedDatasetWriter


def write_token_dataset(prefix: Path, docs: Sequence[np.ndarray], vocab_size: int = 60000) -> IndexedDataset:
    """A dataset from raw token ids (EOS = vocab_size - 1), bypassing any tokenizer."""
    w = IndexedDatasetWriter(str(prefix), vocab_size, vocab_size - 1, {"name": "synthetic", "sha256": "0" * 64})
    w.add_documents([np.asarray(d, dtype=np.int64) for d in docs])
    w.finalize()
    return IndexedDataset(prefix)


def unique_docs(num_docs: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[np.ndarray]:
    """Documents of random length whose tokens are all distinct (ids never repeat, < 59999)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi, size=num_docs)
    ids = np.arange(int(lengths.sum()))
    return np.split(ids, np.cumsum(lengths)[:-1])

