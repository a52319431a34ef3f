"""Expert parameters under expert parallelism: their checkpoint form.

Each expert-parallel (EP) rank holds ``L = num_experts / EP`` experts under *local* parameter
names (``linear_fc1.weight`` ``[L, out, in]``, ``linear_fc1.weight<i>`` or
``local_experts.<i>.linear_fc1.weight``). Two things need the whole EP group:

* the **gradient norm**: the expert optimizer's norm (reduced over its expert-data-parallel
  shard group) covers this rank's experts only; the squared norms of the EP ranks (disjoint
  experts) are summed -- :class:`lptrain.optim.distributed.ExpertShardedMasterOptimizer`;
* the **checkpoint**: experts are saved once, under the canonical per-expert names of
  ``lptrain.model.state_dict_adapter`` (``...experts.linear_fc1.weight.<e>``, ``e`` the global
  index) -- :func:`global_expert_state` gathers every EP rank's experts into that form
  (identical on every rank), and :func:`local_expert_entries` picks this rank's experts back
  out, for any EP size and any of the three storage layouts.

Optimizer state follows the master: per-element tensors split/stack with it, scalars
(``step``) are the same for every expert of a parameter.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lptrain.distributed.groups import Group
from lptrain.model.state_dict_adapter import to_canonical

Entry = dict[str, torch.Tensor]
_EXPERT_INDEX = re.compile(r"^(?P<pre>.*\.)(?P<e>\d+)$")


def expert_offset(model: nn.Module) -> int:
    """Global index of this rank's local expert 0 (0 without expert parallelism)."""
    for m in model.modules():
        if hasattr(m, "expert_offset"):
            return int(m.expert_offset)
    return 0


def _canonical_names(name: str, shape: torch.Size, offset: int) -> list[str]:
    return list(to_canonical({name: torch.empty(shape, device="meta")}, expert_offset=offset))


def _split_entry(name: str, entry: Entry, offset: int) -> dict[str, Entry]:
    """One local expert param's full-state entry -> per-expert canonical entries."""
    master = entry["master"]
    keys = _canonical_names(name, master.shape, offset)
    out: dict[str, Entry] = {k: {} for k in keys}
    for field, v in entry.items():
        if v.dim() == 0:
            for k in keys:
                out[k][field] = v
        else:
            parts = list(to_canonical({name: v}, expert_offset=offset).values())
            for k, part in zip(keys, parts, strict=True):
                out[k][field] = part
    return out


def global_expert_state(full: Mapping[str, Entry], model: nn.Module, ep: Group) -> dict[str, Entry]:
    """``full`` (expert optimizer's ``full_state()``, local names) -> every expert of the
    model under canonical names, identical on every rank. Collective over ``ep``.

    Each rank fills its experts into zero tensors for all ``EP x L`` experts and one SUM
    all-reduce (MAX for scalars, equal everywhere) assembles them.
    """
    offset = expert_offset(model)
    mine: dict[str, Entry] = {}
    for name in sorted(full):
        mine.update(_split_entry(name, full[name], offset))
    if not ep.active:
        return mine
    local = _num_local(mine)
    out: dict[str, Entry] = {}
    for key, entry in mine.items():
        m = _EXPERT_INDEX.match(key)
        assert m is not None, key
        i = int(m["e"]) - offset
        for r in range(ep.size):
            other = f"{m['pre']}{r * local + i}"
            out[other] = {f: v.clone() if other == key else torch.zeros_like(v) for f, v in entry.items()}
    keys = sorted(out)
    fields = sorted(out[keys[0]]) if keys else []
    vectors = [out[k][f] for k in keys for f in fields if out[k][f].dim() > 0]
    scalars = [out[k][f] for k in keys for f in fields if out[k][f].dim() == 0]
    for tensors, op in ((vectors, dist.ReduceOp.SUM), (scalars, dist.ReduceOp.MAX)):
        if not tensors:
            continue
        flat = torch.cat([t.reshape(-1).double() for t in tensors])
        dist.all_reduce(flat, op=op, group=ep.pg)
        off = 0
        for t in tensors:
            t.copy_(flat[off : off + t.numel()].view_as(t))
            off += t.numel()
    return out


def _num_local(entries: Mapping[str, Entry]) -> int:
    """Local experts per layer: distinct expert indices of one (layer, fc) prefix."""
    per_prefix: dict[str, int] = {}
    for key in entries:
        m = _EXPERT_INDEX.match(key)
        assert m is not None, key
        per_prefix[m["pre"]] = per_prefix.get(m["pre"], 0) + 1
    counts = set(per_prefix.values())
    assert len(counts) == 1, f"uneven local expert counts {per_prefix}"
    return counts.pop()


def local_expert_entries(
    names_and_shapes: Sequence[tuple[str, torch.Size]],
    model_sd: Mapping[str, torch.Tensor],
    optim_sd: Mapping[str, Mapping[str, torch.Tensor]],
    offset: int,
) -> dict[str, Entry]:
    """Inverse of :func:`global_expert_state` for this rank: ``{local name: {"master", ...}}``
    from canonical ``model_sd`` / ``optim_sd`` (any EP size and layout they were saved with).

    A checkpoint holding the local name itself (saved before canonical expert names) is
    taken as it is.
    """
    out: dict[str, Entry] = {}
    for name, shape in names_and_shapes:
        if name in model_sd:
            out[name] = {"master": model_sd[name], **optim_sd.get(name, {})}
            continue
        keys = _canonical_names(name, shape, offset)
        missing = [k for k in keys if k not in model_sd]
        if missing:
            raise KeyError(
                f"checkpoint has no expert weight {missing[0]!r} (for {name!r}); it holds "
                f"{sum(1 for k in model_sd if _EXPERT_INDEX.match(k))} per-expert entries: was it "
                "saved with more experts than this model's model.moe.num_experts?"
            )
        entry: Entry = {"master": torch.stack([model_sd[k].reshape(-1) for k in keys]).reshape(shape)}
        states = [optim_sd.get(k, {}) for k in keys]
        for field, v in states[0].items():
            if v.dim() == 0:
                entry[field] = v
            else:
                entry[field] = torch.stack([s[field].reshape(-1) for s in states]).reshape(shape)
        out[name] = entry
    return out
