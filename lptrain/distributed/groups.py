"""Process groups of a data-parallel run, created in one place.

* ``dp``: every data-parallel rank (gradients of dense params are averaged over it).
* ``intra``: the ranks of one distributed-optimizer instance (``ddp.num_distributed_optimizer_
  instances`` splits ``dp`` into that many consecutive blocks); buckets are reduce-scattered
  and params all-gathered inside it.
* ``inter``: the ranks holding the same shard in different instances; the reduced shard is
  all-reduced over it.
* ``expert_dp``: ranks holding the same experts (equal to ``dp`` without expert parallelism).

Without an initialised ``torch.distributed`` world everything is a single-rank group
(``None``) and collectives are skipped, so world size 1 runs the same engine code.
"""

from __future__ import annotations

from dataclasses import dataclass
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
class ParallelGroups:
    rank: int
    world_size: int
    dp: Group
    intra: Group
    inter: Group
    expert_dp: Group

    @property
    def instances(self) -> int:
        return self.inter.size


def build_groups(num_instances: int = 1) -> ParallelGroups:
    """Create (collectively, on every rank) the groups described in the module doc."""
    if not (dist.is_available() and dist.is_initialized()):
        return ParallelGroups(0, 1, SINGLE, SINGLE, SINGLE, SINGLE)
    world, rank = dist.get_world_size(), dist.get_rank()
    if num_instances < 1 or world % num_instances:
        raise ValueError(
            f"ddp.num_distributed_optimizer_instances={num_instances} must divide the "
            f"data-parallel size {world}"
        )
    dp = Group(dist.group.WORLD, world, rank)
    if num_instances == 1:
        return ParallelGroups(rank, world, dp, dp, SINGLE, dp)
    per = world // num_instances
    intra = inter = SINGLE
    for i in range(num_instances):  # every rank must create every group, in the same order
        ranks = list(range(i * per, (i + 1) * per))
        pg = dist.new_group(ranks)
        if rank in ranks:
            intra = Group(pg, per, ranks.index(rank))
    for j in range(per):
        ranks = list(range(j, world, per))
        pg = dist.new_group(ranks)
        if rank in ranks:
            inter = Group(pg, num_instances, ranks.index(rank))
    return ParallelGroups(rank, world, dp, intra, inter, dp)
