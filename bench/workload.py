"""The batches the engine benches feed their steps, from the trainer's own loader.

One helper for every bench that times whole training steps (train_step, host_overhead, ddp,
optim), so each builds rank ``rank``'s loader of a ``world``-rank run the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def train_batches(cfg: Any, rank: int = 0, world: int = 1) -> tuple[Iterator[dict[str, Any]], int]:
    """(rank ``rank``'s training micro-batches, micro-batches per step on each rank)."""
    from lptrain.data import build_train_valid_loaders

    t = cfg.train
    it, _ = build_train_valid_loaders(
        cfg.data, seq_length=cfg.model.seq_length, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size, dp_rank=rank, dp_size=world,
        vocab_size=cfg.model.vocab_size,
    )
    return it, t.global_batch_size // (t.micro_batch_size * world)
