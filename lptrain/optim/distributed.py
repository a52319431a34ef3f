"""Distributed optimizer (ZeRO-1): fp32 masters of this rank's shard of the param buffers.

:class:`ShardedMasterOptimizer` is one optimizer over a set of buffers that reduce over one
process group (the dense buffers, or the expert buffers). For each bucket it takes this
rank's shard (the whole bucket when the buffer is not sharded), cuts it at parameter
boundaries into *pieces*, and keeps one fp32 master per piece:

* a piece that covers a whole parameter keeps the parameter's shape and its optimizer tags
  (Muon needs whole matrices; the Muon buffers are never sharded);
* a piece of a parameter that straddles shards is a flat slice; AdamW is elementwise, so the
  result is the same as on the whole tensor.

Masters start from :func:`high_precision_value` (a quantized primary weight's kept
high-precision init value, then freed). Each step: ``prepare_grads`` points the masters'
``.grad`` at the reduced ``main_grad`` slices, the chained optimizer combines
``grad_norm_sq`` into one global norm, ``step`` clips and updates, and ``stage`` writes the
masters back: into the staging slice of the param buffer (sharded: the all-gather then
distributes it) or straight into the parameter (replicated: every rank holds the same
masters). Nothing here knows a quantization format: writing into a parameter goes through
:mod:`lptrain.precision.param_storage`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from lptrain.config.schema import OptimizerConfig
from lptrain.distributed.buffers import ParamAndGradBuffer
from lptrain.distributed.groups import SINGLE, Group
from lptrain.optim.child import MasterOptimizer
from lptrain.optim.exact_norm import world_square_sum
from lptrain.optim.fp64_scratch import fp64_copy
from lptrain.optim.lion import scalar_optimizer
from lptrain.optim.muon import Muon, build_muon
from lptrain.optim.param_groups import copy_param_attributes
from lptrain.optim.precision_aware import StatePrecision, fused_adam
from lptrain.optim.sharded_state import ShardedStateMixin
from lptrain.precision.collectives import all_gather_uneven
from lptrain.precision.param_storage import (
    StageEntry,
    StagePlan,
    high_precision_value,
    is_quantized,
    release_high_precision_init,
    write_values,
)


@dataclass
class MasterPiece:
    """Elements ``[lo, hi)`` of ``buffer`` = elements ``[p_lo, p_hi)`` of param ``name``."""

    name: str
    param: torch.nn.Parameter
    buffer: ParamAndGradBuffer
    lo: int
    hi: int
    p_lo: int
    p_hi: int
    master: torch.Tensor

    @property
    def whole(self) -> bool:
        return self.p_lo == 0 and self.p_hi == self.param.numel()

    def grad_view(self) -> torch.Tensor:
        return self.buffer.grad_slice(self.lo, self.hi).view(self.master.shape)


def norm_views(piece: MasterPiece, grad: torch.Tensor) -> list[torch.Tensor]:
    """The parts of ``piece``'s ``grad`` the grad norm is taken over, one per logical matrix.

    Why: a single grouped expert weight ``[E, out, in]`` is ``E`` matrices; its norm must be
    the one the same experts give as ``E`` discrete params (``model.moe.single_grouped_weight``
    changes the layout, never the numbers). One fp64 norm over the whole tensor is a
    different rounding from ``E`` norms squared and summed, so the piece is cut at its
    members' boundaries (a sharded piece keeps the cuts of the members it covers)."""
    members = getattr(piece.param, "num_grouped_members", None)
    if not members or members == 1:
        return [grad]
    size = piece.param.numel() // members
    flat = grad.reshape(-1)
    out, start = [], piece.p_lo
    while start < piece.p_hi:
        end = min(piece.p_hi, (start // size + 1) * size)
        out.append(flat[start - piece.p_lo : end - piece.p_lo])
        start = end
    return out


def param_location(buf: ParamAndGradBuffer, p: torch.nn.Parameter, lo: int, hi: int,
                   p_lo: int) -> torch.Tensor:
    """The param's own storage of buffer elements ``[lo, hi)`` (its elements from ``p_lo``):
    this rank's slice of a sharded param buffer (ZeRO-3: of the kept shard), or the
    parameter's data itself; shaped like ``p`` when it is all of it."""
    if is_quantized(p):
        raise RuntimeError(f"{p.__class__.__name__} param: TE holds masters of plain params only "
                           "(rule PAO-TE-MASTERS-QUANTIZED-PG)")
    loc = buf.param_slice(lo, hi) if buf.sharded else p.detach().view(-1)[p_lo : p_lo + hi - lo]
    return loc.view(p.shape) if hi - lo == p.numel() else loc


# (buffer, lo, hi, pieces, part sizes, the part of each piece): see ``_norm_spans``
_NormSpan = tuple[ParamAndGradBuffer, int, int, list[MasterPiece], list[int], list[int]]


def _pieces(buffers: Sequence[ParamAndGradBuffer], params_are_masters: bool = False) -> list[MasterPiece]:
    """This rank's pieces, each with an fp32 master; with ``params_are_masters`` (TE's
    FusedAdam holds the masters: :mod:`lptrain.optim.precision_aware`) the "master" handed to
    the optimizer is the param's own slice of the param buffer instead."""
    out: list[MasterPiece] = []
    for buf in buffers:
        for bucket in buf.buckets:
            lo, hi = bucket.shard_range()
            for name in bucket.param_names:
                s = buf.slots[name]
                a, b = max(lo, s.start), min(hi, s.end)
                if a >= b:
                    continue
                p = buf.params[name]
                whole = a == s.start and b == s.end
                if params_are_masters:
                    master = param_location(buf, p, a, b, a - s.start)
                    out.append(MasterPiece(name, p, buf, a, b, a - s.start, b - s.start,
                                           copy_param_attributes(p, master) if whole else master))
                    continue
                value = high_precision_value(p).reshape(-1)[a - s.start : b - s.start]
                master = value.clone().view(p.shape) if whole else value.clone()
                if whole:
                    copy_param_attributes(p, master)
                out.append(MasterPiece(name, p, buf, a, b, a - s.start, b - s.start, master))
    return out


class ShardedMasterOptimizer(ShardedStateMixin, MasterOptimizer):
    """AdamW (and Muon for Muon-managed whole matrices) over one set of buffers; an
    :class:`lptrain.optim.child.OptimizerChild`."""

    def __init__(
        self,
        buffers: Sequence[ParamAndGradBuffer],
        cfg: OptimizerConfig,
        *,
        label: str,
        tp: Group = SINGLE,
        pp: Group = SINGLE,
        state: Optional[StatePrecision] = None,
    ) -> None:
        self.buffers = list(buffers)
        # the precision-aware optimizer (None: torch's AdamW on fp32 masters)
        self.state_precision = state
        self.params_are_masters = state is not None and state.te_holds_masters
        # Tensor parallelism: the grad norm sums the tensor-parallel shards over ``tp`` and
        # counts a replicated param (a norm, the router) once, on TP rank 0.
        self.tp = tp
        # Pipeline parallelism: the stages' per-piece terms of the norm are summed as one
        # list over ``pp`` (the unpipelined sum of the same terms).
        self.pp = pp
        # The shard group of these buffers (all of one optimizer share it: dense or expert).
        self.group: Group = self.buffers[0].groups.intra if self.buffers else SINGLE
        # where this optimizer's scalars live: its buffers' device (NCCL reduces CUDA tensors)
        self.device = self.buffers[0].device if self.buffers else torch.device("cpu")
        self.label = label
        self.holds_experts = any(b.key.is_expert for b in self.buffers)
        self.pieces: list[MasterPiece] = _pieces(self.buffers, self.params_are_masters)
        for buf in self.buffers:
            for p in buf.params.values():
                release_high_precision_init(p)
        adam = [pc for pc in self.pieces if not pc.buffer.key.is_muon]
        muon = [pc for pc in self.pieces if pc.buffer.key.is_muon]
        self.optimizers: list[torch.optim.Optimizer] = []
        self.muon: Optional[Muon] = None
        if adam:
            decay = [pc.master for pc in adam if pc.param.dim() >= 2]
            no_decay = [pc.master for pc in adam if pc.param.dim() < 2]
            # AdamW, or Lion for Muon's non-matrix params (optimizer.muon.scalar_optimizer);
            # TE's FusedAdam with the precision-aware optimizer
            self.optimizers.append(scalar_optimizer(decay, no_decay, cfg) if state is None
                                   else fused_adam(decay, no_decay, cfg, state))
        if muon:
            if any(not pc.whole for pc in muon):
                raise RuntimeError("Muon params must be whole on a rank (unsharded Muon buffers)")
            self.muon = build_muon([pc.master for pc in muon], cfg)
            self.optimizers.append(self.muon)

    # ---- the step (step, lr_by_group: MasterOptimizer) ---------------------------------------

    def prepare_grads(self) -> None:
        """Point every master's ``.grad`` at its reduced gradient in fp32: the grads of fp32
        buffers are views (:attr:`_grad_views`); a lower-precision buffer's span is cast once
        per bucket and cut into the pieces (one cast instead of one per tensor, and the fp32
        grads the optimizer reads lie side by side; the cast is elementwise and exact, so the
        values are those of a cast per piece)."""
        if self.params_are_masters:  # the grad buffer's slices, in its dtype (Megatron)
            for pc, g in zip(self.pieces, self._grad_views, strict=True):
                pc.master.decoupled_grad = g  # type: ignore[attr-defined]
            return
        if all(b.key.grad_dtype == torch.float32 for b in self.buffers):
            super().prepare_grads()
            return
        for spans in self._norm_spans.values():
            for buf, lo, hi, pieces, sizes, keep in spans:
                g = buf.grad_slice(lo, hi)
                parts = (g if g.dtype == torch.float32 else g.float()).split(sizes)
                for pc, i in zip(pieces, keep, strict=True):
                    pc.master.grad = parts[i].view(pc.master.shape)

    def master_grads(self) -> list[torch.Tensor]:
        if self.params_are_masters:
            return [pc.master.decoupled_grad for pc in self.pieces]  # type: ignore[attr-defined]
        return super().master_grads()

    def discard_grads(self) -> None:
        if self.params_are_masters:
            for pc in self.pieces:
                pc.master.decoupled_grad = None  # type: ignore[attr-defined]
            return
        super().discard_grads()

    def grad_norm_sq(self) -> torch.Tensor:
        """Squared norm of this optimizer's full gradient (fp64, the same on every rank; each
        element counted once over the world).

        * Sharded buffers (the distributed optimizer): each rank's shard of every counted
          param, summed over the world by :func:`lptrain.optim.exact_norm.world_square_sum`,
          a sum that depends on the elements only -- not on where the data-parallel shards
          cut the params, which the buffer layout decides and which pipeline stages change.
        * Replicated buffers: one batched fp64 norm per piece (whole params), their squares
          summed in ascending order, so the result depends on the set of matrices only: not
          on how the pieces are bucketed or ordered in the buffers (overlap on == off stays
          bitwise), nor on whether experts are one grouped weight (members in memory order)
          or discrete params (laid out in reverse): :func:`norm_views`. Under pipeline
          parallelism the stages' squares join into one list first; then
          :meth:`_reduce_replicated` (tensor-parallel shards)."""
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        cpu = self.device.type == "cpu"
        if cpu:
            norms = self._cpu_norms(False)
        else:
            mine = [v for pc, g in zip(self.pieces, self.master_grads(), strict=True)
                    if not pc.buffer.sharded and self._counted(pc) for v in norm_views(pc, g)]
            norms = torch._foreach_norm(mine, 2, dtype=torch.float64) if mine else []
        squares = (torch.stack(norms).square() if norms
                   else torch.zeros(0, dtype=torch.float64, device=self.device))
        if self.pp.active:  # every stage's terms, summed as the unpipelined list
            squares = torch.cat(all_gather_uneven(squares, self.pp.pg))
        if squares.numel():
            replicated += squares.sort().values.sum()
        replicated = self._reduce_replicated(replicated)
        if not any(b.sharded for b in self.buffers):
            return replicated
        sharded = world_square_sum(self._sharded_grads(), self.device)
        return replicated + sharded

    def _reduce_replicated(self, sq: torch.Tensor) -> torch.Tensor:
        """The replicated part over the ranks holding other parts of it: the TP shards."""
        if self.tp.active:
            dist.all_reduce(sq, group=self.tp.pg)
        return sq

    def _sharded_grads(self) -> list[torch.Tensor]:
        """This rank's reduced grads of the counted params of its sharded buffers (views:
        whole spans where every piece counts; the padding between pieces is zero). A
        replica of the shard in another optimizer instance counts on instance 0 only."""
        inter = self.buffers[0].groups.inter if self.buffers else None
        if inter is not None and inter.active and inter.rank != 0:
            return []
        out: list[torch.Tensor] = []
        for buf, lo, hi, pieces, sizes, keep in self._norm_spans[True]:
            g = buf.grad_slice(lo, hi)
            if all(self._counted(pc) for pc in pieces):
                out.append(g)
                continue
            parts = g.split(sizes)
            out += [parts[i] for pc, i in zip(pieces, keep, strict=True) if self._counted(pc)]
        return out

    def _counted(self, pc: MasterPiece) -> bool:
        """Whether ``pc``'s gradient enters this rank's norm: always without tensor
        parallelism; under it a tensor-parallel shard always (the shards are disjoint) and a
        param replicated over the TP ranks (identical grads there) only on TP rank 0. A
        pipeline stage's copy of a tied embedding (``pipeline_copy``) never: the first
        stage's table counts it."""
        if getattr(pc.param, "pipeline_copy", False):
            return False
        return not self.tp.active or self.tp.rank == 0 or getattr(pc.param, "tp_shard", None) is not None

    @functools.cached_property
    def _norm_spans(self) -> dict[bool, list[_NormSpan]]:
        """Per sharded flag, one :data:`_NormSpan` per bucket: ``[lo, hi)`` spans its pieces
        (inside this rank's shard of the bucket: one :meth:`grad_slice`), ``sizes`` cut it
        into pieces and the gaps between them, ``keep`` says which part is each piece."""
        out: dict[bool, list[_NormSpan]] = {True: [], False: []}
        for buf in self.buffers:
            for bucket in buf.buckets:
                mine = sorted((pc for pc in self.pieces if pc.buffer is buf and bucket.start <= pc.lo < bucket.end),
                              key=lambda pc: pc.lo)
                if not mine:
                    continue
                sizes: list[int] = []
                keep: list[int] = []
                at = mine[0].lo
                for pc in mine:
                    if pc.lo > at:  # padding between params: cut off, not normed
                        sizes.append(pc.lo - at)
                    keep.append(len(sizes))
                    sizes.append(pc.hi - pc.lo)
                    at = pc.hi
                out[bool(buf.sharded)].append((buf, mine[0].lo, at, mine, sizes, keep))
        return out

    def _cpu_norms(self, sharded: bool) -> list[torch.Tensor]:
        """The fp64 norms of :func:`norm_views` of the ``sharded`` (or replicated) pieces'
        reduced grads, each bucket's span cast to fp64 once. Why: on the CPU
        ``_foreach_norm(..., dtype=float64)`` is a loop that casts every tensor before its norm
        (4 ops each); norms of views of one cast are the same numbers (the fp64 values are
        exact, and the reduction runs on fp64 either way) at one cast per bucket. CUDA keeps
        the fused kernel, which reads the fp32 grads directly."""
        norms: list[torch.Tensor] = []
        for buf, lo, hi, pieces, sizes, keep in self._norm_spans[sharded]:
            parts = fp64_copy(buf.grad_slice(lo, hi)).split(sizes)  # (one op for all)
            views = [v for pc, i in zip(pieces, keep, strict=True) if self._counted(pc)
                     for v in norm_views(pc, parts[i])]
            # the norms are taken before the next span reuses the scratch
            norms.extend(torch._foreach_norm(views, 2))
        return norms

    def count_zeros(self) -> Optional[int]:
        """Not counted here: ``muon_grad_zeros`` is the layer-wise Muon's metric."""
        return None

    @functools.cached_property
    def _stage_plan(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], StagePlan]:
        """What :meth:`stage` writes, worked out once (the pieces and buffers are fixed):
        ``(param, master)`` for replicated buffers, the :func:`stage_shards` entries (every
        param of the sharded buffers, in buffer order: the same on every rank) for the others."""
        # TE holding the masters wrote the params themselves: nothing to write, only the
        # (collective) entry list to keep
        piece_of = {} if self.params_are_masters else {pc.name: pc for pc in self.pieces}
        direct: list[tuple[torch.Tensor, torch.Tensor]] = []
        entries: list[StageEntry] = []
        for buf in self.buffers:
            if not buf.sharded:
                direct.extend((p, piece_of[n].master) for n, p in buf.params.items() if n in piece_of)
                continue
            for name, p in buf.params.items():  # same order on every rank (collective)
                pc = piece_of.get(name)
                if pc is None:
                    entries.append((p, None, 0, 0, None))
                else:
                    entries.append((p, pc.master, pc.p_lo, pc.p_hi, buf.param_slice(pc.lo, pc.hi)))
        return direct, StagePlan(entries)

    def stage(self) -> None:
        """Masters -> params: the staging slices of sharded buffers (then marked staged for
        the gather), or the params themselves for replicated ones (batched per format by
        :mod:`lptrain.precision.param_storage`)."""
        direct, plan = self._stage_plan
        with torch.no_grad():
            if direct:
                write_values([p for p, _ in direct], [m for _, m in direct])
            plan.run(self.group.pg if self.group.active else None)
        for buf in self.buffers:
            if buf.sharded:
                for bucket in buf.buckets:
                    bucket.mark_staged()

    def update_rms(self) -> Optional[float]:
        return self.muon.last_update_rms if self.muon is not None else None


class ExpertShardedMasterOptimizer(ShardedMasterOptimizer):
    """The expert child of the chained optimizer under expert parallelism: as the dense one,
    plus the sum of the replicated buffers' squared gradient norm over the expert-parallel
    group ``ep`` (each EP rank holds different experts; the sharded part is a world sum)."""

    def __init__(
        self, buffers: Sequence[ParamAndGradBuffer], cfg: OptimizerConfig, *, label: str, ep: Group = SINGLE,
        pp: Group = SINGLE, state: Optional[StatePrecision] = None,
    ) -> None:
        super().__init__(buffers, cfg, label=label, pp=pp, state=state)
        self.ep = ep

    def _reduce_replicated(self, sq: torch.Tensor) -> torch.Tensor:
        if self.ep.active:
            dist.all_reduce(sq, group=self.ep.pg)
        return sq
