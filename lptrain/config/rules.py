"""Configuration rules as data, and the facts they share.

A :class:`Rule` is built with keyword arguments: ``id``, ``severity``, ``keys``, ``when``,
``message`` and ``fix``, plus the documentation columns of the catalog (``condition``, ``why``,
``section``). ``when(cfg, world)`` runs on a *derived* config and returns something falsy
when the config is fine; otherwise ``True`` or a dict of extra fields used to format
``message``/``fix`` (``str.format`` with ``cfg``, ``world`` and those fields); a ``"keys"``
entry in the dict narrows the reported keys to the ones at fault. Rule definitions live in
:mod:`lptrain.config.rulesets`, one module per catalog section; :func:`all_rules` is the
single list that the checker, ``lptrain rules``, the ``docs/rules.md`` page and the tests all
read. Per-recipe facts come from the recipe catalog (:mod:`lptrain.catalog.recipes`), the
allowed values of choice keys from their one declaration (:func:`lptrain.config.schema.choices_of`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lptrain.catalog import recipes as catalog_recipes
from lptrain.catalog.recipes import RecipeSpec
from lptrain.config.schema import LPTrainConfig, show_value
from lptrain.config.world import World

Severity = Literal["error", "warning", "derived"]
When = Callable[[LPTrainConfig, World], Any]

# Score functions that score each expert on its own: the ones the expert bias pairs with
# (Megatron's TransformerConfig check), and the ones whose top-1 probability is not always 1.
INDEPENDENT_SCORE_FUNCTIONS = ("sigmoid", "sqrtsoftplus")


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


def quant_spec(c: LPTrainConfig) -> RecipeSpec | None:
    """The catalog entry named by :func:`quant_recipe` (None: bf16 GEMMs, or an unknown name,
    which the value-set rule PREC-CHOICES reports)."""
    return catalog_recipes.recipe(quant_recipe(c))


def format_on(c: LPTrainConfig, family: str) -> bool:
    """The element-format family's format key is set (``fp8`` / ``fp4``)."""
    return get_key(c, catalog_recipes.FAMILIES[family].format_key) is not None


def runs(c: LPTrainConfig, spec: RecipeSpec | None) -> bool:
    """``spec`` is the recipe in use: named by its family's recipe key, its format set."""
    return spec is not None and quant_recipe(c) == spec.name and format_on(c, spec.family)


def recipe_key(c: LPTrainConfig) -> str:
    """The key naming the recipe in use: ``precision.fp8_recipe``, else ``fp4_recipe``."""
    return "precision.fp8_recipe" if fp8_on(c) else "precision.fp4_recipe"


def is_mxfp8(c: LPTrainConfig) -> bool:
    return fp8_on(c) and c.precision.fp8_recipe == "mxfp8"


def layer_wise(c: LPTrainConfig) -> bool:
    """The layer-wise (Muon) distributed optimizer is in use (derived by ``derive()``)."""
    return bool(c.optimizer.use_layer_wise_optimizer)


def sharded_optimizer(c: LPTrainConfig) -> bool:
    """An optimizer that owns fp32 master copies per shard: distributed or layer-wise."""
    return c.ddp.use_distributed_optimizer or layer_wise(c)


def compact_layout(c: LPTrainConfig) -> bool:
    """The layer-wise optimizer with its compact parameter layout."""
    return layer_wise(c) and c.optimizer.layer_wise_param_layout == "compact"


def padded_layout(c: LPTrainConfig) -> bool:
    """The layer-wise optimizer with its padded parameter layout."""
    return layer_wise(c) and c.optimizer.layer_wise_param_layout == "padded"


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
            shown = ", ".join(show_value(a) for a in allowed)
            bad.append((key, f"{key}={value!r} (expected one of {shown})"))
    if not bad:
        return {}
    return {"keys": tuple(k for k, _ in bad), "bad": "; ".join(d for _, d in bad)}


def get_key(c: Any, key: str) -> Any:
    for part in key.split("."):
        c = getattr(c, part)
    return c


def all_rules() -> list[Rule]:
    """Every rule, in catalog order: the sections of ``docs/rules.md``, one ruleset module each."""
    from lptrain.config.rulesets import (
        choices,
        cp,
        data,
        ddp,
        ep,
        inert,
        loop,
        model,
        moe,
        muon,
        optim_state,
        pp,
        pp_split,
        precision,
        ranges,
        scaled_gemm,
        tp,
    )

    return [*precision.RULES, *scaled_gemm.RULES, *ddp.RULES, *muon.RULES, *optim_state.RULES, *moe.RULES, *ep.RULES,
            *tp.RULES, *pp.RULES, *pp_split.RULES, *cp.RULES, *model.RULES,
            *choices.RULES, *ranges.RULES, *data.RULES, *loop.RULES, *inert.RULES]


def rule_ids() -> list[str]:
    return [r.id for r in all_rules()]
