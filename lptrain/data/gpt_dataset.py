"""GPT samples: windows of ``seq_length + 1`` tokens over a shuffled stream of documents.

Per epoch the documents of a split are laid end to end in an order fixed by ``(seed, epoch)``
(each document already ends with EOS, so documents are separated by EOS). Sample ``j`` of the
epoch covers stream tokens ``[j*L, j*L + L + 1)`` (``L = seq_length``; consecutive samples
share one token so every token is predicted once), and the epoch's sample order is a second
permutation fixed by ``(seed, epoch)``. An epoch holds ``(tokens - 1) // L`` samples; leftover
tokens are dropped for that epoch only (the next epoch's order puts other documents last).

``sample(s)`` addresses an infinite stream: stream index ``s`` is sample ``s % N`` of epoch
``s // N``. Layouts are computed vectorised per epoch and cached, so reading a sample is one or
a few memmap slices.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np

from lptrain.data.errors import DataError
from lptrain.data.indexed import IndexedDataset


@dataclass
class _EpochLayout:
    doc_start: np.ndarray  # file offset of the i-th document of this epoch's order
    cum: np.ndarray  # stream offset of the i-th document (len = docs + 1)
    sample_perm: np.ndarray  # epoch-local sample order
    first_doc: np.ndarray  # per (unshuffled) sample: index into the order of its first document
    # Fast path, indexed by position in the shuffled order: file offset of the sample's first
    # token, and whether the whole sample lies in one document (one memmap slice).
    file_start: np.ndarray
    single: np.ndarray


def split_seed(data_seed: int, dataset_index: int) -> int:
    """The split/shuffle seed of the ``dataset_index``-th dataset of a blend (one place, so
    validation predicts exactly the split the loader makes)."""
    return int(data_seed) + 1000 * int(dataset_index)


def split_documents(num_docs: int, valid_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted ``(train_ids, valid_ids)``, fixed by ``seed``; valid gets >= 1 doc if > 0."""
    if not 0.0 <= valid_fraction < 1.0:
        raise DataError(f"split_valid_fraction must be in [0, 1), got {valid_fraction}")
    n_valid = 0 if valid_fraction == 0 else max(1, round(valid_fraction * num_docs))
    if n_valid and num_docs - n_valid < 1:
        raise DataError(
            f"cannot hold out {n_valid} of {num_docs} documents for validation: no training documents left"
        )
    perm = np.random.default_rng([seed, 0x5EED]).permutation(num_docs)
    return np.sort(perm[n_valid:]), np.sort(perm[:n_valid])


class GPTDataset:
    """Samples of one split of one indexed dataset, addressable by stream index."""

    def __init__(
        self,
        indexed: IndexedDataset,
        doc_ids: np.ndarray,
        seq_length: int,
        seed: int,
        name: str = "",
    ) -> None:
        self.indexed = indexed
        self.doc_ids = np.asarray(doc_ids, dtype=np.int64)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.name = name or indexed.prefix
        self._lengths = indexed.doc_lengths[self.doc_ids]
        self._starts = indexed.offsets[self.doc_ids]
        total = int(self._lengths.sum())
        self.num_tokens = total
        self.samples_per_epoch = (total - 1) // self.seq_length if total > 0 else 0
        if self.samples_per_epoch < 1:
            raise DataError(
                f"dataset {self.name}: {total} tokens in {len(self.doc_ids)} documents is fewer than "
                f"one sample of seq_length + 1 = {self.seq_length + 1} tokens (use more data, a "
                "shorter seq_length or, for a validation split, a larger split_valid_fraction)"
            )
        self._cache: dict[int, _EpochLayout] = {}

    def __len__(self) -> int:
        return self.samples_per_epoch

    @functools.cached_property
    def fingerprint(self) -> str:
        """Identity of the sample stream: token checksum, split documents, seq_length, seed."""
        h = hashlib.blake2b(digest_size=16)
        h.update(str(self.indexed.header["tokens_blake2b"]).encode())
        h.update(self.doc_ids.tobytes())
        h.update(f"{self.seq_length}:{self.seed}".encode())
        return h.hexdigest()

    def _layout(self, epoch: int) -> _EpochLayout:
        lay = self._cache.get(epoch)
        if lay is None:
            self.indexed.check_unchanged()  # an epoch boundary: the file must be the one opened
            rng = np.random.default_rng([self.seed, epoch, 0x6E7])
            order = rng.permutation(len(self.doc_ids))
            lengths = self._lengths[order]
            cum = np.zeros(len(order) + 1, dtype=np.int64)
            np.cumsum(lengths, out=cum[1:])
            starts = np.arange(self.samples_per_epoch, dtype=np.int64) * self.seq_length
            first = np.searchsorted(cum, starts, side="right") - 1
            perm = rng.permutation(self.samples_per_epoch)
            doc_start = self._starts[order]
            file_start = doc_start[first] + (starts - cum[first])
            single = cum[first + 1] >= starts + self.seq_length + 1
            lay = _EpochLayout(doc_start, cum, perm, first, file_start[perm], single[perm])
            if len(self._cache) >= 2:
                self._cache.pop(next(iter(self._cache)))
            self._cache[epoch] = lay
        return lay

    def sample_into(self, stream_index: int, out: np.ndarray, start: int = 0) -> None:
        """Write tokens ``[start, start + len(out))`` of the ``seq_length + 1`` tokens of
        stream sample ``stream_index`` into ``out`` (the whole sample by default; a
        context-parallel rank reads only its chunks' spans)."""
        epoch, i = divmod(int(stream_index), self.samples_per_epoch)
        lay = self._cache.get(epoch) or self._layout(epoch)
        need = len(out)
        if start < 0 or start + need > self.seq_length + 1:
            raise ValueError(f"tokens [{start}, {start + need}) are not inside a sample of "
                             f"{self.seq_length + 1} tokens")
        if lay.single[i]:
            a = int(lay.file_start[i]) + start
            out[:] = self.indexed.tokens[a : a + need]
            return
        j = int(lay.sample_perm[i])
        pos = j * self.seq_length + start
        k = int(lay.first_doc[j])
        while int(lay.cum[k + 1]) <= pos:  # the document holding the first token read
            k += 1
        tokens = self.indexed.tokens
        filled = 0
        while filled < need:
            off = pos - int(lay.cum[k])
            take = min(need - filled, int(lay.cum[k + 1]) - pos)
            a = int(lay.doc_start[k]) + off
            out[filled : filled + take] = tokens[a : a + take]
            filled += take
            pos += take
            k += 1

    def sample(self, stream_index: int) -> np.ndarray:
        out = np.empty(self.seq_length + 1, dtype=np.int64)
        self.sample_into(stream_index, out)
        return out

    def epoch_order(self, epoch: int) -> np.ndarray:
        """This epoch's sample order (for tests and inspection)."""
        return self._layout(epoch).sample_perm.copy()
