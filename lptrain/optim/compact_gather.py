"""The param sync of a compact-layout Muon bucket (:class:`CompactGather`): each unit
travels from its owner to every rank in the param's transport dtype.

Split from :mod:`lptrain.optim.layerwise` (which plans ownership and steps the owned units)
because the gather is the bucket's ``param_sync_hook``, driven by the bucket state machine
(:mod:`lptrain.distributed.bucket_group`) rather than by the optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from lptrain.distributed.groups import Group
from lptrain.precision.collectives import all_gather_flat
from lptrain.precision.param_storage import load_parts_from_staging

if TYPE_CHECKING:
    from lptrain.optim.layerwise import MuonUnit

# Param sync strategy of the compact layout; gloo has no all-gather-v. "pad": one all-gather
# of per-rank packs padded to the largest, then trimmed; "broadcast": one broadcast per owner.
# bench/optim.py measures both (DP=2, tiny_cpu): see docs/muon.md for the figures.
GATHER_MODE = "pad"


def transport_dtype(p: torch.Tensor) -> torch.dtype:
    """Dtype a compact-layout param travels in: its logical dtype (bf16 for bf16 and FP8
    params, fp32 for fp32 params: a bf16 transport would round fp32 params every step)."""
    return p.dtype


def first_nonempty(per_rank: Sequence[Sequence[Any]]) -> Any:
    """The first entry of the first non-empty per-rank list (reading ``per_rank[0][0]``
    instead is an IndexError whenever rank 0 owns nothing in the bucket)."""
    for entries in per_rank:
        if entries:
            return entries[0]
    raise ValueError("no rank owns anything here")


class CompactGather:
    """Param sync of one compact-layout Muon bucket: whole units from their owners to all.

    Units are grouped by transport dtype (one collective each); within a group each rank's
    pack holds its owned units in buffer order. ``stage`` packs this rank's masters,
    ``start`` launches the collective(s), ``finish`` waits and loads every param of the
    bucket from the gathered values (owner included). Where each unit lands in the gathered
    packs is fixed by the ownership, so it is planned once here, not per step.
    """

    def __init__(self, bucket: Any, units: Sequence[MuonUnit], owners: dict[tuple[str, int], int],
                 params: dict[str, torch.Tensor], group: Group, mode: Optional[str] = None) -> None:
        self.bucket = bucket
        self.group = group
        self.params = params
        self.mode = mode or GATHER_MODE
        self.units = sorted(units, key=lambda u: u.lo)
        by_dtype: dict[torch.dtype, list[list[MuonUnit]]] = {}
        for u in self.units:
            per_rank = by_dtype.setdefault(transport_dtype(params[u.name]), [[] for _ in range(group.size)])
            per_rank[owners[u.key]].append(u)
        self.per_rank = list(by_dtype.values())
        # per dtype group: (elements each rank sends, the pack width = the largest)
        self._counts = [[sum(u.numel for u in us) for us in per_rank] for per_rank in self.per_rank]
        # per param, its members in order: (dtype group, owner rank, offset in the pack, numel)
        where: dict[str, list[tuple[int, int, int, int, int]]] = {}
        for gi, per_rank in enumerate(self.per_rank):
            for r, us in enumerate(per_rank):
                off = 0
                for u in us:
                    where.setdefault(u.name, []).append((u.member, gi, r, off, u.numel))
                    off += u.numel
        self._where = [(params[name], [w[1:] for w in sorted(ws)]) for name, ws in where.items()]
        self._send: list[torch.Tensor] = []
        self._recv: list[list[torch.Tensor]] = []
        self._handles: list[Any] = []
        self.in_flight = False

    def stage(self, masters: dict[tuple[str, int], torch.Tensor]) -> None:
        """Pack this rank's owned units (fp32 master -> transport dtype)."""
        self._send = []
        for per_rank, counts in zip(self.per_rank, self._counts, strict=True):
            p = self.params[first_nonempty(per_rank).name]
            send = torch.empty(max(counts), dtype=transport_dtype(p), device=p.device)
            mine, n = per_rank[self.group.rank], counts[self.group.rank]
            if mine:  # one batched copy (fp32 -> transport dtype), the same rounding as copy_
                dsts = list(send[:n].split([u.numel for u in mine]))
                torch._foreach_copy_(dsts, [masters[u.key].reshape(-1) for u in mine])
            send[n:].zero_()  # the pad of a shorter pack (gathered, never read)
            self._send.append(send)

    def start(self, *, async_op: bool) -> None:
        g = self.group
        self._recv, self._handles = [], []
        for counts, send in zip(self._counts, self._send, strict=True):
            if not g.active:
                self._recv.append([send])
            elif self.mode == "pad":
                out = torch.empty(g.size * send.numel(), dtype=send.dtype, device=send.device)
                self._handles.append(all_gather_flat(out, send, group=g.pg, async_op=async_op))
                self._recv.append(list(out.view(g.size, -1).unbind(0)))
            else:
                bufs = []
                for r, n in enumerate(counts):
                    buf = send[:n] if r == g.rank else torch.empty(n, dtype=send.dtype, device=send.device)
                    if n:
                        src = dist.get_global_rank(g.pg, r)
                        self._handles.append(dist.broadcast(buf, src=src, group=g.pg, async_op=async_op))
                    bufs.append(buf)
                self._recv.append(bufs)
        self.in_flight = True

    def finish(self) -> None:
        for h in self._handles:
            if h is not None:
                h.wait()
        self._handles = []
        recv = self._recv
        load_parts_from_staging([
            (p, [recv[gi][r][off : off + n] for gi, r, off, n in parts]) for p, parts in self._where
        ])
        self._recv = []
        self.in_flight = False
