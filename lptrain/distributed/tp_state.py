"""Tensor-parallel parameters in checkpoints: saved as the logical whole, loaded at any TP.

Each tensor-parallel rank holds a shard of the TP-split weights (``param.tp_shard``: its
layout in the whole tensor). A checkpoint holds every parameter once, in its single-rank
(canonical) form -- the shards joined in rank order, the vocab rows past the single-rank
padding cut off -- so it is identical on every rank, has the shape a one-rank run saves,
and loads at any tensor-parallel (and data-parallel) size: :func:`global_tp_state` gathers
the shards of the masters and of every per-element optimizer state (moments, Muon's
momentum) over the tensor-parallel group; :func:`local_tp_entries` cuts this rank's shard
back out. Replicated parameters (norms, the router, the experts: whole on every TP rank)
pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lptrain.distributed.groups import Group
from lptrain.precision.collectives import all_gather_flat
from lptrain.precision.tensor_parallel import join_shards

Entry = dict[str, torch.Tensor]


def _shard_of(params: Mapping[str, nn.Parameter], name: str) -> object:
    p = params.get(name)
    return getattr(p, "tp_shard", None) if p is not None else None


def global_tp_state(full: Mapping[str, Entry], params: Mapping[str, nn.Parameter], tp: Group) -> dict[str, Entry]:
    """``full`` (an optimizer child's ``full_state()``: this rank's shards) with every
    tensor-parallel entry replaced by its canonical whole. Collective over ``tp``: one
    all-gather per dtype of every sharded tensor, in name order (the same on every TP rank)."""
    out = {name: dict(entry) for name, entry in full.items()}
    if not tp.active:
        return out
    todo = [(name, f) for name in sorted(out) if _shard_of(params, name) is not None
            for f in sorted(out[name]) if out[name][f].dim() > 0]
    by_dtype: dict[torch.dtype, list[tuple[str, str]]] = {}
    for name, f in todo:
        by_dtype.setdefault(out[name][f].dtype, []).append((name, f))
    for dtype in sorted(by_dtype, key=str):
        items = by_dtype[dtype]
        flat = torch.cat([out[n][f].reshape(-1) for n, f in items])
        gathered = torch.empty(tp.size * flat.numel(), dtype=dtype, device=flat.device)
        all_gather_flat(gathered, flat, group=tp.pg)
        parts = gathered.view(tp.size, -1)
        off = 0
        for n, f in items:
            local = out[n][f]
            k = local.numel()
            shards = [parts[r, off:off + k].view(local.shape) for r in range(tp.size)]
            shard = _shard_of(params, n)
            out[n][f] = shard.canonical(join_shards(shards, shard.layout)).clone()  # type: ignore[attr-defined]
            off += k
    return out


def local_tp_entries(entries: Mapping[str, Entry], params: Mapping[str, nn.Parameter]) -> dict[str, Entry]:
    """Inverse of :func:`global_tp_state` for this rank: each tensor-parallel entry's shard
    cut out of its canonical tensor (saved at any TP size; no communication)."""
    out: dict[str, Entry] = {}
    for name, entry in entries.items():
        shard = _shard_of(params, name)
        if shard is None:
            out[name] = dict(entry)
            continue
        shape = params[name].shape
        out[name] = {f: v if v.dim() == 0 else shard.shard_of_canonical(v, shape)  # type: ignore[attr-defined]
                     for f, v in entry.items()}
    return out
