"""Every choice key refuses a value outside its declared set, by an error naming the key.

The schema declares each choice key's values once (``lptrain.config.schema.choice``); the
value-set rules are written per section. Without this check a choice key added later (as
``ddp.data_parallel_sharding_strategy`` and ``model.recompute_*`` were) could take any
string, and the code reading it would silently fall back to one of its branches.
"""

from __future__ import annotations

import pytest

from lptrain.config import World
from lptrain.config.check import check
from lptrain.config.compose import load
from lptrain.config.schema import choice_keys

# Keys whose value only matters next to another: set that one too, so the unknown value is
# judged by the value-set rule rather than by the rule saying the key has no effect.
CONTEXT = {"model.recompute_method": ["model.recompute_granularity=full"]}


@pytest.mark.parametrize("key", sorted(choice_keys()))
def test_unknown_choice_value_is_an_error_naming_the_key(key: str) -> None:
    composed = load("tiny_cpu.yaml", [*CONTEXT.get(key, []), f"{key}=not_a_choice"])
    errors = [v for v in check(composed.cfg, World.detect()) if v.severity == "error"]
    assert any(key in v.keys for v in errors), f"{key}=not_a_choice accepted: {errors}"
