"""The memory model's persistent categories measured on a live engine.

Read from the real tensors -- the buffers' ``grad_data``/``param_data``, the parameters, the
optimizer children's masters and state -- so comparing it with
:func:`lptrain.memory.plan.estimate_memory` or :func:`lptrain.memory.analytic.analytic_memory`
checks the model against what a run really allocates (call it after one step: optimizer
state is created lazily). ``TrainEngine.memory_breakdown()`` is
:meth:`~lptrain.memory.breakdown.MemoryBreakdown.engine_report` of the same measurement.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lptrain.distributed.buffers import ParamAndGradBuffer
from lptrain.memory.breakdown import MemoryBreakdown
from lptrain.optim.child import OptimizerChild
from lptrain.optim.precision_aware import state_bytes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _buffer_bytes(m: MemoryBreakdown, buf: ParamAndGradBuffer) -> None:
    used = sum(s.end - s.start for s in buf.spec.params)
    es = buf.grad_data.element_size()
    if buf.grad_shard is not None:  # sharded grads: the kept shards (full buckets are transient)
        in_shards = sum(buf.spec.shard_used(b, buf.groups.intra.rank, buf.groups.intra.size)[1]
                        for b in buf.spec.buckets)
        m.grads += in_shards * es
        m.grad_padding += (buf.grad_shard.numel() - in_shards) * es
        m.padding += (buf.grad_shard.numel() - in_shards) * es
    else:
        m.grads += used * es
        m.grad_padding += (buf.grad_data.numel() - used) * es
        m.padding += (buf.grad_data.numel() - used) * es
    if buf.param_shard is not None:  # sharded params: this rank's shard is all that persists
        _param_shard_bytes(m, buf)
        return
    pd = buf.param_data
    if pd is None:
        return
    pad = (pd.numel() - used) * pd.element_size()
    if buf.reuses_grad_buffer:  # a view of the grad buffer: no bytes of its own
        m.view_padding += pad
        return
    m.padding += pad
    # a high-precision copy of the params that do not live in the buffer (quantized ones)
    staged = sum(s.end - s.start for n, s in buf.slots.items() if not buf.aliased.get(n))
    m.param_gather_staging += staged * pd.element_size()


def _param_shard_bytes(m: MemoryBreakdown, buf: ParamAndGradBuffer) -> None:
    """ZeRO-3: the kept param shard (param elements as weights, the rest padding); the full
    buckets and a quantized param's data bytes exist only around their uses. A quantized
    param's scales stay allocated and are not counted (bytes per block, not per element)."""
    assert buf.param_shard is not None
    g = buf.groups.intra
    used = sum(buf.spec.shard_used(b, g.rank, g.size)[1] for b in buf.spec.buckets)
    es = buf.param_shard.element_size()
    if buf.key.quantized:
        m.quantized_weights += used * es
    else:
        m.weights += used * es
    m.padding += (buf.param_shard.numel() - used) * es


def measured_memory(
    model: torch.nn.Module, buffers: Sequence[ParamAndGradBuffer], children: Sequence[OptimizerChild]
) -> MemoryBreakdown:
    """This rank's bytes from the live engine: ``model``, the ``DataParallel`` buffers and
    the chained optimizer's children (call after one step: optimizer state is lazy)."""
    from lptrain.precision.param_storage import is_quantized, storage_bytes

    m = MemoryBreakdown()
    sharded = {id(p) for buf in buffers if buf.shards_params for p in buf.params.values()}
    for p in model.parameters():
        if not p.requires_grad or id(p) in sharded:  # (sharded params: counted by buffer)
            continue
        if is_quantized(p):
            m.quantized_weights += storage_bytes(p)
        else:
            m.weights += _nbytes(p)
    for buf in buffers:
        _buffer_bytes(m, buf)
    for child in children:
        # TE holding the masters (the precision-aware optimizer): the pieces are the params'
        # own slices, and the masters are FusedAdam's ``master_param`` state
        if not getattr(child, "params_are_masters", False):
            for pc in child.pieces:
                m.masters += _nbytes(pc.master)
        for opt in child.optimizers:
            masters, states, scalars = state_bytes(opt)  # as stored: FP8 codes, scales, ...
            m.masters += masters
            m.optimizer_states += states
            m.optimizer_scalars += scalars
    return m


def measure_engine(engine: Any) -> dict[str, int]:
    """Bytes per persistent category of a ``TrainEngine`` on this rank (the planner's
    categories, :data:`lptrain.memory.breakdown.PERSISTENT`)."""
    return measured_memory(engine.model, engine.ddp.buffers, engine.optimizer.children).categories()
