"""Run every rule on a derived config and collect every violation (never stop at the first)."""

from __future__ import annotations

from typing import Any

from lptrain.config.derive import derive
from lptrain.config.rules import Rule, Violation, all_rules
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World


def _violation(rule: Rule, hit: Any, cfg: LPTrainConfig, world: World) -> Violation:
    ctx: dict[str, Any] = dict(hit) if isinstance(hit, dict) else {}
    keys = tuple(ctx.pop("keys", rule.keys))
    fields = {"cfg": cfg, "world": world, **ctx}
    return Violation(
        rule=rule.id,
        severity=rule.severity,
        keys=keys,
        message=rule.message.format(**fields),
        fix=rule.fix.format(**fields),
        supersedes=rule.supersedes,
    )


def check(cfg: LPTrainConfig, world: World, rules: list[Rule] | None = None) -> list[Violation]:
    """All violations of ``cfg`` in ``world``, in catalog order.

    ``cfg`` is derived first (``derive`` is idempotent), so callers may pass either the
    composed or the derived config. Derived rules are applied by ``derive`` and never
    reported. When a more specific rule fires together with one it ``supersedes`` (same
    fault), only the specific one is reported; it lists the keys of both.
    """
    cfg = derive(cfg, world)
    world = world.for_config(cfg)  # dp and the rank count, settled for the model-parallel sizes
    out: list[Violation] = []
    for rule in rules if rules is not None else all_rules():
        if rule.severity == "derived":
            continue
        hit = rule.when(cfg, world)
        if hit:
            out.append(_violation(rule, hit, cfg, world))
    hidden = {sid for v in out for sid in v.supersedes}
    if hidden:
        by_id = {v.rule: v for v in out}
        merged: list[Violation] = []
        for v in out:
            if v.rule in hidden:
                continue
            extra = tuple(k for s in v.supersedes if s in by_id for k in by_id[s].keys)
            if extra:
                v = Violation(v.rule, v.severity, tuple(dict.fromkeys((*v.keys, *extra))),
                              v.message, v.fix, v.supersedes)
            merged.append(v)
        out = merged
    return out


def has_errors(violations: list[Violation]) -> bool:
    return any(v.severity == "error" for v in violations)
