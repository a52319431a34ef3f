"""Expert-parallel rules: EP must tile the world and the optimizer instances.

``num_experts % expert_model_parallel_size`` is MOE-EP-DIVIDES (the MoE section). The rules
here need the world: the expert-parallel groups are ``EP`` consecutive ranks of a pipeline
stage (the whole world without pipeline parallelism; tensor-parallel ranks included: experts are whole on every TP rank, expert TP = 1), and
the expert-data-parallel group (ranks holding the same experts) has ``world / EP`` ranks
(:mod:`lptrain.catalog.parallel_dims`).

Every world is checked, a one-rank one included (``dp`` 1, what ``validate-config`` assumes
without ``--dp`` or ``$WORLD_SIZE``): a laptop check of a cluster recipe says what launching it
on that many ranks would say. Check a cluster recipe for the world it is written for
(``--dp 8`` for EP 8).
"""

from __future__ import annotations

from typing import Any

from lptrain.config.rules import Rule
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World

S = "Expert parallelism"


def _ep(c: LPTrainConfig) -> int:
    return c.model.moe.expert_model_parallel_size if c.model.moe.num_experts > 0 else 1


def stage_ranks(c: LPTrainConfig, w: World) -> int:
    """Ranks of one pipeline stage (the whole world without pipeline parallelism): the
    expert-parallel groups are consecutive ranks inside a stage."""
    pp = max(1, c.model.pipeline_model_parallel_size)
    return w.world_size // pp if w.world_size % pp == 0 else w.world_size


def _ep_does_not_divide_world(c: LPTrainConfig, w: World) -> Any:
    ep, n = _ep(c), stage_ranks(c, w)
    return {"n": n} if ep > 1 and n % ep != 0 else False


def _instances_split_ep_groups(c: LPTrainConfig, w: World) -> Any:
    ep, inst, n = _ep(c), c.ddp.num_distributed_optimizer_instances, stage_ranks(c, w)
    if ep <= 1 or inst <= 1 or n <= 1 or n % ep or (w.dp * max(1, c.model.context_parallel_size)) % inst:
        return False  # reported by LAUNCH-EP-DIVIDES-WORLD / DDP-INSTANCES-DIVIDE-DP
    per = n // inst
    return {"per": per} if per % ep else False


RULES = [
    Rule(
        id="LAUNCH-EP-DIVIDES-WORLD", severity="error",
        keys=("model.moe.expert_model_parallel_size",), when=_ep_does_not_divide_world,
        message="expert_model_parallel_size={cfg.model.moe.expert_model_parallel_size} must divide "
                "the {n} ranks of a pipeline stage (the world size {world.world_size} without "
                "pipeline parallelism): expert-parallel groups are that many consecutive ranks",
        fix="set model.moe.expert_model_parallel_size to a divisor of {n}, or run on "
            "(check with --dp) a multiple of {cfg.model.moe.expert_model_parallel_size} ranks per stage",
        condition="(world / pipeline_model_parallel_size) % expert_model_parallel_size == 0 (MoE; "
                  "every world size, 1 included)",
        why="every rank is in exactly one expert-parallel group (Megatron-LM's parallel_state "
            "refuses the same); judged at the world being validated, so --dp 1 reports what a "
            "one-rank launch would",
        section=S,
    ),
    Rule(
        id="EP-INSTANCES-DIVIDE-WORLD", severity="error",
        keys=("model.moe.expert_model_parallel_size", "ddp.num_distributed_optimizer_instances"),
        when=_instances_split_ep_groups,
        message="an optimizer instance ({per} consecutive ranks = a stage's ranks / "
                "num_distributed_optimizer_instances={cfg.ddp.num_distributed_optimizer_instances}) "
                "must hold whole expert-parallel groups of "
                "expert_model_parallel_size={cfg.model.moe.expert_model_parallel_size} ranks",
        fix="make expert_model_parallel_size x ddp.num_distributed_optimizer_instances divide "
            "the ranks of a pipeline stage: lower one of them",
        condition="(world / pipeline_model_parallel_size / num_distributed_optimizer_instances) % "
                  "expert_model_parallel_size == 0",
        why="the expert-data-parallel group is split by instance exactly as the data-parallel one",
        section=S,
    ),
]
