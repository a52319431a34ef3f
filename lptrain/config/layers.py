"""Which layer of a composed config set a key, and what that means for keys made inert.

A config is composed in layers: fragments, then the recipe's own values, then command-line
overrides (:mod:`lptrain.config.compose`). The inert-key rules (:mod:`lptrain.config.rulesets.
inert`) refuse a key that has no effect. That is right when the user sets the key where the
switch that disables it is already set -- ``precision.fp8_recipe=mxfp8`` next to
``precision.fp8_format=null`` -- but wrong when a *later* layer turns a feature off: ``lptrain
validate-config --recipe moe_mxfp8.yaml precision.fp8_format=null ...`` is how a user gets the
bf16 baseline of an FP8 recipe (Megatron accepts it), and the recipe's own
``fp8_recipe=mxfp8`` was refused although the user never wrote it.

So :func:`check_composed` keeps the rule catalog's verdicts, except for an inert-key error on a
key that still had an effect in the layer that set it (the config composed up to that layer
does not trip the gate) and lost it to a later layer: that key is reported as a warning
naming both layers. Keys set in the same layer as the switch, or after it, stay errors.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

from lptrain.config.check import check
from lptrain.config.compose import Composed, merge_layers
from lptrain.config.derive import derive
from lptrain.config.rules import Violation, get_key, quant_recipe
from lptrain.config.rulesets.inert import GATES_BY_ID, Gate
from lptrain.config.schema import LPTrainConfig, show_value
from lptrain.config.world import World


def set_in(composed: Composed, key: str) -> int | None:
    """Index of the last layer that sets the dotted ``key`` (None: only the schema default)."""
    found = None
    for i, layer in enumerate(composed.layers):
        node: Any = layer.data
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                node = _MISSING
                break
            node = node[part]
        if node is not _MISSING:
            found = i
    return found


_MISSING = object()


def _prefix_configs(composed: Composed, world: World) -> Callable[[int], LPTrainConfig]:
    """The derived config of layers ``0..n``, composed once per ``n``."""

    @cache
    def upto(n: int) -> LPTrainConfig:
        return derive(merge_layers(composed.layers[: n + 1]), world)

    return upto


def _turned_off_by(gate: Gate, key: str, composed: Composed, world: World,
                   upto: Callable[[int], LPTrainConfig]) -> int | None:
    """The later layer that made ``key`` inert, or None when it was inert where it was set."""
    k = set_in(composed, key)
    if k is None:
        return None
    here = upto(k)
    if gate.idle(here, world) or key not in gate.set_keys(here):
        return None
    return next((j for j in range(k + 1, len(composed.layers)) if gate.idle(upto(j), world)), None)


def _where(composed: Composed, i: int) -> str:
    return composed.layers[i].source


def _warning(gate: Gate, key: str, cfg: LPTrainConfig, world: World, composed: Composed,
             set_at: int, off_at: int) -> Violation:
    because = gate.because.format(cfg=cfg, world=world, recipe=quant_recipe(cfg) or "none")
    return Violation(
        rule=gate.rule_id, severity="warning", keys=(key,),
        message=f"{key}={show_value(get_key(cfg, key))} (from {_where(composed, set_at)}) has no "
                f"effect: {because}; it was turned off by a later layer "
                f"({_where(composed, off_at)}), so this is a warning, not an error",
        fix=f"nothing, if that is the intent (e.g. the bf16 baseline of an FP8 recipe); "
            f"otherwise {gate.fix}",
    )


def soften_later_switches(violations: list[Violation], composed: Composed,
                          world: World) -> list[Violation]:
    """``violations`` with each inert-key error on a key that a later layer made inert turned
    into a warning naming both layers (see the module docstring)."""
    if not composed.layers or not any(v.rule in GATES_BY_ID and v.severity == "error"
                                      for v in violations):
        return violations
    cfg = derive(composed.cfg, world)
    upto = _prefix_configs(composed, world)
    out: list[Violation] = []
    for v in violations:
        gate = GATES_BY_ID.get(v.rule)
        if gate is None or v.severity != "error":
            out.append(v)
            continue
        later = {k: _turned_off_by(gate, k, composed, world, upto) for k in v.keys
                 if k in gate.keys}
        later = {k: j for k, j in later.items() if j is not None}
        if not later:
            out.append(v)
            continue
        rest = [k for k in v.keys if k in gate.keys and k not in later]
        if rest:  # the same error, for the keys set where the switch already was
            out.append(_narrowed(gate, cfg, world, rest))
        out += [_warning(gate, k, cfg, world, composed, set_in(composed, k) or 0, j)
                for k, j in later.items()]
    return out


def _narrowed(gate: Gate, cfg: LPTrainConfig, world: World, keys: list[str]) -> Violation:
    fields = {"cfg": cfg, "world": world, **gate.report(cfg, keys)}
    rule = gate.rule()
    return Violation(rule.id, "error", tuple(keys), rule.message.format(**fields),
                     rule.fix.format(**fields))


def check_composed(composed: Composed, world: World) -> list[Violation]:
    """Every rule violation of a composed recipe (:func:`lptrain.config.check.check`), with
    keys made inert by a later layer reported as warnings."""
    return soften_later_switches(check(composed.cfg, world), composed, world)
