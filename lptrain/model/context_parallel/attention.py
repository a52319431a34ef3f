"""Context-parallel attention cores: what replaces :class:`lptrain.model.attention.CausalAttention`
(``q [b, heads, s, d]``, ``k``/``v [b, kv heads, s, d]`` -> ``[b, heads, s, d]``) when each rank
holds two chunks of every sequence (``model.cp_comm_type``):

* ``p2p`` -- :class:`RingAttention`: the keys and values go round the context-parallel ranks;
  each step sends the block it holds to the next rank while computing on it, and folds the
  block's result in by online softmax (:mod:`lptrain.model.context_parallel.kernels`). The
  backward sends the blocks round again, their key/value gradients travelling with them and
  arriving home after the last step.
* ``a2a`` -- :class:`UlyssesAttention` (DeepSpeed-Ulysses): an all-to-all turns "all heads,
  my chunks" into "my heads, every chunk"; the chunks are put in sequence order and the whole
  causal attention runs there (the same kernel as at CP 1), then the inverse all-to-all.
* ``allgather`` -- :class:`AllGatherAttention`: keys and values are all-gathered over the
  context-parallel ranks; the rank's queries attend under a mask by their true positions.
* ``a2a+p2p`` -- :class:`HierarchicalAttention`: all-to-all inside the first level of
  ``model.hierarchical_context_parallel_sizes`` (a node), ring attention across the second.

All of them are plain PyTorch over ``torch.distributed``: they run on both backends (on
Transformer Engine the GEMM layers around them are TE's, the attention is lptrain's, as
without context parallelism).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lptrain.catalog.parallel_dims import cp_chunk_ids
from lptrain.model.context_parallel.comm import RingExchange, all_gather_seq, all_to_all
from lptrain.model.context_parallel.kernels import (
    block_backward,
    block_forward,
    expand_kv,
    fold_kv,
    merge,
)

_KV_TAG, _DKV_TAG = 7, 8


def _group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` in group order (none for a single-rank group)."""
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group.pg)) if group.active else []


