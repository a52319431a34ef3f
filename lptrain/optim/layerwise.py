"""The layer-wise distributed Muon optimizer: every Muon matrix has exactly one owner rank.

Newton-Schulz needs a whole matrix, so Muon cannot shard its state by byte ranges like
ZeRO-1 AdamW. Instead each Muon matrix (a *unit*: a 2-D param, or one member of a grouped
``[E, out, in]`` expert weight) is owned by one rank of its buffer's group (the data-parallel
group for dense params, the expert-data-parallel group for expert params). Only the owner
keeps an fp32 master and a momentum buffer for it and computes its update; every other rank
drops its high-precision init copy and just receives the updated values.

Ownership (:func:`assign_owners`) is LPT over the Newton-Schulz cost ``min^2 * max``, in the
canonical order :func:`ownership_key` = (cost descending, parameter name, member): a total
order that never depends on registration order, so every rank computes the same owners even
when several matrices have equal shapes (sorting by numel alone lets a stable sort fall back
to each rank's registration order, and ranks then disagree on who owns which matrix).

Two layouts (``optimizer.layer_wise_param_layout``, planned in
:func:`lptrain.distributed.layerwise_layout.plan_layer_wise_layout`):

* **compact** (default): Muon buffers have no padding; grads are all-reduced; after the step
  each owner stages its units in their *transport dtype* (the param's logical dtype: bf16 for
  bf16 and FP8 params -- staged from the fp32 master, never a lossy FP8 dequant -- and fp32
  for fp32 params, which a bf16 transport would silently round) and a per-bucket uneven
  all-gather (:class:`lptrain.optim.compact_gather.CompactGather`, the bucket's
  ``param_sync_hook``) delivers them; every rank, the owner included, then loads the
  gathered value through :func:`lptrain.precision.param_storage.load_from_staging` (a copy
  for plain params, a requantization of both orientations for FP8 params), so FP8 param
  gather ON holds exactly ``Q(bf16(master))``, what OFF quantizes in its forward. The
  gather runs synchronously or overlapped with the next forward through the bucket state
  machine like any other bucket, so the forced sync (``params_synced``) finalizes a
  pending one.
* **padded**: whole params sit inside the equal DP shards of their bucket, so the bucket
  reduce-scatters grads and all-gathers params exactly like a distributed-optimizer bucket;
  the owner is the rank whose shard holds the param. A grouped 3-D expert weight is owned
  whole here (its members must stay contiguous in the param buffer), member-wise in compact.

The grad norm and the zero count sum each unit once (on its owner) over the whole world.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lptrain.config.schema import OptimizerConfig
from lptrain.distributed.buffers import ParamAndGradBuffer
from lptrain.distributed.groups import SINGLE, Group
from lptrain.distributed.layerwise_layout import ns_cost, padded_owner
from lptrain.distributed.layout import BufferSpec
from lptrain.optim.child import MasterOptimizer, OptimizerChild, foreach_scalar
from lptrain.optim.compact_gather import CompactGather
from lptrain.optim.distributed import ExpertShardedMasterOptimizer, ShardedMasterOptimizer
from lptrain.optim.fp64_scratch import fp64_copy
from lptrain.optim.layerwise_state import LayerWiseStateMixin
from lptrain.optim.muon import build_muon
from lptrain.optim.param_groups import copy_param_attributes
from lptrain.optim.precision_aware import StatePrecision
from lptrain.precision.optimizer_states import TORCH_DTYPES
from lptrain.precision.param_storage import (
    high_precision_value,
    release_high_precision_init,
)


@dataclass(frozen=True)
class MuonUnit:
    """One matrix for ownership: elements ``[lo, hi)`` of buffer ``buffer``, in ``bucket``;
    ``member`` is -1 for a whole param, else the member index of a grouped 3-D weight."""

    name: str
    member: int
    shape: tuple[int, ...]
    buffer: int
    bucket: int
    lo: int
    hi: int
    is_expert: bool

    @property
    def key(self) -> tuple[str, int]:
        return (self.name, self.member)

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def ownership_key(unit: MuonUnit) -> tuple[Any, ...]:
    """Canonical, rank-independent order for ownership: NS cost descending, then the
    parameter's name and member (numel alone ties equal shapes, see the module doc)."""
    return (-ns_cost(unit.shape), unit.name, unit.member)


def assign_owners(units: Sequence[MuonUnit], size: int) -> dict[tuple[str, int], int]:
    """LPT: in :func:`ownership_key` order, each unit goes to the rank with the least
    cumulative NS cost so far (ties to the lower rank)."""
    loads = [0] * size
    owners: dict[tuple[str, int], int] = {}
    for u in sorted(units, key=ownership_key):
        r = min(range(size), key=lambda i: (loads[i], i))
        owners[u.key] = r
        loads[r] += ns_cost(u.shape)
    return owners


