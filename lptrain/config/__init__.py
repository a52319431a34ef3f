"""Configuration: typed schema, recipe composition, derived values and the rule checker.

The pipeline is ``compose`` (recipe YAML + overrides -> :class:`LPTrainConfig`) ->
``derive`` (fill derived values) -> ``check`` (every rule violation). Importing this
package does not import torch.
"""

from lptrain.config.check import check, has_errors
from lptrain.config.compose import Composed, RecipeMeta, compose, load, resolve_recipe, to_yaml
from lptrain.config.derive import derive
from lptrain.config.errors import ConfigError
from lptrain.config.rules import Rule, Violation, all_rules
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World

__all__ = [
    "Composed",
    "ConfigError",
    "LPTrainConfig",
    "RecipeMeta",
    "Rule",
    "Violation",
    "World",
    "all_rules",
    "check",
    "compose",
    "derive",
    "has_errors",
    "load",
    "resolve_recipe",
    "to_yaml",
]
