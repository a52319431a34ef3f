"""Configuration rules as data, and the facts they share.

A :class:`Rule` is built with keyword arguments: ``id``, ``severity``, ``keys``, ``when``,
``message`` and ``fix``, plus the documentation columns of the catalog (``condition``, ``why``,
``section``). ``when(cfg, world)`` runs on a *derived* config and returns something falsy
when the config is fine; otherwise ``True`` or a dict of extra fields used to format
``message``/``fix`` (``str.format`` with ``cfg``, ``world`` and those fields); a ``"keys"``
entry in the dict narrows the reported keys to the ones at fault. Rule definitions live in
:mod:`lptrain.config.rulesets`, one module per catalog section; :func:`all_rules` is the
single list that the checker, ``lptrain rules``, the ``docs/rules.md`` page and the tests all
read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lptrain.catalog.ns_coefficients import COEFFICIENT_SETS
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World

Severity = Literal["error", "warning", "derived"]
When = Callable[[LPTrainConfig, World], Any]

# Known value sets (the catalog's "from the known sets").
PARAMS_DTYPES = ("bf16", "fp32")
BACKENDS = ("auto", "te", "emulated")
FP8_FORMATS = (None, "e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
FP4_FORMATS = (None, "e2m1")
FP4_RECIPES = ("nvfp4",)
AMAX_ALGOS = ("most_recent", "max")
OPTIMIZERS = ("adamw", "muon")
LAYER_WISE_LAYOUTS = ("compact", "padded")
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
SCALAR_OPTIMIZERS = ("adamw", "lion")
MUON_COEFFICIENTS = tuple(COEFFICIENT_SETS)  # one source: the optimizer's own table
MUON_SCALE_MODES = ("shape_scaling", "spectral", "unit_rms_norm")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
# Score functions that score each expert on its own: the ones the expert bias pairs with
# (Megatron's TransformerConfig check), and the ones whose top-1 probability is not always 1.
INDEPENDENT_SCORE_FUNCTIONS = ("sigmoid", "sqrtsoftplus")
SHARDING_TYPES = ("dp_reshardable", "fully_reshardable", "fully_sharded_model_space")
DEVICES = ("auto", "cpu", "cuda")
WANDB_MODES = ("online", "offline", "disabled")

# GEMM dimension alignment each quantized recipe needs (whole quantization blocks).
RECIPE_ALIGNMENT = {"delayed": 16, "tensorwise": 16, "blockwise": 16, "mxfp8": 32, "nvfp4": 32}
# Minimum compute capability for the Transformer Engine backend.
RECIPE_MIN_SM = {"delayed": 89, "tensorwise": 89, "blockwise": 90, "mxfp8": 100, "nvfp4": 100}
# Transformer Engine facts, from TE's release history (checked against its v2.0-v2.19 sources).
# TE_MIN_VERSION: the oldest TE lptrain's adapter is written for (QParams, Float8CurrentScaling).
TE_MIN_VERSION = "2.2"
# First TE release shipping each recipe class: Float8CurrentScaling 2.2, Float8BlockScaling
# 2.3, NVFP4BlockScaling 2.8 (DelayedScaling and MXFP8BlockScaling predate 2.2).
RECIPE_MIN_TE = {"delayed": "2.2", "tensorwise": "2.2", "blockwise": "2.3", "mxfp8": "2.2",
                 "nvfp4": "2.8"}
# TE 2.3-2.8 run Float8BlockScaling on Hopper only; 2.9 adds Blackwell (through MXFP8 GEMMs).
BLOCKWISE_BLACKWELL_MIN_TE = "2.9"
# GroupedLinear applies the recipe's amax_epsilon (QParams) from 2.3; Linear already in 2.2.
GROUPED_AMAX_EPSILON_MIN_TE = "2.3"
# GroupedLinear(single_grouped_weight=...) appears in 2.14; from 2.15 it is honoured only with
# NVTE_GROUPED_LINEAR_SINGLE_PARAM=1 at construction, and from 2.19 only with
# use_grouped_tensor=True (the TE adapter sets both).
SINGLE_GROUPED_WEIGHT_MIN_TE = "2.14"
SINGLE_GROUPED_WEIGHT_ENV_TE = "2.15"
USE_GROUPED_TENSOR_TE = "2.19"
# TE refuses MXFP8 from compute capability 12.0 on ("not supported on 12.0+ architectures").
MXFP8_FIRST_UNSUPPORTED_SM = 120
# Float8BlockScaling GEMMs need a CUDA 12.9+ build of torch/TE (TE's block-scaling check).
BLOCKWISE_MIN_CUDA = "12.9"


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One catalog rule (keyword arguments only: nine strings in a row do not say which is
    which). ``severity="derived"`` rules are applied by ``derive()``, not reported."""

    id: str
    severity: Severity
    keys: tuple[str, ...]
    when: When
    message: str
    fix: str
    condition: str = ""
    why: str = ""
    section: str = ""
    # Ids of rules this one replaces when both fire (a more specific message for one fault).
    supersedes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Violation:
    """One reported problem: what the CLI prints and ``--json`` emits."""

    rule: str
    severity: Severity
    keys: tuple[str, ...]
    message: str
    fix: str
    supersedes: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "severity": self.severity,
            "keys": list(self.keys),
            "message": self.message,
            "fix": self.fix,
        }


