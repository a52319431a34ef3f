"""Process groups of a data-parallel run, created in one place.

* ``dp``: every data-parallel rank (gradients of dense params are averaged over it).
* ``intra``: the ranks of one distributed-optimizer instance (``ddp.num_distributed_optimizer_
  instances`` splits ``dp`` into that many consecutive blocks); buckets are reduce-scattered
  and params all-gathered inside it.
* ``inter``: the ranks holding the same shard in different instances; the reduced shard is
  all-reduced over it.
* ``ep``: the expert-parallel group, ``model.moe.expert_model_parallel_size`` consecutive ranks
  that split the experts between them (the token dispatcher's all-to-all runs over it);
* ``expert_dp``: ranks holding the same experts (``world / EP`` ranks ``r % EP + j * EP``; equal
  to ``dp`` without expert parallelism); ``expert_intra`` / ``expert_inter`` split it by the
  optimizer instances exactly as ``intra`` / ``inter`` split ``dp`` (an instance, a block of
  ``world / instances`` consecutive ranks, must hold whole EP groups: ``EP * instances``
  divides the world).

The MoE layers get the EP group when the model is built
(``build_model(..., expert_parallel_group=groups.ep)``): a process group cannot travel
through a config, and the model never looks one up.

Without an initialised ``torch.distributed`` world everything is a single-rank group
(``None``) and collectives are skipped, so world size 1 runs the same engine code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist


@dataclass
class Group:
    """A process group with its size and this process's rank in it (``pg`` None = single rank)."""

    pg: Optional[Any]
    size: int
    rank: int

    @property
    def active(self) -> bool:
        return self.pg is not None and self.size > 1


SINGLE = Group(None, 1, 0)


@dataclass
class BufferGroups:
    """The groups one buffer reduces and gathers over: ``intra`` (reduce-scatter / all-reduce
    and param all-gather), ``inter`` (the shard all-reduce across optimizer instances), and
    ``dp_size``, the data-parallel size its gradients are averaged over (dense and expert
    grads are both scaled by 1/dp: the loss is a mean over every data-parallel rank)."""

    intra: Group
    inter: Group
    dp_size: int


@dataclass
class ParallelGroups:
    rank: int
    world_size: int
    dp: Group
    intra: Group
    inter: Group
    expert_dp: Group

    expert_intra: Optional[Group] = None  # None: the dense groups (no expert parallelism)
    expert_inter: Optional[Group] = None
    ep: Group = field(default_factory=lambda: SINGLE)  # expert-parallel group (different experts)

    @property
    def instances(self) -> int:
        return self.inter.size

    def for_buffer(self, is_expert: bool) -> BufferGroups:
        """Dense buffers reduce over the data-parallel groups, expert buffers over the
        expert-data-parallel ones (the ranks holding the same experts)."""
        if is_expert and self.expert_intra is not None:
            return BufferGroups(self.expert_intra, self.expert_inter or SINGLE, self.dp.size)
        return BufferGroups(self.intra, self.inter, self.dp.size)


def _check_sizes(world: int, num_instances: int, ep: int) -> None:
    from lptrain.config.errors import ConfigError

    if num_instances < 1 or world % num_instances:
        raise ConfigError(
            f"ddp.num_distributed_optimizer_instances={num_instances} must divide the "
            f"data-parallel size {world}",
            key="ddp.num_distributed_optimizer_instances",
            fix=f"set it to a divisor of {world}",
        )
    if ep < 1 or world % ep:
        raise ConfigError(
            f"model.moe.expert_model_parallel_size={ep} must divide the world size {world}",
            key="model.moe.expert_model_parallel_size",
            fix=f"set it to a divisor of {world} (rule LAUNCH-EP-DIVIDES-WORLD)",
        )
    if (world // num_instances) % ep:
        raise ConfigError(
            f"expert_model_parallel_size={ep} x num_distributed_optimizer_instances="
            f"{num_instances} must divide the world size {world}",
            key="model.moe.expert_model_parallel_size",
            fix="lower one of them (rule EP-INSTANCES-DIVIDE-WORLD)",
        )


def _new_groups(rank: int, all_ranks: list[list[int]]) -> Group:
    """Create every group of a partition (collectively, same order everywhere); this rank's."""
    mine = SINGLE
    for ranks in all_ranks:
        pg = dist.new_group(ranks)
        if rank in ranks:
            mine = Group(pg, len(ranks), ranks.index(rank))
    return mine


def build_groups(num_instances: int = 1, ep: int = 1) -> ParallelGroups:
    """Create (collectively, on every rank) the groups described in the module doc."""
    if not (dist.is_available() and dist.is_initialized()):
        _check_sizes(1, num_instances, ep)
        return ParallelGroups(0, 1, SINGLE, SINGLE, SINGLE, SINGLE)
    world, rank = dist.get_world_size(), dist.get_rank()
    _check_sizes(world, num_instances, ep)
    dp = Group(dist.group.WORLD, world, rank)
    per = world // num_instances
    if num_instances == 1:
        intra, inter = dp, SINGLE
    else:
        intra = _new_groups(rank, [list(range(i * per, (i + 1) * per)) for i in range(num_instances)])
        inter = _new_groups(rank, [list(range(j, world, per)) for j in range(per)])
    if ep == 1:
        return ParallelGroups(rank, world, dp, intra, inter, dp)
    ep_group = _new_groups(rank, [list(range(k, k + ep)) for k in range(0, world, ep)])
    expert_dp = _new_groups(rank, [list(range(e, world, ep)) for e in range(ep)])
    # Expert-dp ranks r % EP + j * EP, split by instance (block of `per` consecutive ranks).
    intra_sets = [list(range(i * per + e, (i + 1) * per, ep)) for i in range(num_instances) for e in range(ep)]
    expert_intra = _new_groups(rank, intra_sets) if num_instances > 1 else expert_dp
    expert_inter = SINGLE
    if num_instances > 1:
        inter_sets = [list(range(e + q * ep, world, per)) for e in range(ep) for q in range(per // ep)]
        expert_inter = _new_groups(rank, inter_sets)
    return ParallelGroups(
        rank, world, dp, intra, inter, expert_dp,
        expert_intra=expert_intra, expert_inter=expert_inter, ep=ep_group,
    )
