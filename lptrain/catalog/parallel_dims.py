"""Parallel dimensions and the rank arithmetic of every process group (torch-free).

One place computes which global ranks form each group, for the rules (``validate-config``
judges the world as TP x CP x DP x PP), the engine's process groups
(:func:`lptrain.distributed.groups.build_groups`), the model's tensor-parallel shards, the
memory planner and the checkpoint code. Nothing else does rank arithmetic.

**Dense rank order** (Megatron-LM's default ``tp-cp-dp-pp``): tensor parallelism innermost,
then context parallelism, then data parallelism, then pipeline parallelism outermost::

    rank = tp + TP * (cp + CP * (dp + DP * pp))

so a tensor-parallel group is ``TP`` consecutive ranks (one node's NVLink domain when
``TP <= GPUs per node``), and the ``DP`` ranks holding the same shard are ``TP * CP`` apart.

**Expert rank order** (Megatron's expert rank generator ``etp-ep-edp-pp``): the same ranks
re-read for the MoE layers, with expert tensor parallelism (``ETP``, 1 here) innermost, then
expert parallelism, then expert data parallelism (``EDP = world / (ETP * EP * PP)``)::

    rank = etp + ETP * (ep + EP * (edp + EDP * pp))

With ``ETP = 1`` an expert-parallel group is ``EP`` consecutive ranks and the expert-data-
parallel group (ranks holding the same experts) spans the tensor-parallel ranks too: the
experts are replicated over TP and each TP rank routes its own sequence shard's tokens, so
their gradients sum over TP x DP (:mod:`lptrain.model.tensor_parallel`).

Pipeline parallelism is outermost: a pipeline stage is the ``TP x CP x DP`` consecutive ranks
of one pipeline rank, and every other group lies inside one stage (the split of the layers
over stages is :mod:`lptrain.catalog.pipeline`'s).

**Context parallelism** (CP) splits every sequence over the ``CP`` ranks of a context-parallel
group (``TP`` apart: they hold the same tensor-parallel shard). For causal load balancing the
sequence is cut into ``2 x CP`` equal chunks and CP rank ``i`` holds chunks ``i`` and
``2 x CP - 1 - i`` (:func:`cp_chunk_ids`; Megatron-LM's layout): every rank then attends to the
same number of (query, key) pairs. CP does not shard weights: the gradients of every parameter
are reduced over data x context parallel (:data:`GRAD_REDUCTION_DIMS`, Megatron's
data-and-context-parallel group), and delayed-scaling amaxes over tensor x context x data
parallel (:data:`AMAX_REDUCTION_DIMS`, Megatron's amax-reduction group). Hierarchical CP
(``a2a+p2p``) reads each CP group as ``[a2a size, p2p size]``: all-to-all among ``a``
consecutive CP ranks, a ring over the ``p`` ranks ``a`` apart (:meth:`ParallelDims.cp_levels`).
The expert layers fold CP into expert data parallelism (``EDP = world / (ETP x EP x PP)``), as
Megatron's expert rank generator does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

DENSE_ORDER: tuple[str, ...] = ("tp", "cp", "dp", "pp")  # innermost first
EXPERT_ORDER: tuple[str, ...] = ("etp", "ep", "edp", "pp")
# Dense gradients are reduced over these dimensions (Megatron's data-and-context-parallel
# group: each CP rank's gradient is its tokens' part of the sequence's gradient).
GRAD_REDUCTION_DIMS: tuple[str, ...] = ("cp", "dp")
# Delayed-scaling amaxes are MAX-reduced over these (one pipeline stage: Megatron's
# amax-reduction group, context parallelism included).
AMAX_REDUCTION_DIMS: tuple[str, ...] = ("tp", "cp", "dp")


class ParallelSizeError(ValueError):
    """The sizes do not tile the world (the message names the sizes and the world)."""


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of every parallel dimension of one run, and its rank arithmetic.

    ``tp``: tensor-model-parallel size; ``sequence_parallel``: activations outside the
    tensor-parallel GEMMs are split along the sequence over the ``tp`` ranks; ``cp``: context
    parallel size (each sequence split over that many ranks); ``pp``: pipeline-parallel size;
    ``dp``: data-parallel size; ``ep``: expert-model-parallel size; ``etp``: expert
    tensor-parallel size (1: the experts are not split over TP).
    """

    tp: int = 1
    dp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "cp", "pp", "ep", "etp"):
            if getattr(self, name) < 1:
                raise ParallelSizeError(f"{name}={getattr(self, name)} must be >= 1")
        if self.world_size % (self.etp * self.ep * self.pp):
            raise ParallelSizeError(
                f"expert_tensor_parallel x expert_model_parallel x pipeline = "
                f"{self.etp} x {self.ep} x {self.pp} must divide the world size {self.world_size}"
            )

    # ---- sizes --------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model between them (TP x PP)."""
        return self.tp * self.pp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: ranks holding the same experts."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @classmethod
    def from_world(cls, world_size: int, *, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1,
                   etp: int = 1, sequence_parallel: bool = False) -> ParallelDims:
        """The dims of a launch of ``world_size`` ranks: ``dp = world / (tp * cp * pp)``.
        Raises :class:`ParallelSizeError` when the model-parallel sizes do not divide it."""
        mp = tp * cp * pp
        if mp < 1 or world_size % mp:
            raise ParallelSizeError(
                f"tensor x context x pipeline parallel = {tp} x {cp} x {pp} = {mp} must divide "
                f"the world size {world_size}"
            )
        return cls(tp=tp, dp=world_size // mp, cp=cp, pp=pp, ep=ep, etp=etp,
                   sequence_parallel=sequence_parallel)

    def layout(self) -> dict[str, int]:
        """Every size by name, the world's too: what a run's banner and ``summary.json`` show."""
        return {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp, "ep": self.ep,
                "etp": self.etp, "world_size": self.world_size}

    def describe(self) -> str:
        """``TP 2 (SP) x CP 1 x PP 2 x DP 1 = 4 ranks, EP 1``: how the ranks are split."""
        sp = " (SP)" if self.sequence_parallel else ""
        return (f"TP {self.tp}{sp} x CP {self.cp} x PP {self.pp} x DP {self.dp} = "
                f"{self.world_size} rank(s), EP {self.ep}")

    # ---- dense coordinates ----------------------------------------------------------------

    def _sizes(self, order: tuple[str, ...]) -> dict[str, int]:
        return {d: getattr(self, d) for d in order}

    def coords(self, rank: int, order: tuple[str, ...] = DENSE_ORDER) -> dict[str, int]:
        """``rank``'s index along every dimension of ``order`` (dense by default)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} not in [0, {self.world_size})")
        out: dict[str, int] = {}
        rest = rank
        for d, size in self._sizes(order).items():
            out[d] = rest % size
            rest //= size
        return out

    def rank_of(self, order: tuple[str, ...] = DENSE_ORDER, **index: int) -> int:
        """The global rank at ``index`` (missing dimensions are 0)."""
        rank, stride = 0, 1
        for d, size in self._sizes(order).items():
            i = index.get(d, 0)
            if not 0 <= i < size:
                raise ValueError(f"{d} index {i} not in [0, {size})")
            rank += i * stride
            stride *= size
        return rank

    def group_ranks(self, *dims: str, order: tuple[str, ...] = DENSE_ORDER) -> list[list[int]]:
        """The partition of the world into the groups that vary along ``dims`` (and hold every
        other index fixed): one sorted rank list per group, groups in order of their first
        rank. ``group_ranks("tp")`` are the tensor-parallel groups, ``group_ranks("tp", "dp")``
        the groups spanning both, ``group_ranks("ep", order=EXPERT_ORDER)`` the expert-parallel
        groups."""
        unknown = [d for d in dims if d not in order]
        if unknown:
            raise ValueError(f"unknown dimension(s) {unknown}; {order} are the dimensions")
        sizes = self._sizes(order)
        fixed = [d for d in order if d not in dims]
        groups: list[list[int]] = []
        for f in range(math.prod(sizes[d] for d in fixed)):
            at: dict[str, int] = {}
            for d in fixed:
                at[d] = f % sizes[d]
                f //= sizes[d]
            members = []
            for v in range(math.prod(sizes[d] for d in dims)):
                idx = dict(at)
                for d in dims:
                    idx[d] = v % sizes[d]
                    v //= sizes[d]
                members.append(self.rank_of(order, **idx))
            groups.append(sorted(members))
        return sorted(groups, key=lambda g: g[0])

    def group_of(self, rank: int, *dims: str, order: tuple[str, ...] = DENSE_ORDER) -> list[int]:
        """The group of ``rank`` in :meth:`group_ranks` ``(*dims)``."""
        for g in self.group_ranks(*dims, order=order):
            if rank in g:
                return g
        raise ValueError(f"rank {rank} not in the world of {self.world_size}")

    # ---- context parallelism ---------------------------------------------------------------

    def cp_levels(self, sizes: Optional[Sequence[int]]) -> tuple[list[list[int]], list[list[int]]]:
        """``(a2a groups, p2p groups)`` of hierarchical context parallelism with
        ``sizes = [a, p]`` (``a x p = CP``): inside each context-parallel group, the ``a2a``
        groups are ``a`` consecutive CP indices and the ``p2p`` groups the ``p`` CP indices
        ``a`` apart (Megatron-LM's hierarchical CP groups, first level innermost). Global rank
        lists, sorted by first rank."""
        if not sizes or len(sizes) != 2 or sizes[0] * sizes[1] != self.cp or min(sizes) < 1:
            raise ParallelSizeError(f"hierarchical context-parallel sizes {list(sizes or [])} must be "
                                    f"two sizes whose product is the context-parallel size {self.cp}")
        a, p = sizes
        inner: list[list[int]] = []
        outer: list[list[int]] = []
        for g in self.group_ranks("cp"):  # rank lists in CP order
            inner += [g[o * a:(o + 1) * a] for o in range(p)]
            outer += [g[m::a] for m in range(a)]
        return sorted(inner, key=lambda g: g[0]), sorted(outer, key=lambda g: g[0])

    # ---- optimizer instances (partial sharding) ---------------------------------------------

    def instance_groups(self, instances: int, *, expert: bool = False) -> tuple[list[list[int]], list[list[int]]]:
        """``(intra, inter)`` partitions for ``ddp.num_distributed_optimizer_instances``: an
        instance is a block of ``D / instances`` consecutive indices of the gradient-reduction
        group (``D`` = CP x DP, :data:`GRAD_REDUCTION_DIMS`, or edp for ``expert``) -- a block
        of consecutive ranks holding whole tensor-parallel and expert-parallel groups;
        ``intra`` = the ranks of one instance (buckets are reduce-scattered there), ``inter`` =
        the ranks holding the same shard in different instances (the shard is all-reduced
        there)."""
        order, dims = (EXPERT_ORDER, ("edp",)) if expert else (DENSE_ORDER, GRAD_REDUCTION_DIMS)
        size = math.prod(getattr(self, d) for d in dims)
        if instances < 1 or size % instances:
            what = "expert-data-parallel" if expert else (
                "data x context parallel" if self.cp > 1 else "data-parallel")
            raise ParallelSizeError(f"{instances} optimizer instance(s) must divide the {what} size {size}")
        per = size // instances
        intra: list[list[int]] = []
        inter: list[list[int]] = []
        for g in self.group_ranks(*dims, order=order):  # ranks by (cp, dp) index inside one group
            intra += [g[i * per:(i + 1) * per] for i in range(instances)]
            inter += [g[j::per] for j in range(per)]
        return sorted(intra, key=lambda g: g[0]), sorted(inter, key=lambda g: g[0])


# ---- tensor-parallel shard arithmetic ---------------------------------------------------------


@dataclass(frozen=True)
class ShardLayout:
    """Where one rank's tensor-parallel shard sits in the whole tensor: dimension ``dim`` is
    split, as ``chunks`` equal parts each cut into TP contiguous pieces, rank ``t`` holding
    piece ``t`` of every part in part order. ``chunks`` is 1 for a plain split (QKV by whole
    query groups, proj/fc2 by columns, embedding/head by vocab rows) and 2 for SwiGLU's fc1
    ``[gate | up]``, whose shard is ``[gate_t | up_t]`` so the gated activation stays local
    (Megatron-LM's GLU layout)."""

    dim: int
    chunks: int = 1

    def segments(self, n: int, size: int, rank: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` ranges of the whole dimension (size ``n``) that ``rank`` of ``size``
        holds, in the order its shard stores them."""
        if n % (self.chunks * size):
            raise ParallelSizeError(f"{n} does not split into {self.chunks} x {size} equal parts")
        part = n // self.chunks
        lo, hi = shard_bounds(part, size, rank)
        return [(c * part + lo, c * part + hi) for c in range(self.chunks)]


def shard_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[lo, hi)`` of the ``index``-th of ``parts`` equal contiguous slices of ``n``
    (``n % parts == 0``: the rules refuse an uneven split before anything is built)."""
    if parts < 1 or n % parts:
        raise ParallelSizeError(f"{n} does not split into {parts} equal parts")
    if not 0 <= index < parts:
        raise ValueError(f"shard {index} not in [0, {parts})")
    per = n // parts
    return index * per, (index + 1) * per


def cp_chunk_ids(cp: int, cp_rank: int) -> tuple[int, ...]:
    """The chunks of ``2 x cp`` equal chunks of a sequence that context-parallel rank
    ``cp_rank`` holds, in the order it stores them: ``(i, 2 cp - 1 - i)`` (causal load
    balancing: an early chunk, which attends to few keys, with a late one); ``(0,)`` at CP 1."""
    if cp < 1 or not 0 <= cp_rank < cp:
        raise ValueError(f"context-parallel rank {cp_rank} not in [0, {cp})")
    if cp == 1:
        return (0,)
    return (cp_rank, 2 * cp - 1 - cp_rank)


def cp_token_ranges(seq_length: int, cp: int, cp_rank: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` token ranges of one sequence that ``cp_rank`` holds (:func:`cp_chunk_ids`
    of ``seq_length / (2 cp)`` tokens each; the whole sequence at CP 1)."""
    ids = cp_chunk_ids(cp, cp_rank)
    parts = 2 * cp if cp > 1 else 1
    if seq_length % parts:
        raise ParallelSizeError(f"seq_length {seq_length} does not split into {parts} equal chunks")
    c = seq_length // parts
    return [(i * c, (i + 1) * c) for i in ids]


def padded_vocab_size(vocab: int, divisible_by: int, tp: int = 1) -> int:
    """Embedding/output rows: ``vocab`` rounded up to a multiple of ``divisible_by * tp``
    (Megatron-LM's padding, so every tensor-parallel rank holds the same number of rows)."""
    m = max(1, divisible_by) * max(1, tp)
    return (vocab + m - 1) // m * m


def world_dims(tp: int, dp: Optional[int], world_size: Optional[int], **sizes: int) -> ParallelDims:
    """The dims for a world known by its data-parallel size (``--dp N``: world = TP x CP x PP
    x N) or by its total rank count (``$WORLD_SIZE``, ``--nproc-per-node``: dp = world /
    (TP x CP x PP)); with
    both unknown, one data-parallel rank. A world that TP does not divide raises
    :class:`ParallelSizeError`."""
    if world_size is not None:
        return ParallelDims.from_world(world_size, tp=tp, **sizes)
    return ParallelDims(tp=tp, dp=dp or 1, **sizes)
