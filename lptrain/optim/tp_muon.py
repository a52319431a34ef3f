"""Newton-Schulz of tensor-parallel matrices: each TP rank holds a shard, NS needs the whole.

``optimizer.muon.tp_mode`` (Megatron-LM's ``muon_tp_mode`` names):

* ``duplicated``: the shards of the update's input (the momentum, or its Nesterov blend) are
  all-gathered over the tensor-parallel group, every TP rank orthogonalizes the whole matrix
  and keeps its slice (TP-fold redundant compute, one all-gather per matrix);
* ``distributed``: the matrices are dealt round-robin over the TP ranks; each matrix's shards
  are gathered on its one owner, which orthogonalizes it and scatters the slices back (the
  compute split TP ways; with the layer-wise optimizer, one owner per matrix over TP x DP).

Both run the same Newton-Schulz on the same whole matrix (the QKV split per head group
included: the gathered QKV weight is the single-rank one), so they give bitwise the same
update, and the same update as a single-rank run on that matrix. Matrices without a shard
(``tp_shard`` missing: replicated over TP) are orthogonalized locally.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lptrain.precision.tensor_parallel import TPShard, join_shards, take_shard

TP_MODES = ("duplicated", "distributed")


class TPOrthogonalizer:
    """Orthogonalizes one optimizer step's matrices in order, through their TP group.

    One instance per step (per Muon group): the ``distributed`` owner of a matrix is its
    position among the step's sharded matrices modulo TP, the same on every TP rank because
    every rank steps the same matrices in the same order (identical buffer layouts)."""

    def __init__(self, mode: str) -> None:
        if mode not in TP_MODES:
            raise ValueError(f"optimizer.muon.tp_mode={mode!r} must be one of {', '.join(TP_MODES)}")
        self.mode = mode
        self.count = 0

    def __call__(self, u: torch.Tensor, shard: TPShard, ortho: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        g = shard.group
        if not g.active:
            return ortho(u)
        index, self.count = self.count, self.count + 1
        if self.mode == "duplicated":
            return self._duplicated(u, shard, ortho)
        return self._distributed(u, shard, ortho, owner=index % g.size)

    @staticmethod
    def _duplicated(u: torch.Tensor, shard: TPShard, ortho: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        g = shard.group
        parts = [torch.empty_like(u) for _ in range(g.size)]
        dist.all_gather(parts, u.contiguous(), group=g.pg)
        whole = ortho(join_shards(parts, shard.layout))
        return take_shard(whole, shard.layout, g.size, g.rank)

    @staticmethod
    def _distributed(u: torch.Tensor, shard: TPShard, ortho: Callable[[torch.Tensor], torch.Tensor],
                     owner: int) -> torch.Tensor:
        g = shard.group
        ranks: Any = dist.get_process_group_ranks(g.pg)
        dst = ranks[owner]
        mine = g.rank == owner
        parts = [torch.empty_like(u) for _ in range(g.size)] if mine else None
        dist.gather(u.contiguous(), parts, dst=dst, group=g.pg)
        slices = None
        if mine:
            assert parts is not None
            whole = ortho(join_shards(parts, shard.layout))
            slices = [take_shard(whole, shard.layout, g.size, r) for r in range(g.size)]
        out = torch.empty(u.shape, dtype=torch.float32, device=u.device)
        dist.scatter(out, slices, src=dst, group=g.pg)
        return out
