"""Layout-independent model state dicts: per-expert canonical keys.

Expert weights are stored three ways (see ``moe.experts``); checkpoints use one canonical
form, one tensor ``[out, in]`` per expert under its **global** expert index::

    single grouped : layers.L.mlp.experts.linear_fc1.weight       [E_local, out, in]
    discrete       : layers.L.mlp.experts.linear_fc1.weight<i>    [out, in]
    sequential     : layers.L.mlp.experts.local_experts.<i>.linear_fc1.weight
    canonical      : layers.L.mlp.experts.linear_fc1.weight.<e>   [out, in], e = offset + i

(the same for ``linear_fc2``). Every other key is unchanged. The conversion is exact
(pure views / stacks, no arithmetic; quantized primary weights keep their quantized
members, see ``_split_members``), so a checkpoint saved with one layout loads into the
other bit for bit. The canonical names are also the names the initialisation is seeded
from, so canonical initial weights do not depend on the layout or the expert-parallel size.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

_SEQUENTIAL = re.compile(r"^(?P<pre>(?:.*\.)?experts\.)local_experts\.(?P<i>\d+)\.(?P<fc>linear_fc[12])\.weight$")
_DISCRETE = re.compile(r"^(?P<pre>(?:.*\.)?experts\.)(?P<fc>linear_fc[12])\.weight(?P<i>\d+)$")
_SINGLE = re.compile(r"^(?P<pre>(?:.*\.)?experts\.)(?P<fc>linear_fc[12])\.weight$")


def _canonical_key(pre: str, fc: str, expert: int) -> str:
    return f"{pre}{fc}.weight.{expert}"


def _split_members(value: torch.Tensor) -> list[torch.Tensor]:
    """Per-expert members of a grouped value (:func:`grouped_members`: a quantized grouped
    weight's own member views, TE's included; a plain tensor unbound along dim 0)."""
    from lptrain.precision.param_storage import grouped_members

    return grouped_members(value)


def _group_members(members: list[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_split_members`` shaped like ``target`` (the model's grouped param)."""
    from_members = getattr(type(target), "from_members", None)
    if from_members is not None and all(hasattr(m, "dequantize") for m in members):
        return from_members(members)
    plain = [m.dequantize() if hasattr(m, "dequantize") else m for m in members]
    return torch.stack(plain, dim=0)


def to_canonical(sd: Mapping[str, torch.Tensor], expert_offset: int = 0) -> dict[str, torch.Tensor]:
    """Per-expert canonical copy of ``sd`` (values are views of ``sd``'s tensors).

    ``expert_offset`` is the global index of this rank's local expert 0 (expert parallel).
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        m = _SEQUENTIAL.match(key) or _DISCRETE.match(key)
        if m:
            out[_canonical_key(m["pre"], m["fc"], expert_offset + int(m["i"]))] = value
            continue
        m = _SINGLE.match(key)
        if m and value.dim() == 3:
            for i, member in enumerate(_split_members(value)):
                out[_canonical_key(m["pre"], m["fc"], expert_offset + i)] = member
            continue
        out[key] = value
    return out


def _expert_offset(model: nn.Module, pre: str) -> int:
    return int(getattr(model.get_submodule(pre.rstrip(".")), "expert_offset", 0))


def from_canonical(sd: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A state dict in ``model``'s own layout built from canonical ``sd``.

    Only the experts ``model`` holds are taken (an expert-parallel rank picks its slice of a
    full checkpoint); a missing key raises ``KeyError`` naming it.
    """
    out: dict[str, torch.Tensor] = {}
    for key, target in model.state_dict().items():
        m = _SEQUENTIAL.match(key) or _DISCRETE.match(key)
        if m:
            e = _expert_offset(model, m["pre"]) + int(m["i"])
            out[key] = sd[_canonical_key(m["pre"], m["fc"], e)]
            continue
        m = _SINGLE.match(key)
        if m and target.dim() == 3:
            off = _expert_offset(model, m["pre"])
            members = [sd[_canonical_key(m["pre"], m["fc"], off + i)] for i in range(target.shape[0])]
            out[key] = _group_members(members, target)
            continue
        out[key] = sd[key]
    return out


def canonical_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` in canonical form (uses the model's expert offset)."""
    offset = 0
    for m in model.modules():
        if hasattr(m, "expert_offset"):
            offset = int(m.expert_offset)
            break
    return to_canonical(model.state_dict(), expert_offset=offset)


def load_canonical_state_dict(model: nn.Module, sd: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Load a canonical state dict into ``model`` whatever its expert layout."""
    model.load_state_dict(from_canonical(sd, model), strict=strict)
