"""The context-parallel collectives, as autograd functions, and their byte count.

Each one is the adjoint of another in its backward (as the tensor-parallel mappings of
:mod:`lptrain.precision.tensor_parallel`):

* :func:`all_to_all` (Ulysses): split one dimension into the group's parts, send part ``j`` to
  rank ``j`` and concatenate what arrives along another dimension; backward: the inverse
  all-to-all;
* :func:`all_gather_seq` (all-gather KV): every rank's tensor concatenated along the sequence
  in rank order; backward: reduce-scatter (each rank's gradient of the gathered tensor is a
  part of every owner's);
* :class:`RingExchange`: the ring attention's point-to-point step -- send to the next rank of
  the ring, receive from the previous one, asynchronously (the caller computes meanwhile).

:func:`count_cp_traffic` records the bytes every rank sends per kind (``p2p``, ``all_to_all``,
``all_gather``, ``reduce_scatter``): what ``bench/cp.py`` checks against the analytic count.
A collective's bytes are this rank's share of what it moves: ``(n - 1) / n`` of the gathered
tensor for an all-gather and a reduce-scatter, and of its input for an all-to-all (the part it
keeps stays put); a P2P send its whole tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from lptrain.precision.collectives import all_gather_flat, reduce_scatter_flat


@dataclass
class CPTraffic:
    """Bytes this rank sent through the context-parallel collectives, per kind, and calls."""

    bytes: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, n: int) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + int(n)
        self.calls[kind] = self.calls.get(kind, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


_TRAFFIC: list[CPTraffic] = []


@contextlib.contextmanager
def count_cp_traffic() -> Iterator[CPTraffic]:
    """Record every context-parallel collective of this process inside the context."""
    t = CPTraffic()
    _TRAFFIC.append(t)
    try:
        yield t
    finally:
        _TRAFFIC.remove(t)


def _record(kind: str, n: float) -> None:
    for t in _TRAFFIC:
        t.add(kind, int(n))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---- all-to-all -------------------------------------------------------------------------------


def _a2a(x: torch.Tensor, group: Any, split_dim: int, cat_dim: int) -> torch.Tensor:
    n = group.size
    if x.shape[split_dim] % n:
        raise ValueError(f"dimension {split_dim} of size {x.shape[split_dim]} does not split over "
                         f"{n} context-parallel ranks")
    # [n, ...]: part j of split_dim first, so the flat all-to-all sends part j to rank j
    parts = x.unflatten(split_dim, (n, x.shape[split_dim] // n)).movedim(split_dim, 0).contiguous()
    out = torch.empty_like(parts)
    _record("all_to_all", _nbytes(parts) * (n - 1) / n)
    dist.all_to_all_single(out, parts, group=group.pg)
    # out[j] is rank j's part; rank order along cat_dim (cat_dim counted without the part dim)
    out = out.movedim(0, cat_dim)
    return out.flatten(cat_dim, cat_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, split_dim: int, cat_dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.split_dim, ctx.cat_dim = group, split_dim, cat_dim
        return _a2a(x, group, split_dim, cat_dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return _a2a(g, ctx.group, ctx.cat_dim, ctx.split_dim), None, None, None


def all_to_all(x: torch.Tensor, group: Any, split_dim: int, cat_dim: int) -> torch.Tensor:
    """``x`` split along ``split_dim`` over the group's ranks, the parts received from every
    rank concatenated along ``cat_dim`` in rank order (autograd: the inverse all-to-all)."""
    return _AllToAll.apply(x, group, split_dim, cat_dim) if group.active else x


# ---- all-gather along the sequence --------------------------------------------------------------


def _gather(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    n = group.size
    parts = x.movedim(dim, 0).contiguous()
    out = parts.new_empty((n, *parts.shape))
    _record("all_gather", _nbytes(out) * (n - 1) / n)
    all_gather_flat(out.view(-1), parts.view(-1), group=group.pg)
    return out.flatten(0, 1).movedim(0, dim)


def _reduce_scatter(g: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    n = group.size
    whole = g.movedim(dim, 0).contiguous()
    out = whole.new_empty((whole.shape[0] // n, *whole.shape[1:]))
    _record("reduce_scatter", _nbytes(whole) * (n - 1) / n)
    reduce_scatter_flat(out.view(-1), whole.view(-1), group=group.pg)
    return out.movedim(0, dim)


class _AllGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return _reduce_scatter(g, ctx.group, ctx.dim), None, None


def all_gather_seq(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (autograd: the gradient is
    reduce-scattered back to the owners)."""
    return _AllGatherSeq.apply(x, group, dim) if group.active else x


