"""Every shipped recipe loads, resolves and validates for the target it declares."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lptrain.config import World, check, derive, load
from lptrain.config.compose import KNOWN_TARGETS, repo_root

RECIPES = sorted((repo_root() / "recipes").glob("*.yaml"))
CLUSTER = [p for p in RECIPES if not p.stem.endswith("_cpu")]
REQUIRED = {"tiny_cpu", "bf16_adamw", "fp8_delayed", "fp8_tensorwise", "fp8_blockwise",
            "mxfp8_adamw", "mxfp8_muon", "nvfp4_adamw", "moe_mxfp8"}


def test_required_recipes_present() -> None:
    assert {p.stem for p in RECIPES} >= REQUIRED


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_recipe_validates_for_declared_target(path: Path) -> None:
    composed = load(path)
    target = composed.meta.target
    assert target in KNOWN_TARGETS, f"{path.name} declares no meta.target"
    assert composed.meta.description
    # dp=1 (one node) and dp=8 for cluster recipes: both must be clean, except where expert
    # parallelism needs more ranks than that (checked below: refused with the reason).
    ep = composed.cfg.model.moe.expert_model_parallel_size if composed.cfg.model.moe.num_experts else 1
    for dp in (1, 8) if target != "cpu" else (1,):
        world = World.detect(dp=dp, target=target)
        found = check(composed.cfg, world)
        if dp % ep:
            assert [v.rule for v in found] == ["LAUNCH-EP-DIVIDES-WORLD"], [v.to_dict() for v in found]
            continue
        assert found == [], [v.to_dict() for v in found]
    cfg = derive(composed.cfg, World.detect(target=target))
    assert cfg.precision.backend == ("emulated" if target == "cpu" else "te")


@pytest.mark.parametrize("path", CLUSTER, ids=[p.name for p in CLUSTER])
def test_cluster_recipe_has_cpu_sibling_composed_from_it(path: Path) -> None:
    sibling = path.with_name(f"{path.stem}_cpu.yaml")
    assert sibling.is_file()
    raw = yaml.safe_load(sibling.read_text())
    assert {"recipe": path.stem} in raw["defaults"]
    cluster, cpu = load(path).cfg, load(sibling).cfg
    # Same precision/optimizer/DDP choices, tiny shapes, emulated backend.
    for key in ("fp8_format", "fp8_recipe", "fp4_format", "fp8_param_gather", "fp4_param_gather"):
        assert getattr(cpu.precision, key) == getattr(cluster.precision, key), key
    assert cpu.optimizer.name == cluster.optimizer.name
    assert cpu.ddp.use_distributed_optimizer == cluster.ddp.use_distributed_optimizer
    # (256: fp8_blockwise_cpu, whose 128-wide blocks must hold at a tensor-parallel split)
    assert cpu.model.hidden_size <= 256 and cpu.precision.backend == "emulated"
    assert cpu.model.moe.grouped_gemm == cluster.model.moe.grouped_gemm


def test_tiny_cpu_is_small_and_quantizable() -> None:
    cfg = load("tiny_cpu.yaml").cfg
    assert cfg.model.num_layers <= 2 and cfg.model.hidden_size <= 64 and cfg.train.train_iters <= 100
    assert cfg.data.source == "builtin:python-stdlib"
    for recipe in ("mxfp8", "blockwise", "delayed", "tensorwise"):
        found = check(load("tiny_cpu.yaml", ["precision.fp8_format=e4m3",
                                             f"precision.fp8_recipe={recipe}"]).cfg, World())
        assert found == [], recipe
    found = check(load("tiny_cpu.yaml", ["precision.fp4_format=e2m1"]).cfg, World())
    assert found == []


def test_cluster_moe_recipe_checked_at_one_rank_says_what_launch_would() -> None:
    """moe_mxfp8 has expert parallelism 8: a laptop check at --dp 1 reports the refusal a
    one-rank launch meets, with the world sizes that work."""
    composed = load("moe_mxfp8.yaml")
    (v,) = check(composed.cfg, World.detect(dp=1, target="sm100"))
    assert v.rule == "LAUNCH-EP-DIVIDES-WORLD" and "multiple of 8 ranks" in v.fix
    assert check(composed.cfg, World.detect(dp=16, target="sm100")) == []

