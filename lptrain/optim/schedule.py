"""Learning-rate schedules: linear warmup followed by cosine, linear, constant or WSD decay."""

from __future__ import annotations

import math


def lr_at(
    step: int,
    *,
    lr: float,
    min_lr: float,
    warmup_iters: int,
    decay_iters: int,
    schedule: str = "cosine",
) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    Warmup is linear from lr/warmup_iters to lr (step 0 already moves, as in Megatron).
    ``wsd`` (warmup-stable-decay) holds lr until the last 20% of ``decay_iters`` and then
    decays linearly to ``min_lr``.
    """
    if warmup_iters > 0 and step < warmup_iters:
        return lr * (step + 1) / warmup_iters
    if schedule == "constant":
        return lr
    span = max(1, decay_iters - warmup_iters)
    progress = min(1.0, max(0.0, (step - warmup_iters) / span))
    if schedule == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return lr - (lr - min_lr) * progress
    if schedule == "wsd":
        stable = 0.8
        if progress <= stable:
            return lr
        return lr - (lr - min_lr) * (progress - stable) / (1.0 - stable)
    raise ValueError(
        f"optimizer.lr_schedule={schedule!r} is not one of cosine, linear, constant, wsd"
    )