def units_of_buffer(spec: BufferSpec, *, member_level: bool) -> list[MuonUnit]:
    """The ownership units of a Muon buffer (a 3-D param is ``shape[0]`` member matrices
    when ``member_level``; grouped expert weights are the only 3-D Muon params)."""
    out = []
    for s in spec.params:
        if member_level and len(s.shape) == 3:
            per = s.shape[1] * s.shape[2]
            for i in range(s.shape[0]):
                lo = s.start + i * per
                out.append(MuonUnit(s.name, i, tuple(s.shape[1:]), s.buffer, s.bucket, lo,
                                    lo + per, spec.key.is_expert))
        else:
            out.append(MuonUnit(s.name, -1, tuple(s.shape), s.buffer, s.bucket, s.start, s.end,
                                spec.key.is_expert))
    return out


def plan_ownership(
    specs: Sequence[BufferSpec], *, dense_size: int, expert_size: int, param_layout: str
) -> dict[tuple[str, int], int]:
    """Owner of every unit of the Muon buffers ``specs``: from the shard position in the
    padded layout, by LPT per group (dense over ``dense_size`` ranks, expert over
    ``expert_size``) in the compact one. Pure: the memory model uses it too."""
    owners: dict[tuple[str, int], int] = {}
    if param_layout == "padded":
        for spec in specs:
            size = expert_size if spec.key.is_expert else dense_size
            for s in spec.params:
                owners[(s.name, -1)] = padded_owner(spec.buckets[s.bucket], s, size)
        return owners
    for expert, size in ((False, dense_size), (True, expert_size)):
        units = [u for spec in specs if spec.key.is_expert == expert
                 for u in units_of_buffer(spec, member_level=True)]
        owners.update(assign_owners(units, size))
    return owners


def unit_sums_and_zeros(
    runs: Sequence[tuple[torch.Tensor, Sequence[int]]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum(double(g_u)^2) per unit [U], zero entries)`` over units given as runs of
    adjacent grads ``(run, unit sizes)``: each term bitwise the unit's own formula.

    Each run is converted and squared once, each unit's slice of it summed on its own (a
    reduction over the same values in the same length as the unit's own tensor). Counting
    zeros is exact in any grouping: one count per run. The terms are added up in the
    grad norm's exact binned sum (:mod:`lptrain.optim.exact_norm`)."""
    zeros = torch.zeros((), dtype=torch.int64, device=device)
    sums: list[torch.Tensor] = []
    for grad, sizes in runs:
        sq = fp64_copy(grad).square_()  # (summed below, before the next run's cast)
        sums += [part.sum() for part in sq.split(list(sizes))]
        zeros += grad.numel() - torch.count_nonzero(grad)
    terms = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64, device=device)
    return terms, zeros


def world_sorted_sum(terms: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every rank's ``terms`` gathered, sorted and summed (a result that depends on the set
    of terms only: not on which rank owns a unit, nor on how the units are cut into
    pipeline stages), and the world's total of ``zeros``: one gather of ``[zeros, *terms]``."""
    from lptrain.precision.collectives import all_gather_uneven

    mine = torch.cat([zeros.to(torch.float64).view(1), terms])  # (fp64 holds counts < 2^53)
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        parts = [mine]
    else:
        parts = all_gather_uneven(mine, None)
    count = int(sum(float(p[0]) for p in parts))
    total = torch.cat([p[1:] for p in parts])
    return (total.sort().values.sum() if total.numel() else
            torch.zeros((), dtype=torch.float64, device=terms.device)), count


@dataclass
class OwnedUnit:
    """A unit this rank owns: its fp32 master (``.master``, with the optimizer's ``.grad``)."""

    unit: MuonUnit
    buffer: ParamAndGradBuffer
    param: torch.nn.Parameter
    master: torch.Tensor

    def grad_view(self) -> torch.Tensor:
        # grad_slice: with sharded grads (padded layout) the unit lies in the kept shard
        return self.buffer.grad_slice(self.unit.lo, self.unit.hi).view(self.master.shape)