# --------------------------------------------------------------------------- shared facts


def fp8_on(c: LPTrainConfig) -> bool:
    return c.precision.fp8_format is not None


def fp4_on(c: LPTrainConfig) -> bool:
    return c.precision.fp4_format is not None


def quant_recipe(c: LPTrainConfig) -> str | None:
    """The quantized GEMM recipe in use (fp8_recipe, fp4_recipe) or None for bf16 GEMMs."""
    if fp8_on(c):
        return c.precision.fp8_recipe
    if fp4_on(c):
        return c.precision.fp4_recipe
    return None


def is_mxfp8(c: LPTrainConfig) -> bool:
    return fp8_on(c) and c.precision.fp8_recipe == "mxfp8"


def layer_wise(c: LPTrainConfig) -> bool:
    """The layer-wise (Muon) distributed optimizer is in use (derived by ``derive()``)."""
    return bool(c.optimizer.use_layer_wise_optimizer)


def sharded_optimizer(c: LPTrainConfig) -> bool:
    """An optimizer that owns fp32 master copies per shard: distributed or layer-wise."""
    return c.ddp.use_distributed_optimizer or layer_wise(c)


def param_gather(c: LPTrainConfig) -> bool:
    return c.precision.fp8_param_gather or c.precision.fp4_param_gather


def is_moe(c: LPTrainConfig) -> bool:
    return c.model.moe.num_experts > 0


def decay_end(c: LPTrainConfig) -> int:
    """The step the LR decay ends at: ``optimizer.decay_iters``, else ``train.train_iters``."""
    o = c.optimizer
    return o.decay_iters if o.decay_iters is not None else c.train.train_iters


def bad_choices(c: LPTrainConfig, table: Sequence[tuple[str, Sequence[Any]]]) -> dict[str, Any]:
    """For a choices rule: the keys whose values are outside their known sets."""
    bad = []
    for key, allowed in table:
        value = get_key(c, key)
        if value not in allowed:
            shown = ", ".join("null" if a is None else str(a) for a in allowed)
            bad.append((key, f"{key}={value!r} (expected one of {shown})"))
    if not bad:
        return {}
    return {"keys": tuple(k for k, _ in bad), "bad": "; ".join(d for _, d in bad)}


def get_key(c: Any, key: str) -> Any:
    for part in key.split("."):
        c = getattr(c, part)
    return c


def all_rules() -> list[Rule]:
    """Every rule, in catalog order (sections as in flag-rules.md, then value-set rules)."""
    from lptrain.config.rulesets import (
        choices,
        data,
        ddp,
        ep,
        inert,
        loop,
        model,
        moe,
        muon,
        precision,
        ranges,
    )

    return [*precision.RULES, *ddp.RULES, *muon.RULES, *moe.RULES, *ep.RULES, *model.RULES, *choices.RULES,
            *ranges.RULES, *data.RULES, *loop.RULES, *inert.RULES]


def rule_ids() -> list[str]:
    return [r.id for r in all_rules()]
