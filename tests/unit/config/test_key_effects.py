"""No key is ever accepted and ignored: for every schema key and every shipped recipe, the
key is changed to another value (``_key_candidates.py``) and one of these must hold:

* validation refuses the change with a rule that names the key and says why it would have no
  effect there (``lptrain/config/rulesets/inert.py``), and ``inert_keys`` -- the list
  ``docs/rules.md`` shows for each recipe -- lists the key;
* something the run code builds from the config changes (``_key_effects.Fingerprint``: the
  resolved settings, the model on the meta device, the buffer layout, the engine's optimizers
  and schedule, or two optimizer steps);
* the key acts later than a first step can show (intervals, signals, paths, the data
  pipeline, dp > 1, another backend): it is listed in ``lptrain/config/key_effects.py`` with
  the test that proves its effect (checked to exist and to use the key);
* no other value is valid in that context (every candidate is refused for another reason, or
  resolves to the same run after ``derive``): there is nothing to ignore.

Cheap by construction: one base fingerprint per recipe, components computed lazily cheapest
first and compared in that order, the full-size model only on the meta device, and the
engine of a cluster recipe at the tiny model's widths (``_key_effects.SHRINK``).
"""

from __future__ import annotations

import ast
import copy
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _key_candidates import CANDIDATES
from _key_effects import SHRINK, Fingerprint, fields_of, set_key, shrunk

from lptrain.config import World, check, derive, load
from lptrain.config.compose import repo_root
from lptrain.config.key_effects import LATER_KEYS
from lptrain.config.rules import get_key
from lptrain.config.rulesets.inert import INERT_RULE_IDS, inert_keys
from lptrain.config.schema import LPTrainConfig

RECIPES = sorted((repo_root() / "recipes").glob("*.yaml"))
KEYS = fields_of(LPTrainConfig())


def recipe_world(target: str) -> World:
    """The world a recipe is checked in: one CPU rank, or 8 ranks of its GPU target."""
    return World.detect(dp=1, target="cpu") if target == "cpu" else World.detect(dp=8, target=target)


class Recipe:
    """One recipe's composed config, world, and base fingerprints (computed once)."""

    def __init__(self, path: Path) -> None:
        composed = load(path)
        self.name = path.stem
        self.cfg = composed.cfg
        self.world = recipe_world(composed.meta.target)
        # a GPU recipe, or a tensor-parallel one (its world of several ranks cannot run in
        # this one process): the engine runs shrunk to one CPU rank (_key_effects.SHRINK)
        self.cluster = (composed.meta.target != "cpu" or composed.cfg.model.tensor_model_parallel_size > 1
                        or composed.cfg.model.pipeline_model_parallel_size > 1
                        or composed.cfg.model.context_parallel_size > 1)
        self.derived = derive(self.cfg, self.world)
        self._base: dict[bool, Fingerprint] = {}

    def fingerprint(self, cfg: LPTrainConfig, key: str | None = None) -> Fingerprint:
        """A cluster recipe's engine runs shrunk; with a shrink key changed it is not compared."""
        if self.cluster and key in SHRINK:
            return Fingerprint(cfg, self.world, engine_cfg=None)
        return Fingerprint(cfg, self.world, engine_cfg=shrunk(cfg) if self.cluster else cfg)

    def base(self, key: str) -> Fingerprint:
        without_engine = self.cluster and key in SHRINK
        if without_engine not in self._base:
            self._base[without_engine] = self.fingerprint(self.cfg, key)
        return self._base[without_engine]


def classify(r: Recipe, key: str) -> tuple[str, Any]:
    """``("inert", rule)``, ``("effect", component)``, ``("later", test)``,
    ``("single", why)`` or ``("ignored", tried values)`` (the failure)."""
    value = get_key(r.derived, key)
    accepted = []
    for candidate in CANDIDATES[key](value, r.derived):
        if candidate == value:
            continue
        cfg = copy.deepcopy(r.cfg)
        set_key(cfg, key, candidate)
        errors = [v for v in check(cfg, r.world) if v.severity == "error"]
        inert = [v.rule for v in errors if v.rule in INERT_RULE_IDS and key in v.keys]
        if inert:
            return "inert", inert[0]
        if errors or derive(cfg, r.world) == r.derived:
            continue  # not a valid value here, or the same run spelled differently
        if key in LATER_KEYS:
            return "later", LATER_KEYS[key].test
        changed = r.base(key).first_difference(r.fingerprint(cfg, key), ignore_settings=(key,))
        if changed:
            return "effect", changed
        accepted.append(candidate)
    if accepted:
        return "ignored", accepted
    return "single", "no other value is valid here"


@cache
def recipe(path: Path) -> Recipe:
    return Recipe(path)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # tiny GEMMs: threads only add overhead here


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_no_key_is_accepted_and_ignored(path: Path) -> None:
    r = recipe(path)
    outcomes = {key: classify(r, key) for key in KEYS}
    ignored = {k: o[1] for k, o in outcomes.items() if o[0] == "ignored"}
    assert not ignored, f"{r.name}: accepted, yet nothing observable changed: {ignored}"
    # The inert list (docs/rules.md) is exactly the keys whose change is refused as inert.
    listed = {i.key: i.rule for i in inert_keys(r.cfg, r.world)}
    refused = {k: o[1] for k, o in outcomes.items() if o[0] == "inert"}
    assert refused.items() <= listed.items(), {k: refused[k] for k in set(refused) - set(listed)}
    for key, rule in listed.items():
        kind, detail = outcomes[key]
        # Listed as inert: changing it is refused, or no other value is valid here anyway.
        assert (kind, detail) == ("inert", rule) or kind == "single", (r.name, key, kind, detail)


def test_every_schema_key_has_candidates() -> None:
    assert set(CANDIDATES) == set(KEYS)
    assert set(LATER_KEYS) <= set(KEYS)


@pytest.mark.parametrize("key", sorted(LATER_KEYS))
def test_later_keys_cite_a_test_that_uses_them(key: str) -> None:
    """Each listed test exists, and its module sets or reads the key (its last part, or what
    the entry names; an entry that proves the property a value promises names nothing)."""
    effect = LATER_KEYS[key]
    file, func = effect.test.split("::")
    source = (repo_root() / file).read_text()
    funcs = {f.name for f in ast.walk(ast.parse(source)) if isinstance(f, ast.FunctionDef)}
    assert func in funcs, effect.test
    mention = key.rsplit(".", 1)[1] if effect.mentions is None else effect.mentions
    assert mention in source, (key, effect.test, mention)


def test_fingerprint_is_deterministic() -> None:
    """Two fingerprints of the same config are equal (so a difference means an effect)."""
    r = recipe(repo_root() / "recipes" / "moe_mxfp8_cpu.yaml")
    a, b = r.fingerprint(r.cfg), r.fingerprint(copy.deepcopy(r.cfg))
    assert a.first_difference(b) is None
    assert a.get("steps") == b.get("steps")
