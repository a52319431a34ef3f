"""Value ranges: every numeric key that no other rule bounds, checked before anything runs.

Why: without them ``model.seq_length=0`` validates and then dies in a ``ZeroDivisionError``
deep in the data pipeline, and ``data.split_valid_fraction=1.5`` only fails once data loads.
Each rule reports only the keys out of range. Sizes also have an upper sanity bound,
:data:`MAX_SIZE`: no real model comes near it, and below it every tensor's element count stays
far inside int64, so an absurd value is reported here instead of overflowing a kernel.

Non-finite numbers have one rule of their own, RANGE-FINITE, over every float key of the
schema (lists of floats included): ``optimizer.lr=inf`` or ``optimizer.weight_decay=1e400``
(YAML reads it as inf) used to validate and then end the run at its second step with a NaN
loss. The range rules below leave NaN and +-inf to it (one finding per fault, not two).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Sequence
from functools import cache
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
    ("model.tensor_model_parallel_size", _size(1 << 16)),
    ("model.pipeline_model_parallel_size", _size(MAX_LAYERS)),
    ("model.virtual_pipeline_model_parallel_size", _size(MAX_LAYERS)),
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
    ("train.spike_window", ((lambda v: 10 <= v <= MAX_SIZE),
                            f"in [10, {MAX_SIZE}] (a baseline is warm at 10 accepted steps)")),
    ("train.spiky_loss_factor", ((lambda v: 1 < v < math.inf), "> 1 and finite")),
    ("train.uniform_loss_factor", ((lambda v: 1 < v < math.inf), "> 1 and finite (a fresh model's loss is ln(vocab))")),
    ("train.max_rollbacks", _size()),
    ("logging.numerics_interval", _count()),
    ("debug.nan_sample", ((lambda v: v is None or 0 <= v <= MAX_SEED), "in [0, 2^63) (or null)")),
    ("checkpoint.keep_latest", ((lambda v: 2 <= v <= MAX_SIZE), f"in [2, {MAX_SIZE}] (the newest may be half-written)")),
    ("dist.distributed_timeout_minutes", _positive()),
    ("run.cpu_threads", ((lambda v: v is None or 1 <= v <= 4096), "in [1, 4096] (or null)")),
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


def _is_float_type(tp: Any) -> bool:
    """``float``, ``Optional[float]`` or ``list[float]``."""
    if tp is float:
        return True
    return typing.get_origin(tp) in (typing.Union, list) and float in typing.get_args(tp)


@cache
def float_keys(cls: type = LPTrainConfig, prefix: str = "") -> tuple[str, ...]:
    """Every dotted key whose schema type holds floats, in schema order."""
    out: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += float_keys(tp, f"{prefix}{f.name}.")
        elif _is_float_type(tp):
            out.append(prefix + f.name)
    return tuple(out)


def _non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def non_finite(c: LPTrainConfig) -> dict[str, Any]:
    """For RANGE-FINITE: every float key (or list of floats) holding NaN or +-inf."""
    bad = []
    for key in float_keys():
        value = get_key(c, key)
        values = value if isinstance(value, list) else [value]
        if any(_non_finite(v) for v in values):
            bad.append((key, f"{key}={value!r}"))
    if not bad:
        return {}
    return {"keys": tuple(k for k, _ in bad), "detail": ", ".join(d for _, d in bad)}


def out_of_range(c: LPTrainConfig, specs: Sequence[Spec]) -> dict[str, Any]:
    """For a range rule: the keys whose values fail their range, and a one-line detail
    (NaN and +-inf are RANGE-FINITE's)."""
    bad = []
    for key, (ok, text) in specs:
        value = get_key(c, key)
        if not _non_finite(value) and not ok(value):
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
        elif any(_non_finite(x) for x in d.weights):
            pass  # RANGE-FINITE's
        elif not all(x >= 0 for x in d.weights) or not sum(d.weights) > 0:
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
        id="RANGE-FINITE", severity="error", keys=float_keys(),
        when=lambda c, w: non_finite(c),
        message="not a finite number: {detail}",
        fix="use a finite value (YAML reads 1e400 as inf); see `lptrain show-config --explain` "
            "for each key's range",
        condition="every float key (and every entry of a list of floats) is finite: no nan, "
                  "inf or -inf",
        why="an infinite lr or weight decay validated and then made the loss NaN at step 2; no "
            "float setting of lptrain means anything at infinity",
        section=S,
    ),
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
        fix="use values in the stated ranges (batch sizes >= 1, seeds >= 0, a positive timeout)",
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