# ---- the ring's point-to-point step -------------------------------------------------------------


class RingExchange:
    """Send ``tensor`` to the next rank of ``group``'s ring and receive the previous rank's
    (same shape and dtype) without waiting: :meth:`wait` returns what arrived. Both sends of a
    step are posted before the caller computes on what it already holds, so the transfer runs
    under that compute (the ring attention's overlap). The send and the receive go out as one
    batch (``batch_isend_irecv``): with NCCL, two ranks that each posted a lone send to the
    other first would wait for each other's receive."""

    def __init__(self, tensor: torch.Tensor, group: Any, ranks: list[int], tag: int = 0) -> None:
        n, r = group.size, group.rank
        self.out = torch.empty_like(tensor)
        nxt, prev = ranks[(r + 1) % n], ranks[(r - 1) % n]
        _record("p2p", _nbytes(tensor))
        send = tensor.contiguous()
        self._keep = send  # (alive until the send completes)
        self._works: list[Optional[Any]] = list(dist.batch_isend_irecv([
            dist.P2POp(dist.isend, send, nxt, group.pg, tag),
            dist.P2POp(dist.irecv, self.out, prev, group.pg, tag),
        ]))

    def wait(self) -> torch.Tensor:
        for w in self._works:
            if w is not None:
                w.wait()
        self._works = []
        return self.out


def cp_attention_traffic(comm_type: str, *, cp: int, batch: int, local_tokens: int, heads: int,
                         kv_heads: int, head_dim: int, itemsize: int, a2a: int = 1) -> int:
    """Bytes one rank sends for one attention layer's forward and backward of one
    micro-batch (what :func:`count_cp_traffic` counts), by comm type. ``local_tokens`` is the
    rank's ``seq / CP``; ``heads`` and ``kv_heads`` those of the rank (``/ TP``); ``itemsize``
    the activation dtype's bytes (the ring's key/value gradients travel in fp32); ``a2a`` the
    first level of ``a2a+p2p``.

    * ``p2p``: the keys and values (``2 b g s_r d``) go round the ring, ``CP - 1`` hops forward
      and again backward, their fp32 gradients ``CP`` hops (the last one home);
    * ``a2a``: q, k, v and the output, and their gradients, each all-to-all'd once: a rank
      sends ``(CP - 1) / CP`` of each;
    * ``allgather``: k and v all-gathered forward, their gradients reduce-scattered backward:
      ``(CP - 1)`` of the rank's part each way;
    * ``a2a+p2p``: the all-to-all inside the ``a2a`` level, then the ring over ``CP / a2a``
      ranks on ``a2a`` times the tokens and ``1 / a2a`` of the heads (as many bytes a hop).
    """
    b, s, n, g, d = batch, local_tokens, heads, kv_heads, head_dim
    kv = 2 * b * g * s * d
    if comm_type == "p2p":
        return (cp - 1) * kv * itemsize * 2 + cp * kv * 4
    if comm_type == "a2a":
        return 2 * (cp - 1) * b * s * d * (2 * n + 2 * g) * itemsize // cp
    if comm_type == "allgather":
        return 2 * (cp - 1) * kv * itemsize
    if comm_type == "a2a+p2p":
        ring = cp // a2a
        inner = cp_attention_traffic("a2a", cp=a2a, batch=b, local_tokens=s, heads=n, kv_heads=g,
                                     head_dim=d, itemsize=itemsize) if a2a > 1 else 0
        outer = cp_attention_traffic("p2p", cp=ring, batch=b, local_tokens=s * a2a, heads=n // a2a,
                                     kv_heads=g // a2a, head_dim=d, itemsize=itemsize) if ring > 1 else 0
        return inner + outer
    raise ValueError(f"unknown cp_comm_type {comm_type!r}")
