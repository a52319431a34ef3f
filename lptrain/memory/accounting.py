"""The per-rank accounting of persistent bytes from a buffer layout: the one memory model.

:func:`rank_memory` walks a :class:`~lptrain.distributed.layout.BufferLayout` the way the
engine allocates it -- grad buffers, param buffers (or their reuse of the grad buffer),
this rank's shard of every bucket (or the Muon matrices it owns under the layer-wise
optimizer) -- and returns a :class:`~lptrain.memory.breakdown.MemoryBreakdown`. The planner
(:mod:`lptrain.memory.plan`, from a config) and the analytic model
(:mod:`lptrain.memory.analytic`, from parameter descriptions) both call it; what a live
engine holds is measured by :mod:`lptrain.memory.measure` in the same categories.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lptrain.catalog import optimizer_state as pao
from lptrain.distributed.layout import BufferLayout, BufferSpec
from lptrain.memory.breakdown import MemoryBreakdown
from lptrain.optim.layerwise import units_of_buffer

MASTER_BYTES = 4  # fp32 masters
MUON_STATE_BYTES = 4  # fp32 momentum per element
ADAMW_STATE_BYTES = 8  # fp32 exp_avg + exp_avg_sq per element
ADAMW_STEP_BYTES = 4  # one fp32 0-dim step per optimized piece
LION_STATE_BYTES = 4  # fp32 exp_avg per element


@dataclass(frozen=True)
class StoredParam:
    """A parameter as the accounting sees it: its elements and its own storage's bytes
    (``numel * itemsize``, or the quantized primary weight's data and scales)."""

    numel: int
    nbytes: int
    quantized: bool


@dataclass(frozen=True)
class Sharding:
    """Where this rank sits in the shard groups its buffers reduce over: the dense buffers'
    group (``dense_size`` ranks, this one ``dense_rank``) and the expert buffers'."""

    dense_size: int
    dense_rank: int
    expert_size: int
    expert_rank: int

    def of(self, spec: BufferSpec) -> tuple[int, int]:
        """``(group size, rank in it)`` of the group ``spec`` shards over."""
        if spec.key.is_expert:
            return self.expert_size, self.expert_rank
        return self.dense_size, self.dense_rank


@dataclass(frozen=True)
class OptimizerLayout:
    """What decides the optimizer state a rank keeps: the layer-wise Muon (``layer_wise``,
    its ``param_layout``, ``owners`` from :func:`lptrain.optim.layerwise.plan_ownership`),
    and ``scalar_optimizer`` (``adamw`` or ``lion``) for the params Muon does not take."""

    layer_wise: bool = False
    param_layout: str = "compact"
    owners: Mapping[tuple[str, int], int] | None = None
    scalar_optimizer: str = "adamw"
    # the precision-aware optimizer (lptrain.catalog.optimizer_state): the stored dtypes of
    # the moments (Muon's momentum is exp_avg's) and of the masters TE holds ("fp32", "fp16"
    # or "remainders"; None: lptrain holds fp32 masters); fp16 and fp8 add one fp32 scale per
    # optimizer tensor (a piece of this rank's shard, an owned Muon matrix), and TE's step
    # counter is per param group (no 0-dim tensor per piece)
    precision_aware: bool = False
    exp_avg: str = "fp32"
    exp_avg_sq: str = "fp32"
    te_master: str | None = None


def kept_grad_elements(buf: BufferSpec, rank: int, size: int) -> tuple[int, int]:
    """``(param elements, padding elements)`` of the grads ``rank`` keeps between steps: the
    whole buffer, or with sharded grads (ZeRO-2) its shard of every bucket."""
    if not buf.shards_grads:
        return buf.numel_unpadded, buf.numel - buf.numel_unpadded
    used = total = 0
    for bucket in buf.buckets:
        n, u = buf.shard_used(bucket, rank, size)
        total += n
        used += u
    return used, total - used


def _buffers_bytes(m: MemoryBreakdown, layout: BufferLayout, params: Mapping[str, StoredParam],
                   reuse_grad_buffer: bool, sharding: Sharding) -> None:
    """The grad and param buffers and the parameters' own storage."""
    for buf in layout.buffers:
        pad = buf.numel - buf.numel_unpadded
        gbytes = buf.key.grad_dtype.itemsize
        size, rank = sharding.of(buf)
        used, gpad = kept_grad_elements(buf, rank, size)
        m.grads += used * gbytes
        m.grad_padding += gpad * gbytes
        m.padding += gpad * gbytes
        pbytes = buf.key.param_dtype.itemsize
        if buf.shards_params:  # ZeRO-3: only this rank's shard of the params persists
            used, ppad = kept_grad_elements(buf, rank, size)  # (the same shards as the grads)
            if buf.key.quantized:
                m.quantized_weights += used * pbytes
            else:
                m.weights += used * pbytes
            m.padding += ppad * pbytes
            continue
        own_param_buffer = buf.sharded and not (reuse_grad_buffer and buf.key.quantized)
        if own_param_buffer:
            m.padding += pad * pbytes
        elif buf.sharded:  # the param view lies inside the grad buffer
            m.view_padding += pad * pbytes
        for s in buf.params:
            p = params[s.name]
            if not p.quantized:
                m.weights += p.nbytes
                continue
            m.quantized_weights += p.nbytes
            if own_param_buffer and buf.key.param_dtype != torch.uint8:  # a high-precision copy
                m.param_gather_staging += p.numel * pbytes


def _optimizer_bytes(m: MemoryBreakdown, layout: BufferLayout, sharding: Sharding,
                     optimizer: OptimizerLayout) -> None:
    """This rank's masters and optimizer states (fp32, or as the precision-aware optimizer
    stores them)."""
    adam_elems = adam_pieces = muon_elems = muon_units = masters = 0
    for buf in layout.buffers:
        size, me = sharding.of(buf)
        if buf.key.is_muon and optimizer.layer_wise:
            owners = optimizer.owners or {}
            member_level = optimizer.param_layout == "compact"
            mine = [u.numel for u in units_of_buffer(buf, member_level=member_level)
                    if owners[u.key] == me]
            masters += sum(mine)
            muon_elems += sum(mine)
            muon_units += len(mine)
            continue
        slots = {s.name: s for s in buf.params}
        for bucket in buf.buckets:
            for name in bucket.params:
                n = buf.overlap(bucket, slots[name], me, size)
                if n <= 0:
                    continue
                masters += n
                if buf.key.is_muon:
                    muon_elems += n
                else:
                    adam_elems += n
                    adam_pieces += 1
    if optimizer.precision_aware:
        _precision_aware_bytes(m, optimizer, masters, adam_elems, adam_pieces, muon_elems, muon_units)
        return
    m.masters = masters * MASTER_BYTES
    if optimizer.scalar_optimizer == "lion":
        scalar = adam_elems * LION_STATE_BYTES
    else:
        m.optimizer_scalars = adam_pieces * ADAMW_STEP_BYTES
        scalar = adam_elems * ADAMW_STATE_BYTES + m.optimizer_scalars
    m.optimizer_states = scalar + muon_elems * MUON_STATE_BYTES


def _state_bytes(dtype: str, elems: int, tensors: int) -> int:
    """``elems`` elements of a state stored as ``dtype`` in ``tensors`` optimizer tensors."""
    return elems * pao.BYTES[dtype] + tensors * pao.SCALE_BYTES.get(dtype, 0)


def _precision_aware_bytes(m: MemoryBreakdown, o: OptimizerLayout, masters: int, adam_elems: int,
                           adam_pieces: int, muon_elems: int, muon_units: int) -> None:
    """The precision-aware optimizer's state: TE's FusedAdam for the non-Muon pieces (moments
    in their dtypes, masters held by TE as fp32, fp16 + scale or an int16 remainder, or fp32
    by lptrain), Muon's momentum as ``exp_avg`` next to its fp32 masters."""
    if o.te_master is None:
        m.masters = masters * MASTER_BYTES
    else:
        held = pao.master_bytes("fp16" if o.te_master == "fp16" else "fp32", o.te_master == "remainders")
        m.masters = (_state_bytes("fp16", 0, adam_pieces) if o.te_master == "fp16" else 0) + (
            adam_elems * held + muon_elems * MASTER_BYTES)
    m.optimizer_states = (_state_bytes(o.exp_avg, adam_elems, adam_pieces)
                          + _state_bytes(o.exp_avg_sq, adam_elems, adam_pieces)
                          + _state_bytes(o.exp_avg, muon_elems, muon_units))


def rank_memory(
    layout: BufferLayout,
    params: Mapping[str, StoredParam],
    sharding: Sharding,
    optimizer: OptimizerLayout,
    *,
    reuse_grad_buffer: bool = False,
) -> MemoryBreakdown:
    """Persistent bytes of one rank: ``params`` describes every parameter of the layout;
    ``reuse_grad_buffer`` is ``ddp.reuse_grad_buf_for_mxfp8_param_ag`` (a quantized sharded
    buffer then stages its gather in its own grad buffer)."""
    m = MemoryBreakdown()
    _buffers_bytes(m, layout, params, reuse_grad_buffer, sharding)
    _optimizer_bytes(m, layout, sharding, optimizer)
    return m