class _Ring(torch.autograd.Function):
    """Ring attention over ``ring`` (see the module doc); ``ids[j]`` are the chunk ids of ring
    rank ``j``'s sequence, ``c`` the chunk length."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Any,  # type: ignore[override]
                ranks: list[int], ids: list[tuple[int, ...]], c: int) -> torch.Tensor:
        n, r = ring.size, ring.rank
        heads, scale = q.shape[1], 1.0 / math.sqrt(q.shape[-1])
        qf = q.float()
        kv = torch.stack([k, v])
        out = lse = None
        for step in range(n):
            src = (r - step) % n
            nxt = RingExchange(kv, ring, ranks, _KV_TAG) if step < n - 1 else None
            o, m = block_forward(qf, expand_kv(kv[0].float(), heads), expand_kv(kv[1].float(), heads),
                                 ids[r], ids[src], c, scale)
            out, lse = (o, m) if out is None else merge(out, lse, o, m)  # type: ignore[arg-type]
            if nxt is not None:
                kv = nxt.wait()
        assert out is not None and lse is not None
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.ranks, ctx.ids, ctx.c = ring, ranks, ids, c
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        ring, ranks, ids, c = ctx.ring, ctx.ranks, ctx.ids, ctx.c
        n, r = ring.size, ring.rank
        heads, groups, scale = q.shape[1], k.shape[1], 1.0 / math.sqrt(q.shape[-1])
        qf, do = q.float(), dout.float()
        delta = (do * out).sum(dim=-1)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v])
        moving = None  # the (dk, dv) of the block held, arriving from the previous rank
        for step in range(n):
            src = (r - step) % n
            nxt = RingExchange(kv, ring, ranks, _KV_TAG) if step < n - 1 else None
            dqs, dks, dvs = block_backward(qf, expand_kv(kv[0].float(), heads),
                                           expand_kv(kv[1].float(), heads), do, lse, delta,
                                           ids[r], ids[src], c, scale)
            dq += dqs
            mine = torch.stack([fold_kv(dks, groups), fold_kv(dvs, groups)])
            if n == 1:
                return (dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None, None, None)
            acc = mine if moving is None else moving.wait() + mine
            # the gradient goes on with its block (the last step sends it home)
            moving = RingExchange(acc, ring, ranks, _DKV_TAG)
            if nxt is not None:
                kv = nxt.wait()
        assert moving is not None
        dkv = moving.wait()
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Any, ranks: list[int],
                   ids: list[tuple[int, ...]], c: int) -> torch.Tensor:
    return _Ring.apply(q, k, v, ring, ranks, ids, c)


def _positions(ids: Sequence[int], c: int, device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in ids])


class RingAttention(nn.Module):
    """``p2p``: ring attention over the context-parallel group (module doc)."""

    def __init__(self, cp: Any) -> None:
        super().__init__()
        self.cp = cp
        self.ranks = _group_ranks(cp)
        self.ids = [cp_chunk_ids(cp.size, j) for j in range(cp.size)]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.cp, self.ranks, self.ids, q.shape[2] // 2)


def _natural_order(ids: Sequence[int], c: int, device: torch.device) -> torch.Tensor:
    """Token indices that put a sequence of chunks ``ids`` (of ``c`` tokens) in position order."""
    return torch.argsort(_positions(ids, c, device))


class UlyssesAttention(nn.Module):
    """``a2a``: heads swapped for sequence over the context-parallel group (module doc)."""

    def __init__(self, cp: Any) -> None:
        super().__init__()
        self.cp = cp
        # the sequence after the all-to-all: every rank's chunks, in rank order
        self.ids = [i for j in range(cp.size) for i in cp_chunk_ids(cp.size, j)]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g = self.cp
        c = q.shape[2] // 2
        q, k, v = (all_to_all(t, g, 1, 2) for t in (q, k, v))  # my heads, every chunk
        order = _natural_order(self.ids, c, q.device)
        q, k, v = (t.index_select(2, order) for t in (q, k, v))
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.index_select(2, torch.argsort(order))
        return all_to_all(o, g, 2, 1)  # back to all heads, my chunks


class AllGatherAttention(nn.Module):
    """``allgather``: keys and values gathered over the context-parallel group (module doc)."""

    def __init__(self, cp: Any) -> None:
        super().__init__()
        self.cp = cp
        self.mine = cp_chunk_ids(cp.size, cp.rank)
        self.ids = [i for j in range(cp.size) for i in cp_chunk_ids(cp.size, j)]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c = q.shape[2] // 2
        k, v = all_gather_seq(k, self.cp, 2), all_gather_seq(v, self.cp, 2)
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        mask = _positions(self.mine, c, q.device)[:, None] >= _positions(self.ids, c, q.device)[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class HierarchicalAttention(nn.Module):
    """``a2a+p2p``: all-to-all inside each ``a2a`` group, ring attention over the ``p2p``
    groups (module doc). ``a2a`` holds ``a`` consecutive CP ranks, ``p2p`` the ranks ``a``
    apart (:meth:`lptrain.catalog.parallel_dims.ParallelDims.cp_levels`)."""

    def __init__(self, cp: Any, a2a: Any, p2p: Any) -> None:
        super().__init__()
        self.a2a, self.p2p = a2a, p2p
        self.ranks = _group_ranks(p2p)
        a = a2a.size

        def inner(o: int) -> tuple[int, ...]:  # the chunks of the a2a group at ring index o
            return tuple(i for m in range(a) for i in cp_chunk_ids(cp.size, o * a + m))

        self.ids = [inner(o) for o in range(p2p.size)]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c = q.shape[2] // 2
        q, k, v = (all_to_all(t, self.a2a, 1, 2) for t in (q, k, v))
        o = ring_attention(q, k, v, self.p2p, self.ranks, self.ids, c)
        return all_to_all(o, self.a2a, 2, 1)


def cp_attention(comm_type: str, cp: Any, a2a: Any = None, p2p: Any = None) -> nn.Module:
    """The attention core of ``model.cp_comm_type``."""
    if comm_type == "p2p":
        return RingAttention(cp)
    if comm_type == "a2a":
        return UlyssesAttention(cp)
    if comm_type == "allgather":
        return AllGatherAttention(cp)
    if comm_type == "a2a+p2p":
        if a2a is None or p2p is None or not (a2a.active or p2p.active):
            raise ValueError("cp_comm_type=a2a+p2p needs the hierarchical context-parallel groups "
                             "(model.hierarchical_context_parallel_sizes)")
        return HierarchicalAttention(cp, a2a, p2p)
    raise ValueError(f"unknown cp_comm_type {comm_type!r}")
