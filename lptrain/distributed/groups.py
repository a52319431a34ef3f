"""Process groups of a run, created in one place from :class:`ParallelDims`' rank lists.

Which ranks form each group is :mod:`lptrain.catalog.parallel_dims`' arithmetic (tensor
parallelism innermost, then data parallelism; the expert layers re-read the same ranks with
expert parallelism innermost); this module only creates the groups, collectively, and keeps
this rank's handle of each together with the dims (:class:`ParallelGroups`: the one object
the engine, the model's parallelize step, the optimizers and the checkpoint code read).

* ``tp``: the tensor-parallel group, ``TP`` consecutive ranks holding the shards of one model
  copy (the model's tensor-parallel collectives and the TP amax reductions run over it);
* ``dp``: the data-parallel ranks at this tensor- and context-parallel rank (they read
  different samples; the whole world without model parallelism);
* ``cp``: the context-parallel group, ``CP`` ranks ``TP`` apart that split each sequence
  (attention exchanges keys and values over it; ``cp_a2a`` / ``cp_p2p`` are its two levels
  under hierarchical CP); ``tp_cp``: tensor x context parallel, the ranks holding parts of the
  same sequences (per-token statistics and the amaxes of operands split both ways);
* ``dp_cp``: data x context parallel, Megatron's data-and-context-parallel group: gradients of
  dense params are reduced over it (summed over CP -- each CP rank's gradient is its tokens'
  part -- and averaged over DP); ``dp`` itself without context parallelism;
* ``tp_dp``: tensor x context x data parallel: the ranks of one pipeline stage (the whole world
  without pipeline parallelism). Per-step decisions every rank must take alike (a non-finite
  gradient, the loss) are exchanged over it, and over ``world`` under pipeline parallelism;
* ``amax``: the delayed-scaling amax-reduction group (:data:`AMAX_REDUCTION_DIMS`: tensor x
  context x data parallel, the stage, as Megatron-LM's amax-reduction group);
* ``pp``: the pipeline group, the ``PP`` stages of one model copy (the schedule's P2P runs
  over it; the gradient norm adds the stages' parts over it);
* ``embedding``: under pipeline parallelism with tied embeddings, the first stage of one
  pipeline and the one computing the loss (the lookup table and the head's copy of it: their
  gradients are summed over it, as Megatron-LM's embedding group; none when one stage holds
  both, as rank 0 of a V schedule);
* ``intra``: the ranks of one distributed-optimizer instance (``ddp.num_distributed_optimizer_
  instances`` splits ``dp_cp`` into that many consecutive blocks); buckets are reduce-scattered
  and params all-gathered inside it.
* ``inter``: the ranks holding the same shard in different instances; the reduced shard is
  all-reduced over it.
* ``ep``: the expert-parallel group, ``model.moe.expert_model_parallel_size`` consecutive ranks
  that split the experts between them (the token dispatcher's all-to-all runs over it);
* ``expert_dp``: ranks holding the same experts (``world / EP`` ranks ``r % EP + j * EP``; equal
  to ``dp`` without expert or tensor parallelism; it spans the tensor-parallel ranks, which
  hold the same experts and route different sequence shards); ``expert_intra`` /
  ``expert_inter`` split it by the optimizer instances exactly as ``intra`` / ``inter`` split
  ``dp`` (an instance, a block of ``world / instances`` consecutive ranks, must hold whole EP
  groups: ``EP * instances`` divides the world).

The MoE layers get the EP group when the model is built
(``build_model(..., expert_parallel_group=groups.ep)``): a process group cannot travel
through a config, and the model never looks one up.

Pipeline parallelism is outermost in the rank order, so every group above except ``pp``,
``embedding`` and ``world`` lies inside one stage.

Without an initialised ``torch.distributed`` world everything is a single-rank group
(``None``) and collectives are skipped, so world size 1 runs the same engine code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist

from lptrain.catalog import parallel_dims as _dims
from lptrain.catalog.parallel_dims import EXPERT_ORDER, GRAD_REDUCTION_DIMS, ParallelDims


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
    grads are both scaled by 1/dp: the loss is a mean over every data-parallel rank; the
    context-parallel ranks' gradients are parts of one replica's, summed by the reduction)."""

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
    tp: Group = field(default_factory=lambda: SINGLE)  # tensor-parallel group (shards of one copy)
    tp_dp: Optional[Group] = None  # None: dp (no tensor or context parallelism); TP x CP x DP
    dims: ParallelDims = field(default_factory=ParallelDims)
    pp: Group = field(default_factory=lambda: SINGLE)  # the pipeline stages of one model copy
    embedding: Group = field(default_factory=lambda: SINGLE)  # first + last stage (tied embeddings)
    world: Optional[Group] = None  # None: everyone (no pipeline parallelism)
    cp: Group = field(default_factory=lambda: SINGLE)  # context-parallel group (splits each sequence)
    cp_a2a: Group = field(default_factory=lambda: SINGLE)  # hierarchical CP: the a2a level
    cp_p2p: Group = field(default_factory=lambda: SINGLE)  # hierarchical CP: the ring level
    tp_cp: Group = field(default_factory=lambda: SINGLE)  # TP x CP: ranks of the same sequences
    dp_cp: Optional[Group] = None  # None: dp (no context parallelism)
    amax: Optional[Group] = None  # None: everyone (the amax-reduction group)

    @property
    def instances(self) -> int:
        return self.inter.size

    @property
    def everyone(self) -> Group:
        """The tensor x context x data parallel group: the ranks of this pipeline stage (``dp``
        without tensor or context parallelism; the whole world without pipeline parallelism)."""
        return self.tp_dp if self.tp_dp is not None else self.dp

    @property
    def grad_reduction(self) -> Group:
        """Data x context parallel: the ranks dense gradients are reduced over (``dp``
        without context parallelism)."""
        return self.dp_cp if self.dp_cp is not None else self.dp

    @property
    def amax_reduction(self) -> Group:
        """The delayed-scaling amax-reduction group (tensor x context x data parallel)."""
        return self.amax if self.amax is not None else self.everyone

    @property
    def token_shards(self) -> Group:
        """The ranks holding parts of the same sequences: tensor x context parallel under
        sequence parallelism, context parallel without it (single rank when neither splits
        the sequence)."""
        if self.dims.sequence_parallel and self.tp.size > 1:
            return self.tp_cp if self.cp.size > 1 else self.tp
        return self.cp

    @property
    def all_ranks(self) -> Group:
        """Every rank of the run (:attr:`everyone` without pipeline parallelism)."""
        return self.world if self.world is not None else self.everyone

    def for_buffer(self, is_expert: bool) -> BufferGroups:
        """Dense buffers reduce over the data x context parallel groups, expert buffers over
        the expert-data-parallel ones (the ranks holding the same experts); both average over
        the data-parallel size (the context-parallel parts are summed)."""
        if is_expert and self.expert_intra is not None:
            return BufferGroups(self.expert_intra, self.expert_inter or SINGLE, self.dp.size)
        return BufferGroups(self.intra, self.inter, self.dp.size)


