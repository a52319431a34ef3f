"""The context-parallel step: the parallelism-agnostic GPT made to run on two chunks of each
sequence (``model.context_parallel_size``, Megatron-LM's CP).

A context-parallel rank holds chunks ``i`` and ``2 CP - 1 - i`` of the ``2 CP`` equal chunks
of every sequence of its micro-batches (the data loader reads only those:
:func:`lptrain.data.loader.collate`). Everything but attention is the CP = 1 computation on
fewer tokens; :func:`parallelize_context` swaps in what differs:

=====================  ========================================================================
module                 under context parallelism
=====================  ========================================================================
attention core         keys and values exchanged over the CP group by ``model.cp_comm_type``
                       (ring, all-to-all, all-gather, hierarchical:
                       :mod:`lptrain.model.context_parallel.attention`)
rotary embedding       the rank's chunks' true positions, not ``0 .. s/CP - 1``
LM loss                the rank's tokens' cross-entropy sum over the *sequences'* token count
                       (summed over CP): the CP ranks' losses add up to the CP = 1 loss
MoE router             balancing statistics summed over the ranks of the same sequences
GEMM layers            (emulated backend) per-tensor amaxes of the sequence-split operands --
                       every layer's input and output gradient -- MAX-reduced over CP, so a
                       tensorwise or NVFP4 scale is the whole sequence's, as at CP = 1
=====================  ========================================================================

The weights are whole on every CP rank (CP does not shard them); their gradients are parts
of the replica's gradient and are summed by the data x context parallel reduction
(:attr:`lptrain.distributed.groups.ParallelGroups.grad_reduction`); delayed-scaling amaxes
are reduced over the stage, CP included (:data:`lptrain.catalog.parallel_dims.AMAX_REDUCTION_DIMS`).

On the Transformer Engine backend the GEMM layers are TE's and the attention is lptrain's own
(lptrain does not use TE's ``DotProductAttention``: its attention is
``torch.nn.functional.scaled_dot_product_attention`` at CP = 1), so these cores serve both
backends. TE reduces current-scaling amaxes only over its tensor-parallel group: there the
per-tensor scales of activations are each rank's own (as in Megatron-LM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lptrain.catalog.parallel_dims import cp_token_ranges
from lptrain.model.context_parallel.attention import cp_attention
from lptrain.model.process_group import SINGLE_RANK, ProcessGroup

__all__ = ["ContextParallel", "ContextParallelFactory", "ContextParallelLoss", "ContextParallelRotary",
           "parallelize_context"]

IGNORE = -100


@dataclass(frozen=True)
class ContextParallel:
    """What the model needs of the run's context parallelism: the CP group, the comm type,
    the two levels of hierarchical CP, and the ranks holding parts of the same sequences
    (``token_shards``: tensor x context parallel under sequence parallelism)."""

    group: ProcessGroup
    comm_type: str = "p2p"
    a2a: ProcessGroup = SINGLE_RANK
    p2p: ProcessGroup = SINGLE_RANK
    token_shards: Optional[ProcessGroup] = None

    @classmethod
    def of(cls, groups: Any, comm_type: str) -> ContextParallel:
        """From :class:`lptrain.distributed.groups.ParallelGroups`."""
        return cls(groups.cp, comm_type, groups.cp_a2a, groups.cp_p2p, groups.token_shards)


class ContextParallelFactory:
    """The run's layer factory, except that the emulated backend's GEMM layers MAX-reduce the
    per-tensor amaxes of their sequence-split operands (``input``, ``grad``) over the CP group
    (see the module doc); every other attribute is the run factory's."""

    def __init__(self, base: Any, group: ProcessGroup) -> None:
        self.base = base
        self.group = group

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def linear(self, in_features: int, out_features: int, **kw: Any) -> nn.Module:
        if self.group.active and getattr(self.base, "backend", "emulated") != "te":
            kw["amax_reduction"] = {"input": self.group.pg, "grad": self.group.pg}
        return self.base.linear(in_features, out_features, **kw)


class ContextParallelRotary(nn.Module):
    """The rotary tables at this rank's chunks' true positions: ``forward(s)`` for the rank's
    ``s = seq / CP`` tokens gives rows ``[i c, (i+1) c)`` and ``[(2CP-1-i) c, (2CP-i) c)`` of
    the whole sequence's tables (``c = seq / 2CP``)."""

    def __init__(self, rotary: nn.Module, cp_size: int, cp_rank: int) -> None:
        super().__init__()
        self.inner = rotary
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self._index: dict[tuple[int, torch.device], torch.Tensor] = {}

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        key = (seq_len, device)
        if key not in self._index:
            ranges = cp_token_ranges(seq_len * self.cp_size, self.cp_size, self.cp_rank)
            self._index[key] = torch.cat([torch.arange(lo, hi, device=device) for lo, hi in ranges])
        return self._index[key]

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.inner(seq_len * self.cp_size)
        at = self.positions(seq_len, cos.device)
        return cos.index_select(0, at), sin.index_select(0, at)


class ContextParallelLoss(nn.Module):
    """The model's LM loss on this rank's chunks, divided by the token count of the whole
    sequences (this rank's count summed over the CP group, without gradient): the CP ranks'
    losses, and their gradients, add up to the CP = 1 loss's."""

    def __init__(self, inner: nn.Module, group: ProcessGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group
        self.vocab_size = getattr(inner, "vocab_size", None)

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.inner.logits(logits)  # type: ignore[operator]

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        count = (labels != IGNORE).sum()
        if self.group.active:
            dist.all_reduce(count, group=self.group.pg)
        return self.inner(logits, labels, token_count=count)


def parallelize_context(model: nn.Module, cp: ContextParallel) -> None:
    """Swap the attention cores, the rotary embedding, the loss and the routers' statistics
    group for their context-parallel versions (table in the module doc). The GEMM layers were
    built through a :class:`ContextParallelFactory`."""
    from lptrain.model.attention import SelfAttention
    from lptrain.model.moe.router import TopKRouter

    g = cp.group
    for module in list(model.modules()):
        if isinstance(module, SelfAttention):
            module.core_attention = cp_attention(cp.comm_type, g, cp.a2a, cp.p2p)
        elif isinstance(module, TopKRouter):
            module.token_group = cp.token_shards if cp.token_shards is not None else g
    model.rotary = ContextParallelRotary(model.rotary, g.size, g.rank)  # type: ignore[assignment]
    model.lm_loss = ContextParallelLoss(model.lm_loss, g)  # type: ignore[assignment]
    model.context_parallel = cp  # type: ignore[assignment]
