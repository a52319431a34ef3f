"""Every MUON-* rule end to end through ``lptrain validate-config`` (in-process CliRunner):
the trigger reports exactly that rule with its exit status, and a near neighbour is clean."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lptrain.cli import app
from lptrain.config.rules import all_rules

runner = CliRunner(env={"COLUMNS": "400"})

MUON = "optimizer.name=muon"
DISTOPT = "ddp.use_distributed_optimizer=true"
E4M3 = "precision.fp8_format=e4m3"
FP8PG = "precision.fp8_param_gather=true"
MXFP8_PG = [E4M3, "precision.fp8_recipe=mxfp8", FP8PG, "ddp.reuse_grad_buf_for_mxfp8_param_ag=true"]
GROUPED = ["model.moe.num_experts=4", "model.moe.grouped_gemm=true"]

# (rule, trigger args, keys the report must name, neighbour args that validate clean)
CASES: list[tuple[str, list[str], set[str], list[str]]] = [
    ("MUON-LAYERWISE-ONE-INSTANCE", [MUON, DISTOPT, "ddp.num_distributed_optimizer_instances=2",
                                     "--dp", "2"],
     {"ddp.num_distributed_optimizer_instances"}, [MUON, DISTOPT, "--dp", "2"]),
    ("MUON-COMPACT-NO-FP4PG",
     [MUON, DISTOPT, "precision.fp4_format=e2m1", "precision.fp4_param_gather=true"],
     {"precision.fp4_param_gather"}, [MUON, DISTOPT, "precision.fp4_format=e2m1"]),
    ("MUON-COMPACT-FP8PG-RECIPE", [MUON, DISTOPT, E4M3, "precision.fp8_recipe=tensorwise", FP8PG],
     {"precision.fp8_recipe"}, [MUON, DISTOPT, E4M3, "precision.fp8_recipe=blockwise", FP8PG]),
    ("MUON-PADDED-NO-PG",
     [MUON, DISTOPT, "optimizer.layer_wise_param_layout=padded", E4M3,
      "precision.fp8_recipe=blockwise", FP8PG],
     {"optimizer.layer_wise_param_layout", "precision.fp8_param_gather"},
     [MUON, DISTOPT, "optimizer.layer_wise_param_layout=padded", E4M3,
      "precision.fp8_recipe=blockwise"]),
    ("MUON-COMPACT-NO-MODEL-SPACE",
     [MUON, DISTOPT, "checkpoint.sharding_type=fully_sharded_model_space"],
     {"checkpoint.sharding_type"}, [MUON, DISTOPT, "checkpoint.sharding_type=fully_reshardable"]),
    ("MUON-GROUPED-FP8PG", [MUON, DISTOPT, *MXFP8_PG, *GROUPED,
                            "model.moe.single_grouped_weight=true"],
     {"model.moe.single_grouped_weight"}, [MUON, DISTOPT, *MXFP8_PG, *GROUPED]),
    ("MUON-HPARAMS", [MUON, "optimizer.muon.momentum=1.0"], {"optimizer.muon.momentum"},
     [MUON, "optimizer.muon.momentum=0.9"]),
    # polar_express is accepted, with upstream's step rule (>= 8, last tuple repeated).
    ("MUON-HPARAMS", [MUON, "optimizer.muon.coefficients=polar_express"],
     {"optimizer.muon.ns_steps", "optimizer.muon.coefficients"},
     [MUON, "optimizer.muon.coefficients=polar_express", "optimizer.muon.ns_steps=8"]),
    # quintic's 5 tuples run as whole cycles.
    ("MUON-HPARAMS", [MUON, "optimizer.muon.ns_steps=6"], {"optimizer.muon.ns_steps"},
     [MUON, "optimizer.muon.ns_steps=10"]),
    # Keller's lr with spectral scaling (the old shipped fragment); the same lr is right for
    # shape_scaling at this hidden size (64: RMS 1/8, step 2.5e-3).
    ("MUON-LR-SCALE", ["--recipe", "mxfp8_muon_cpu.yaml", "optimizer.lr=2e-2"],
     {"optimizer.lr", "optimizer.muon.scale_mode"},
     ["--recipe", "mxfp8_muon_cpu.yaml", "optimizer.lr=2e-2",
      "optimizer.muon.scale_mode=shape_scaling"]),
    # An AdamW lr with shape_scaling at hidden 4096: step 1.6e-5, too small.
    ("MUON-LR-SCALE", [MUON, "optimizer.lr=1e-3", "optimizer.min_lr=1e-4",
                       "optimizer.muon.scale_mode=shape_scaling", "model.hidden_size=4096",
                       "model.ffn_hidden_size=16384", "model.num_attention_heads=32",
                       "model.num_query_groups=8"],
     {"optimizer.lr"}, [MUON, "optimizer.lr=1e-3", "optimizer.min_lr=1e-4",
                        "model.hidden_size=4096", "model.ffn_hidden_size=16384",
                        "model.num_attention_heads=32", "model.num_query_groups=8"]),
]


def _validate(args: list[str]) -> tuple[int, dict]:
    r = runner.invoke(app, ["validate-config", "--target", "cpu", "--json", *args])
    return r.exit_code, json.loads(r.stdout)


@pytest.mark.parametrize(("rule", "trigger", "keys", "neighbour"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rule_through_validate_config(
    rule: str, trigger: list[str], keys: set[str], neighbour: list[str]
) -> None:
    severity = next(r.severity for r in all_rules() if r.id == rule)
    code, report = _validate(trigger)
    assert [v["rule"] for v in report["violations"]] == [rule], report
    (v,) = report["violations"]
    assert v["severity"] == severity and keys <= set(v["keys"]), v
    assert v["message"] and v["fix"]
    # Errors fail validation (exit 1); a warning alone leaves the config valid (exit 0).
    assert code == (1 if severity == "error" else 0)
    assert report["valid"] is (severity != "error")
    code, report = _validate(neighbour)
    assert (code, report) == (0, {"valid": True, "violations": []})


def test_lr_scale_warning_states_bound_and_fix() -> None:
    _, report = _validate(["--recipe", "mxfp8_muon_cpu.yaml", "optimizer.lr=2e-2"])
    (v,) = report["violations"]
    assert "lr * update RMS = 0.02" in v["message"] and "8e-05..0.002" in v["message"]
    assert "10.0x above" in v["message"] and "AdamW-managed" in v["message"]
    assert "set optimizer.lr within 8e-05..0.002" in v["fix"]


def test_layer_wise_derived_rule_applied() -> None:
    """MUON-LAYERWISE is derived: never reported, applied by derive (show-config shows it)."""
    code, report = _validate([MUON, DISTOPT])
    assert (code, report["violations"]) == (0, [])
    r = runner.invoke(app, ["show-config", MUON, DISTOPT])
    assert r.exit_code == 0 and "use_layer_wise_optimizer: true" in r.stdout
    r = runner.invoke(app, ["show-config", MUON])
    assert "use_layer_wise_optimizer: false" in r.stdout


def test_shipped_muon_recipes_validate_clean() -> None:
    for recipe, target in (("mxfp8_muon.yaml", "sm100"), ("mxfp8_muon_cpu.yaml", "cpu")):
        r = runner.invoke(app, ["validate-config", "--recipe", recipe, "--target", target,
                                "--json"])
        assert (r.exit_code, json.loads(r.stdout)["violations"]) == (0, []), recipe


def test_every_muon_rule_has_an_end_to_end_case() -> None:
    muon_rules = {r.id for r in all_rules() if r.id.startswith("MUON-")}
    derived = {r.id for r in all_rules() if r.severity == "derived"}
    assert muon_rules - derived == {c[0] for c in CASES}
    assert muon_rules & derived == {"MUON-LAYERWISE"}  # covered by the derived-rule test