class LayerWiseMuon(LayerWiseStateMixin, MasterOptimizer):
    """Muon over the Muon buffers, one owner per matrix (see the module doc); an
    :class:`lptrain.optim.child.OptimizerChild`."""

    def __init__(
        self,
        buffers: Sequence[ParamAndGradBuffer],
        cfg: OptimizerConfig,
        *,
        param_layout: str = "compact",
        gather_mode: Optional[str] = None,
        label: str = "muon",
        tp: Group = SINGLE,
        state: Optional[StatePrecision] = None,
    ) -> None:
        self.buffers = list(buffers)
        # the precision-aware optimizer: the momentum is stored as Adam's exp_avg (masters fp32)
        self.state_precision = state
        # Tensor parallelism: each TP rank owns its shards of the same units (the same
        # ownership: identical layouts); a unit replicated over TP counts on TP rank 0 only.
        self.tp = tp
        self.cfg = cfg
        self.label = label
        self.holds_experts = any(b.key.is_expert for b in self.buffers)
        self.device = self.buffers[0].device if self.buffers else torch.device("cpu")
        self.param_layout = param_layout
        dense = [b.groups.intra for b in self.buffers if not b.key.is_expert]
        expert = [b.groups.intra for b in self.buffers if b.key.is_expert]
        self.owners = plan_ownership(
            [b.spec for b in self.buffers],
            dense_size=dense[0].size if dense else 1,
            expert_size=expert[0].size if expert else 1,
            param_layout=param_layout,
        )
        member_level = param_layout == "compact"
        self.units: list[tuple[MuonUnit, ParamAndGradBuffer]] = [
            (u, b) for b in self.buffers for u in units_of_buffer(b.spec, member_level=member_level)
        ]
        self.pieces: list[OwnedUnit] = []
        hp_cache: dict[str, torch.Tensor] = {}
        for u, buf in self.units:
            if self.owners[u.key] != buf.groups.intra.rank:
                continue
            p = buf.params[u.name]
            if u.name not in hp_cache:
                hp_cache[u.name] = high_precision_value(p)
            value = hp_cache[u.name]
            if u.member >= 0:
                master = value[u.member].clone()
            else:
                master = copy_param_attributes(p, value.clone())
            self.pieces.append(OwnedUnit(u, buf, p, master))
        del hp_cache
        for buf in self.buffers:  # owners copied theirs; nobody keeps the init copies
            for p in buf.params.values():
                release_high_precision_init(p)
        self.optimizer = build_muon([pc.master for pc in self.pieces], cfg,
                                    TORCH_DTYPES[state.exp_avg] if state is not None else torch.float32)
        self.optimizers: list[torch.optim.Optimizer] = [self.optimizer]
        self._rms: Optional[float] = None
        self._rms_pending: Optional[tuple[torch.Tensor, Any]] = None
        self._norm_cache: Optional[torch.Tensor] = None
        self._stepped = False
        self.gathers: list[CompactGather] = []
        if param_layout == "compact":
            for buf in self.buffers:
                units = [u for u, b in self.units if b is buf]
                for bucket in buf.buckets:
                    mine = [u for u in units if u.bucket == bucket.index]
                    gather = CompactGather(bucket, mine, self.owners, buf.params,
                                           buf.groups.intra, gather_mode)
                    bucket.param_sync_hook = gather
                    self.gathers.append(gather)

    # ---- the step (prepare_grads, lr_by_group: MasterOptimizer) ----------------------------

    def grad_norm_sq(self) -> torch.Tensor:
        """Squared norm of every Muon grad, each unit once (on its owner), over the world:
        the units' terms gathered from every rank, sorted and summed
        (:func:`world_sorted_sum`), so that it does not depend on ownership or on pipeline
        stages (the same number at PP 1 and PP 2, at any data-parallel size).

        The engine counts zeros right before the step (nothing writes the grads in
        between), and :meth:`count_zeros` sums this norm in the same all-reduce: the first
        norm after a count reuses it, saving one collective per step. The reuse is decided
        by program flow alone (never by a rank-local test), so every rank takes the same
        branch; :meth:`stage` and :meth:`discard_grads` drop an unused one."""
        cached, self._norm_cache = self._norm_cache, None
        if cached is not None:
            return cached
        return world_sorted_sum(*self._norm_parts())[0]

    @functools.cached_property
    def _grad_runs(self) -> list[tuple[torch.Tensor, list[int]]]:
        """The owned units' grads merged into runs of consecutive pieces adjacent in one
        bucket: ``(the run's grad view, the pieces' element counts)``, in piece order. The
        norm and the zero count then convert and count once per run instead of once per
        unit (the views live as long as the buffers, like :attr:`_grad_views`)."""
        runs: list[tuple[OwnedUnit, int, list[int]]] = []  # (first piece, hi, sizes)
        skip_replicated = self.tp.active and self.tp.rank != 0
        for pc in self.pieces:
            if skip_replicated and getattr(pc.param, "tp_shard", None) is None:
                continue  # counted by TP rank 0 (see __init__)
            u = pc.unit
            if runs:
                first, hi, sizes = runs[-1]
                f = first.unit
                if first.buffer is pc.buffer and f.bucket == u.bucket and hi == u.lo:
                    runs[-1] = (first, u.hi, [*sizes, u.numel])
                    continue
            runs.append((pc, u.hi, [u.numel]))
        return [(first.buffer.grad_slice(first.unit.lo, hi), sizes) for first, hi, sizes in runs]

    def _norm_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the owned units' squared grad norms, fp64 [U]; their zero count, int64), on the
        device: :func:`unit_sums_and_zeros` over the runs."""
        return unit_sums_and_zeros(self._grad_runs, self.device)

    def count_zeros(self) -> int:
        """Zero gradient entries of every Muon matrix, each once, summed over the world (in
        one gather with the squared grad norm's terms, see :meth:`grad_norm_sq`)."""
        norm, zeros = world_sorted_sum(*self._norm_parts())
        self._norm_cache = norm
        return zeros

    def step(self, lrs: Mapping[str, float], clip_coef: Optional[float]) -> None:
        """Clip (one batched multiply), update, and launch the update-RMS all-reduce without
        waiting: :meth:`update_rms` reads it, so its latency overlaps staging and the gather."""
        self._finish_rms()
        if clip_coef is not None and self.pieces:
            grads = [pc.master.grad for pc in self.pieces]
            torch._foreach_mul_(grads, foreach_scalar(grads[0], clip_coef))  # type: ignore[arg-type]
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["lr"] = lrs[g["name"]]
            opt.step()
        self.discard_grads()
        self._stepped = True
        # Update RMS over every unit of the world (each counted once): one tiny all-reduce.
        sq, count = self.optimizer.last_update_stats
        stats = torch.zeros(2, dtype=torch.float64, device=self.device)
        if sq is not None:
            stats[0] = sq
        stats[1] = float(count)
        work = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            work = dist.all_reduce(stats, async_op=True)
        self._rms_pending = (stats, work)

    def discard_grads(self) -> None:
        self._norm_cache = None
        super().discard_grads()

    def _finish_rms(self) -> None:
        if self._rms_pending is None:
            return
        stats, work = self._rms_pending
        self._rms_pending = None
        if work is not None:
            work.wait()
        total, n = stats.tolist()  # the step's one host read of Muon's statistics
        self._rms = math.sqrt(total / n) if n > 0 else None

    def stage(self) -> None:
        """Masters -> the gather: packs (compact) or the owner's shard of the param buffer
        (padded); every bucket is then marked staged for the bucket state machine."""
        self._norm_cache = None
        with torch.no_grad():
            if self.param_layout == "compact":
                for gather in self.gathers:
                    gather.stage(self._masters_by_key)
            else:
                dsts = [pc.buffer.param_slice(pc.unit.lo, pc.unit.hi)  # (ZeRO-3: the shard)
                        for pc in self.pieces]
                if dsts:
                    torch._foreach_copy_(dsts, [pc.master.reshape(-1) for pc in self.pieces])
        for buf in self.buffers:
            for bucket in buf.buckets:
                bucket.mark_staged()

    @functools.cached_property
    def _masters_by_key(self) -> dict[tuple[str, int], torch.Tensor]:
        """Every owned unit's master by unit key, for the gathers' packing: the masters are
        fixed objects (a checkpoint load copies into them), so the map is built once."""
        return {pc.unit.key: pc.master for pc in self.pieces}

    def update_rms(self) -> Optional[float]:
        self._finish_rms()
        return self._rms


def build_layer_wise_children(
    buffers: Sequence[ParamAndGradBuffer], cfg: OptimizerConfig, ep: Optional[Group] = None,
    tp: Group = SINGLE, pp: Group = SINGLE, state: Optional[StatePrecision] = None,
) -> list[OptimizerChild]:
    """Chained-optimizer children for the layer-wise path: byte-sharded AdamW over the
    non-Muon buffers and a :class:`LayerWiseMuon` over the Muon buffers, for dense and for
    expert params (each over its own group; the expert children hold experts, which the
    engine checkpoints under their canonical per-expert names). The Muon children sum their
    norms over the whole world (each unit counted once on its owner); the expert AdamW child
    adds the expert-parallel sum (``ep``), as every EP rank holds different experts."""
    children: list[OptimizerChild] = []
    for expert in (False, True):
        label = "expert" if expert else "dense"
        adam = [b for b in buffers if not b.key.is_muon and b.key.is_expert == expert]
        muon = [b for b in buffers if b.key.is_muon and b.key.is_expert == expert]
        if adam and expert:
            children.append(ExpertShardedMasterOptimizer(adam, cfg, label=label, ep=ep or SINGLE, pp=pp,
                                                         state=state))
        elif adam:
            children.append(ShardedMasterOptimizer(adam, cfg, label=label, tp=tp, pp=pp, state=state))
        if muon:
            children.append(LayerWiseMuon(muon, cfg, param_layout=cfg.layer_wise_param_layout,
                                          label=label, tp=SINGLE if expert else tp, state=state))
    return children
