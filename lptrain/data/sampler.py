"""Global-batch sampler: which global sample positions each data-parallel rank reads.

Global batch ``b`` is the positions ``[c0 + b*G, c0 + (b+1)*G)`` of the (blended) sample stream,
where ``c0`` is the consumed-samples count to start from. It is read in ``G / (m * dp)`` micro
steps; in micro step ``t`` rank ``r`` reads ``m`` positions starting at
``c + t*m*dp + r*m`` (Megatron's layout). The ranks' slices are disjoint and together cover the
global batch, whatever ``dp``. The position state is ``consumed_samples``, counted in global
samples, so a checkpoint taken with one ``dp`` resumes with another without repeats or gaps.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from lptrain.data.errors import DataError


class GlobalBatchSampler:
    """Infinite source of this rank's micro-batch positions; tracks ``consumed_samples``."""

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        consumed_samples: int = 0,
    ) -> None:
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DataError(
                f"bad sampler layout: micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, dp_size={dp_size}"
            )
        if global_batch_size % (micro_batch_size * dp_size):
            raise DataError(
                f"global_batch_size {global_batch_size} is not a multiple of "
                f"micro_batch_size {micro_batch_size} x dp_size {dp_size}"
            )
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed_samples = int(consumed_samples)

    @property
    def num_micro_batches(self) -> int:
        """Micro steps per global batch on each rank (gradient accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def positions_at(self, consumed: int) -> np.ndarray:
        """This rank's positions for the micro step that starts at ``consumed``."""
        start = consumed + self.dp_rank * self.micro_batch_size
        return np.arange(start, start + self.micro_batch_size, dtype=np.int64)

    def next_positions(self) -> np.ndarray:
        """This rank's next micro-batch positions; advances the state by ``mbs * dp``."""
        pos = self.positions_at(self.consumed_samples)
        self.consumed_samples += self.micro_batch_size * self.dp_size
        return pos

    def __iter__(self) -> Iterator[np.ndarray]:
        while True:
            yield self.next_positions()

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        c = int(state["consumed_samples"])
        if c < 0:
            raise DataError(f"negative consumed_samples in data state: {c}")
        self.consumed_samples = c
