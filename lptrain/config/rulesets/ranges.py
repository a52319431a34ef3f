"""Value ranges: every numeric key that no other rule bounds, checked before anything runs.

Why: without them ``model.seq_length=0`` validates and then dies in a ``ZeroDivisionError``
deep in the data pipeline, and ``data.split_valid_fraction=1.5`` only fails once data loads.
Each rule reports only the keys out of range. Float checks are written as ``lo <= v <= hi``
so NaN fails them. Sizes also have an upper sanity bound, :data:`MAX_SIZE`: no real model
comes near it, and below it every tensor's element count stays far inside int64, so an
absurd value is reported here instead of overflowing a kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from lptrain.config.rules import Rule, get_key
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World

S = "Value ranges"

MAX_SIZE = 1 << 24  # 16,777,216: widths, vocabulary, sequence length, batch sizes
MAX_LAYERS = 1024
MAX_EXPERTS = 4096
MAX_SEED = (1 << 63) - 1

Check = Callable[[Any], bool]


def _size(hi: int = MAX_SIZE) -> tuple[Check, str]:
    return (lambda v: v is None or 1 <= v <= hi), f"in [1, {hi}]"


def _count(hi: int = MAX_SIZE) -> tuple[Check, str]:
    return (lambda v: 0 <= v <= hi), f"in [0, {hi}]"


def _positive() -> tuple[Check, str]:
    return (lambda v: 0 < v < math.inf), "> 0 and finite"


def _non_negative() -> tuple[Check, str]:
    return (lambda v: 0 <= v < math.inf), ">= 0 and finite"


def _fraction() -> tuple[Check, str]:
    return (lambda v: 0 <= v < 1), "in [0, 1)"


def _seed() -> tuple[Check, str]:
    return (lambda v: 0 <= v <= MAX_SEED), "in [0, 2^63)"


Spec = tuple[str, tuple[Check, str]]

MODEL_RANGES: tuple[Spec, ...] = (
    ("model.num_layers", _size(MAX_LAYERS)),
    ("model.hidden_size", _size()),
    ("model.ffn_hidden_size", _size()),
    ("model.seq_length", _size()),
    ("model.vocab_size", _size()),
    ("model.make_vocab_size_divisible_by", _size()),
    ("model.rotary_base", _positive()),
    ("model.norm_epsilon", _positive()),
    ("model.init_method_std", _non_negative()),
    ("model.moe.num_experts", _count(MAX_EXPERTS)),
    ("model.moe.moe_layer_freq", _size(MAX_LAYERS)),
    ("model.moe.ffn_hidden_size", _size()),
    ("model.moe.aux_loss_coeff", _non_negative()),
    ("model.moe.z_loss_coeff", _non_negative()),
    ("model.moe.bias_update_rate", _non_negative()),
)
TRAIN_RANGES: tuple[Spec, ...] = (
    ("train.micro_batch_size", _size()),
    ("train.global_batch_size", _size()),
    ("train.eval_iters", _count()),
    ("train.seed", _seed()),
    ("train.spike_zscore", ((lambda v: v is None or 0 < v < math.inf), "> 0 and finite (or null)")),
    ("train.spike_window", ((lambda v: 2 <= v <= MAX_SIZE), f"in [2, {MAX_SIZE}]")),
    ("train.max_rollbacks", _size()),
    ("logging.numerics_interval", _count()),
    ("debug.nan_sample", ((lambda v: v is None or 0 <= v <= MAX_SEED), "in [0, 2^63) (or null)")),
    ("checkpoint.keep_latest", ((lambda v: 2 <= v <= MAX_SIZE), f"in [2, {MAX_SIZE}] (the newest may be half-written)")),
)
DATA_RANGES: tuple[Spec, ...] = (
    ("data.split_valid_fraction", _fraction()),
    ("data.builtin_max_mb", _positive()),
    ("data.seed", _seed()),
    ("data.num_workers", _count(1024)),
)
PRECISION_RANGES: tuple[Spec, ...] = (
    ("precision.fp8_amax_history_len", _size()),
    ("precision.fp8_margin", _count(127)),
    ("precision.amax_epsilon", _non_negative()),
    ("optimizer.muon.extra_scale_factor", _positive()),
)


def out_of_range(c: LPTrainConfig, specs: Sequence[Spec]) -> dict[str, Any]:
    """For a range rule: the keys whose values fail their range, and a one-line detail."""
    bad = []
    for key, (ok, text) in specs:
        value = get_key(c, key)
        if not ok(value):
            bad.append((key, f"{key}={value!r} must be {text}"))
    if not bad:
        return {}
    return {"keys": tuple(k for k, _ in bad), "detail": "; ".join(d for _, d in bad)}


def _weights_bad(c: LPTrainConfig, w: World) -> dict[str, Any]:
    d = c.data
    hit = out_of_range(c, DATA_RANGES)
    keys, details = list(hit.get("keys", ())), [hit["detail"]] if hit else []
    if d.weights:
        n = len(d.paths) if d.paths else 1
        if len(d.weights) != n:
            keys.append("data.weights")
            details.append(f"data.weights has {len(d.weights)} entries for {n} dataset(s)")
        elif not all(0 <= x < math.inf for x in d.weights) or not sum(d.weights) > 0:
            keys.append("data.weights")
            details.append(f"data.weights={list(d.weights)} must be finite, >= 0, not all 0")
    if not keys:
        return {}
    return {"keys": tuple(keys), "detail": "; ".join(details)}


def _keys(specs: Sequence[Spec]) -> tuple[str, ...]:
    return tuple(k for k, _ in specs)


def _condition(specs: Sequence[Spec]) -> str:
    return "; ".join(f"{k.split('.', 1)[1]} {text}" for k, (_, text) in specs)


RULES = [
    Rule(
        id="RANGE-MODEL", severity="error", keys=_keys(MODEL_RANGES),
        when=lambda c, w: out_of_range(c, MODEL_RANGES),
        message="model size out of range: {detail}",
        fix="use values in the stated ranges (sizes are positive; see `lptrain show-config "
            "--explain`)",
        condition=_condition(MODEL_RANGES),
        why="a zero or negative size fails deep in the model or the data pipeline; the upper "
            "bounds keep element counts inside int64",
        section=S,
    ),
    Rule(
        id="RANGE-TRAIN", severity="error", keys=_keys(TRAIN_RANGES),
        when=lambda c, w: out_of_range(c, TRAIN_RANGES),
        message="training loop value out of range: {detail}",
        fix="use values in the stated ranges (batch sizes >= 1, seeds >= 0)",
        condition=_condition(TRAIN_RANGES),
        why="a zero batch divides by zero; a negative seed is rejected by the random generators",
        section=S,
    ),
    Rule(
        id="RANGE-DATA", severity="error", keys=(*_keys(DATA_RANGES), "data.weights"),
        when=_weights_bad, message="data setting out of range: {detail}",
        fix="use split_valid_fraction in [0, 1), a positive builtin_max_mb, non-negative seed and "
            "num_workers, and one finite non-negative weight per data.paths entry",
        condition=_condition(DATA_RANGES) + "; weights: one per dataset, finite, >= 0, not all 0",
        why="otherwise the document split or the blend fails only once data loads", section=S,
    ),
    Rule(
        id="RANGE-PRECISION", severity="error", keys=_keys(PRECISION_RANGES),
        when=lambda c, w: out_of_range(c, PRECISION_RANGES),
        message="precision or Muon scaling value out of range: {detail}",
        fix="use values in the stated ranges", condition=_condition(PRECISION_RANGES),
        why="a history of 0 or a negative epsilon breaks the scaling", section=S,
    ),
]