def _check_sizes(world: int, num_instances: int, ep: int, tp: int = 1, pp: int = 1,
                 cp: int = 1) -> ParallelDims:
    """The dims of this world; a :class:`ConfigError` naming the key when the sizes do not
    tile it (the rules report the same before a run starts)."""
    from lptrain.config.errors import ConfigError

    if tp < 1 or world % tp:
        raise ConfigError(
            f"model.tensor_model_parallel_size={tp} must divide the world size {world}",
            key="model.tensor_model_parallel_size",
            fix=f"set it to a divisor of {world} (rule LAUNCH-TP-DIVIDES-WORLD)",
        )
    if cp < 1 or world % (tp * cp):
        raise ConfigError(
            f"tensor x context parallel = {tp} x {cp} must divide the world size {world}",
            key="model.context_parallel_size",
            fix=f"launch a multiple of {tp * cp} ranks (rule LAUNCH-CP-DIVIDES-WORLD)",
        )
    if pp < 1 or world % (tp * cp * pp):
        raise ConfigError(
            f"tensor x context x pipeline parallel = {tp} x {cp} x {pp} must divide the world size {world}",
            key="model.pipeline_model_parallel_size",
            fix=f"launch a multiple of {tp * cp * pp} ranks (rule LAUNCH-PP-DIVIDES-WORLD)",
        )
    stage = world // pp
    dp = stage // (tp * cp)
    if num_instances < 1 or (dp * cp) % num_instances:
        what = "data x context parallel" if cp > 1 else "data-parallel"
        raise ConfigError(
            f"ddp.num_distributed_optimizer_instances={num_instances} must divide the "
            f"{what} size {dp * cp}",
            key="ddp.num_distributed_optimizer_instances",
            fix=f"set it to a divisor of {dp * cp}",
        )
    if ep < 1 or stage % ep:
        raise ConfigError(
            f"model.moe.expert_model_parallel_size={ep} must divide the {stage} ranks of a stage",
            key="model.moe.expert_model_parallel_size",
            fix=f"set it to a divisor of {stage} (rule LAUNCH-EP-DIVIDES-WORLD)",
        )
    if (stage // num_instances) % ep:
        raise ConfigError(
            f"expert_model_parallel_size={ep} x num_distributed_optimizer_instances="
            f"{num_instances} must divide the {stage} ranks of a stage",
            key="model.moe.expert_model_parallel_size",
            fix="lower one of them (rule EP-INSTANCES-DIVIDE-WORLD)",
        )
    return ParallelDims.from_world(world, tp=tp, cp=cp, pp=pp, ep=ep)  # (the checks above cover its refusals)


def _new_groups(rank: int, all_ranks: list[list[int]], own: bool = False) -> Group:
    """Create every group of a partition (collectively, same order everywhere); this rank's.
    A partition into one group of the whole world reuses the world group, unless ``own``
    (a group whose point-to-point traffic must not queue behind the world's collectives)."""
    if not own and len(all_ranks) == 1 and dist.is_initialized() and len(all_ranks[0]) == dist.get_world_size():
        return Group(dist.group.WORLD, len(all_ranks[0]), all_ranks[0].index(rank))
    mine = SINGLE
    for ranks in all_ranks:
        pg = dist.new_group(ranks)
        if rank in ranks:
            mine = Group(pg, len(ranks), ranks.index(rank))
    return mine


def build_groups(num_instances: int = 1, ep: int = 1, tp: int = 1,
                 sequence_parallel: bool = False, pp: int = 1,
                 tied_embeddings: bool = False, cp: int = 1,
                 hierarchical_cp: Optional[list[int]] = None, loss_stage: int = -1) -> ParallelGroups:
    """Create (collectively, on every rank) the groups described in the module doc.
    ``hierarchical_cp`` (``[a2a size, p2p size]``) also creates the two levels of each
    context-parallel group (``model.hierarchical_context_parallel_sizes``); ``loss_stage``:
    the pipeline rank holding the head, the last by default."""
    if not (dist.is_available() and dist.is_initialized()):
        dims = _check_sizes(1, num_instances, ep, tp, pp, cp)
        return ParallelGroups(0, 1, SINGLE, SINGLE, SINGLE, SINGLE, dims=dims)
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = _check_sizes(world, num_instances, ep, tp, pp, cp)
    dims = ParallelDims(tp=dims.tp, dp=dims.dp, cp=dims.cp, pp=dims.pp, ep=dims.ep,
                        sequence_parallel=sequence_parallel)
    tp_group = _new_groups(rank, dims.group_ranks("tp")) if tp > 1 else SINGLE
    dp = _new_groups(rank, dims.group_ranks("dp"))
    stage_dims = ("tp", "cp", "dp")
    split = [d for d in ("tp", "cp") if getattr(dims, d) > 1]
    tp_dp = _new_groups(rank, dims.group_ranks(*stage_dims)) if split else None
    extra: dict[str, Any] = {}
    if cp > 1:
        # (its own communicator: the ring's sends run while the gradient buckets' reductions
        # are in flight on the data-parallel groups, which may be the world's)
        extra["cp"] = _new_groups(rank, dims.group_ranks("cp"), own=True)
        extra["dp_cp"] = _new_groups(rank, dims.group_ranks(*GRAD_REDUCTION_DIMS))
        extra["tp_cp"] = _new_groups(rank, dims.group_ranks("tp", "cp")) if tp > 1 else extra["cp"]
        if hierarchical_cp:
            inner, outer = dims.cp_levels(hierarchical_cp)
            extra["cp_a2a"] = _new_groups(rank, inner)
            extra["cp_p2p"] = _new_groups(rank, outer, own=True)
    # (read at call time: a regression test narrows it to show what the CP part is for)
    amax_dims = tuple(_dims.AMAX_REDUCTION_DIMS)
    if set(amax_dims) != set(stage_dims):
        extra["amax"] = _new_groups(rank, dims.group_ranks(*amax_dims))
    pipeline: dict[str, Any] = {}
    if pp > 1:
        if tp_dp is None:
            tp_dp = dp
        pipeline["pp"] = _new_groups(rank, dims.group_ranks("pp"))
        pipeline["world"] = Group(dist.group.WORLD, world, rank)
        if tied_embeddings and loss_stage % pp != 0:  # the first stage and the loss's
            pipeline["embedding"] = _new_groups(rank, [[g[0], g[loss_stage]] for g in dims.group_ranks("pp")])
    grad_group = extra.get("dp_cp", dp)
    if num_instances == 1:
        intra, inter = grad_group, SINGLE
    else:
        intra_sets, inter_sets = dims.instance_groups(num_instances)
        intra, inter = _new_groups(rank, intra_sets), _new_groups(rank, inter_sets)
    if ep == 1 and tp == 1 and cp == 1:
        return ParallelGroups(rank, world, dp, intra, inter, dp, tp_dp=tp_dp, dims=dims, **pipeline, **extra)
    ep_group = _new_groups(rank, dims.group_ranks("ep", order=EXPERT_ORDER)) if ep > 1 else SINGLE
    expert_dp = _new_groups(rank, dims.group_ranks("edp", order=EXPERT_ORDER))
    expert_intra, expert_inter = expert_dp, SINGLE
    if num_instances > 1:
        e_intra, e_inter = dims.instance_groups(num_instances, expert=True)
        expert_intra, expert_inter = _new_groups(rank, e_intra), _new_groups(rank, e_inter)
    return ParallelGroups(
        rank, world, dp, intra, inter, expert_dp,
        expert_intra=expert_intra, expert_inter=expert_inter, ep=ep_group,
        tp=tp_group, tp_dp=tp_dp, dims=dims, **pipeline, **extra,
    )
