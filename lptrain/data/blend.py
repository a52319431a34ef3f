"""Weighted blends of datasets: a deterministic interleave that follows the weights exactly.

Position ``p`` of the blended stream goes to the dataset with the largest deficit
``w_k * (p + 1) - count_k`` (ties to the lower index), Megatron's greedy error-minimising blend:
after any prefix of ``n`` positions every dataset ``k`` has received ``w_k * n`` samples up to
less than one sample per dataset. Within dataset ``k`` the ``count_k``-th pick reads stream
sample ``count_k`` (see :class:`GPTDataset`), so each dataset cycles through its own epochs.
The assignment is computed in blocks on demand and cached.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import numpy as np

from lptrain.data.errors import DataError
from lptrain.data.gpt_dataset import GPTDataset

_BLOCK = 1 << 14


class BlendedStream:
    """Global sample position -> ``(dataset index, stream index within that dataset)``."""

    def __init__(self, datasets: Sequence[GPTDataset], weights: Sequence[float] | None = None) -> None:
        if not datasets:
            raise DataError("a blend needs at least one dataset")
        self.datasets = list(datasets)
        seq = {d.seq_length for d in self.datasets}
        if len(seq) != 1:
            raise DataError(f"blended datasets disagree on seq_length: {sorted(seq)}")
        self.seq_length = seq.pop()
        if not weights:
            weights = [float(d.samples_per_epoch) for d in self.datasets]
        if len(weights) != len(self.datasets):
            raise DataError(f"{len(weights)} blend weights for {len(self.datasets)} datasets")
        w = np.asarray(weights, dtype=np.float64)
        if np.any(w < 0) or not np.isfinite(w).all() or w.sum() <= 0:
            raise DataError(f"blend weights must be finite, >= 0 and not all 0: {list(weights)}")
        self.weights = w / w.sum()
        self._ds_idx = np.zeros(0, dtype=np.int32)
        self._ds_pos = np.zeros(0, dtype=np.int64)
        self._counts = [0] * len(self.datasets)

    @functools.cached_property
    def fingerprint(self) -> str:
        """Identity of the blended stream (its datasets' fingerprints and the weights)."""
        parts = [d.fingerprint for d in self.datasets] + [repr([float(w) for w in self.weights])]
        return hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()

    def _extend(self, upto: int) -> None:
        n0 = len(self._ds_idx)
        if upto <= n0:
            return
        n1 = ((upto + _BLOCK - 1) // _BLOCK) * _BLOCK
        idx = np.empty(n1 - n0, dtype=np.int32)
        pos = np.empty(n1 - n0, dtype=np.int64)
        counts = self._counts
        w = [float(x) for x in self.weights]
        rng = range(len(w))
        for p in range(n0, n1):
            best = max(rng, key=lambda k: w[k] * (p + 1) - counts[k])
            idx[p - n0] = best
            pos[p - n0] = counts[best]
            counts[best] += 1
        self._ds_idx = np.concatenate([self._ds_idx, idx])
        self._ds_pos = np.concatenate([self._ds_pos, pos])

    def check_unchanged(self) -> None:
        """Raise ``DatasetChangedError`` when a dataset's token file changed since it was opened."""
        for d in self.datasets:
            d.indexed.check_unchanged()

    def locate(self, position: int) -> tuple[int, int]:
        if len(self.datasets) == 1:
            return 0, int(position)
        self._extend(position + 1)
        return int(self._ds_idx[position]), int(self._ds_pos[position])

    def sample_into(self, position: int, out: np.ndarray, start: int = 0) -> None:
        """Tokens ``[start, start + len(out))`` of the sample at ``position``."""
        if len(self.datasets) == 1:
            self.datasets[0].sample_into(position, out, start)
            return
        k, s = self.locate(position)
        self.datasets[k].sample_into(s, out, start)

    def dataset_of(self, positions: np.ndarray) -> np.ndarray:
        """Dataset index of each position (for tests and statistics)."""
        if len(self.datasets) == 1:
            return np.zeros(len(positions), dtype=np.int32)
        self._extend(int(np.max(positions)) + 1)
        return self._ds_idx[positions]
