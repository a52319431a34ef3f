"""Turning a feature off must not be refused for the feature's own keys (issue 43, the inert-key
case). A key made inert by a switch set in a *later* layer (a command-line override over the
recipe, a recipe over its fragments) is a warning naming both layers; a key set in the same
layer as the switch that disables it, or after it, stays an error."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from lptrain.cli import app
from lptrain.config import World, check, load
from lptrain.config.layers import check_composed, set_in

SM100_DP8 = World(dp=8, target="sm100", te_version="2.19", cuda=True, cuda_version="13.3")
# The issue's command: the bf16 baseline of an FP8 recipe, as Megatron accepts it.
BASELINE = ["precision.fp8_format=null", "precision.fp8_param_gather=false",
            "ddp.reuse_grad_buf_for_mxfp8_param_ag=false"]


def _by_rule(violations: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for v in violations:
        out.setdefault(v.rule, []).append(v)
    return out


def test_override_that_turns_fp8_off_leaves_a_warning() -> None:
    composed = load("moe_mxfp8.yaml", BASELINE)
    (v,) = _by_rule(check_composed(composed, SM100_DP8))["INERT-FP8-RECIPE"]
    assert v.severity == "warning" and v.keys == ("precision.fp8_recipe",)
    assert "precision.fp8_recipe=mxfp8 (from " in v.message and "mxfp8.yaml)" in v.message
    assert "turned off by a later layer (command-line override)" in v.message
    assert not [x for x in check_composed(composed, SM100_DP8) if x.severity == "error"]
    # the catalog's own verdict, without the layers, is still the error (what the test of
    # every rule and the key-effects test see)
    (plain,) = _by_rule(check(composed.cfg, SM100_DP8))["INERT-FP8-RECIPE"]
    assert plain.severity == "error"


def test_validate_config_accepts_the_issues_command() -> None:
    """The regression through the CLI: exit 1 (INERT-FP8-RECIPE) before, valid now."""
    r = CliRunner().invoke(app, ["validate-config", "--recipe", "moe_mxfp8.yaml", "--dp", "8",
                                 "--target", "sm100", "--json", *BASELINE])
    assert r.exit_code == 0, r.output
    assert '"rule": "INERT-FP8-RECIPE"' in r.stdout and '"severity": "warning"' in r.stdout


@pytest.mark.parametrize("overrides", [
    [*BASELINE, "precision.fp8_recipe=blockwise"],  # set in the same layer as the switch
    ["precision.fp8_format=null", "precision.fp8_recipe=mxfp8"],  # idem, on a bf16 recipe
])
def test_key_set_with_its_switch_stays_an_error(overrides: list[str]) -> None:
    recipe = "moe_mxfp8.yaml" if overrides[0] == BASELINE[0] else "bf16_adamw.yaml"
    found = _by_rule(check_composed(load(recipe, overrides), SM100_DP8))
    (v,) = found["INERT-FP8-RECIPE"]
    assert v.severity == "error" and v.keys == ("precision.fp8_recipe",)


def _recipe(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return folder / name


def test_recipe_over_its_fragment(tmp_path: Path) -> None:
    """A recipe's own value over a fragment is a later layer too; a value next to the switch
    in the recipe is not."""
    later = _recipe(tmp_path / "recipes", "off.yaml",
                    "defaults:\n  - precision: mxfp8\nprecision:\n  fp8_format: null\n")
    (v,) = _by_rule(check_composed(load(str(later)), World()))["INERT-FP8-RECIPE"]
    assert v.severity == "warning" and f"({later})" in v.message
    same = _recipe(tmp_path / "recipes", "same.yaml",
                   "precision:\n  fp8_format: null\n  fp8_recipe: mxfp8\n")
    (v,) = _by_rule(check_composed(load(str(same)), World()))["INERT-FP8-RECIPE"]
    assert v.severity == "error"


def test_a_rule_with_two_keys_splits_by_layer(tmp_path: Path) -> None:
    """One gate, two keys: the one set before the switch warns, the one set with it errs."""
    recipe = _recipe(tmp_path / "recipes", "delayed.yaml",
                     "precision:\n  fp8_format: hybrid\n  fp8_recipe: delayed\n  fp8_margin: 2\n")
    composed = load(str(recipe), ["precision.fp8_recipe=tensorwise", "precision.fp8_amax_history_len=16"])
    found = _by_rule(check_composed(composed, World()))["INERT-DELAYED-SCALING"]
    assert {(v.severity, v.keys) for v in found} == {
        ("warning", ("precision.fp8_margin",)), ("error", ("precision.fp8_amax_history_len",))}


def test_set_in_names_the_last_layer() -> None:
    composed = load("moe_mxfp8.yaml", BASELINE)
    sources = composed.sources
    assert sources[set_in(composed, "precision.fp8_recipe")].endswith("precision/mxfp8.yaml")
    assert sources[set_in(composed, "precision.fp8_format")] == "command-line override"
    assert set_in(composed, "optimizer.muon.momentum") is None  # the schema default
