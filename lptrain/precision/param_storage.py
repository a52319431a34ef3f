"""What the data-parallel buffers and optimizers may ask of a parameter, whatever its format.

The buffer and optimizer code (lptrain/distributed, lptrain/optim) call only these functions;
each dispatches on the tensor type (plain ``torch.Tensor`` vs :class:`QuantizedTensor`), so a
new format changes nothing outside lptrain/precision.

* ``is_quantized(p)``: does ``p`` keep quantized primary storage (FP8/FP4 param gather)?
* ``staging_dtype(p)``: the dtype ``p`` travels in for the parameter all-gather: its own dtype
  for a plain param; uint8 for a shard-quantizable quantized param (per-tensor current
  scaling, 128x128 blockwise: bytes gathered as they are); the logical (high-precision)
  dtype for the other quantized params (MXFP8, NVFP4, delayed scaling, grouped), which every
  rank requantizes after the gather.
* ``high_precision_value(p)``: the value fp32 masters start from: the high-precision init
  value a quantized param kept at construction (then freed), never its dequantized bytes.
* ``place_in_buffer(p, view)``: make ``p``'s storage a view into a buffer slice when the format
  allows it (plain params: ``p.data`` aliases ``view``, checkable by ``data_ptr``); returns
  whether it did. Quantized params keep their own storage and are refreshed from the staged
  slice by ``load_from_staging``.
* ``stage_shards(entries, group)``: write this rank's master pieces into their staging
  slices; byte-gathered params are cast per family (``stage_bytes``), which first MAX-reduces
  the partial amaxes over ``group`` (one collective per family) so every rank quantizes with
  the same scales.
* ``release_storage(p)`` / ``restore_storage(p)``: sharded params (ZeRO-3) free a quantized
  param's data bytes between uses and give them back before the next gather refills them.
* ``load_from_staging(p, staged)``: after a gather, make ``p`` hold ``staged`` (a no-op for an
  aliased plain param; the column-wise copy rebuilt for byte-gathered params; a
  requantization -- both orientations -- for the others).
* ``storage_views(p)``: the raw buffers ``p`` holds, by name (what a bitwise snapshot copies;
  a quantized param's bytes and scales, not a dequantized value).

Transformer Engine's tensor classes answer through :mod:`lptrain.precision.te_storage`,
registered here the first time a tensor from ``transformer_engine`` arrives (so importing
lptrain never imports TE).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import singledispatch
from typing import Any, Optional

import torch
import torch.distributed as dist

from lptrain.precision.tensors import QuantizedTensor


def _registers_te(p: torch.Tensor) -> bool:
    """Whether ``p`` is a Transformer Engine tensor whose class now has its own answers
    (registered on first sight); the plain-tensor defaults then dispatch again."""
    if not type(p).__module__.startswith("transformer_engine"):
        return False
    from lptrain.precision import te_storage

    te_storage.register()
    return is_quantized.dispatch(type(p)) is not is_quantized.dispatch(torch.Tensor)


@singledispatch
def is_quantized(p: torch.Tensor) -> bool:
    return is_quantized(p) if _registers_te(p) else False


@is_quantized.register
def _(p: QuantizedTensor) -> bool:
    return True


@singledispatch
def staging_dtype(p: torch.Tensor) -> torch.dtype:
    return staging_dtype(p) if _registers_te(p) else p.dtype


@staging_dtype.register
def _(p: QuantizedTensor) -> torch.dtype:
    return p.staging_dtype if p.shard_quantizable else p.dtype


@singledispatch
def high_precision_value(p: torch.Tensor) -> torch.Tensor:
    return high_precision_value(p) if _registers_te(p) else p.detach().float()


@high_precision_value.register
def _(p: QuantizedTensor) -> torch.Tensor:
    init = p.high_precision_init_value()
    value = (init if init is not None else p.dequantize()).detach().float()
    return value.to(p.device)


@singledispatch
def release_high_precision_init(p: torch.Tensor) -> None:
    """Free a kept init copy once masters hold it (no-op for plain params)."""
    if _registers_te(p):
        release_high_precision_init(p)


@release_high_precision_init.register
def _(p: QuantizedTensor) -> None:
    p.clear_high_precision_init_value()


@singledispatch
def place_in_buffer(p: torch.Tensor, view: torch.Tensor) -> bool:
    if _registers_te(p):
        return place_in_buffer(p, view)
    view.copy_(p.detach().reshape(-1))
    p.data = view.view(p.shape)
    return True


@place_in_buffer.register
def _(p: QuantizedTensor, view: torch.Tensor) -> bool:
    if view.dtype == torch.uint8 and p.shard_quantizable:
        p.alias_rowwise_data(view)
        return True
    view.copy_(high_precision_value(p).reshape(-1).to(view.dtype))
    return False


@singledispatch
def load_from_staging(p: torch.Tensor, staged: torch.Tensor) -> None:
    if _registers_te(p):
        load_from_staging(p, staged)
    elif p.data_ptr() != staged.data_ptr():
        with torch.no_grad():
            p.copy_(staged.view(p.shape))


@load_from_staging.register
def _(p: QuantizedTensor, staged: torch.Tensor) -> None:
    if staged.dtype == torch.uint8 and p.shard_quantizable:
        p.rebuild_columnwise()
    else:
        p.requantize_from(staged.view(p.shape))


@singledispatch
def release_storage(p: torch.Tensor) -> None:
    """Sharded params (ZeRO-3): free what ``p`` holds besides its buffer view (a plain param
    lives in the bucket's full-param tensor, which the bucket frees itself: nothing here; a
    quantized param: its data bytes, scales kept). Undone by :func:`restore_storage`."""
    if _registers_te(p):
        release_storage(p)


@release_storage.register
def _(p: QuantizedTensor) -> None:
    p.release_data()


@singledispatch
def restore_storage(p: torch.Tensor) -> None:
    """Give ``p`` back the storage :func:`release_storage` freed, before it is refilled by
    :func:`load_from_staging` after the bucket's gather."""
    if _registers_te(p):
        restore_storage(p)


@restore_storage.register
def _(p: QuantizedTensor) -> None:
    p.restore_data()


StageEntry = tuple[torch.Tensor, Optional[torch.Tensor], int, int, Optional[torch.Tensor]]


class StagePlan:
    """:func:`stage_shards` worked out once for a fixed list of entries (the optimizer's
    pieces and staging slices do not change during a run): the plain pieces as one batched
    cast-and-copy, the byte-gathered ones per family."""

    def __init__(self, entries: Sequence[StageEntry]) -> None:
        families: dict[type, list[StageEntry]] = {}
        self.dsts: list[torch.Tensor] = []
        self.srcs: list[torch.Tensor] = []
        for e in entries:
            p, x, _lo, _hi, dst = e
            if staging_dtype(p) == torch.uint8:
                families.setdefault(type(p), []).append(e)
            elif x is not None and dst is not None:
                self.dsts.append(dst)
                self.srcs.append(x.reshape(-1))
        self.families = list(families.values())

    def run(self, group: Optional[Any]) -> None:
        if self.dsts:  # elementwise, round to nearest even: bitwise the per-slice copies
            torch._foreach_copy_(self.dsts, self.srcs)
        for family in self.families:
            stage_bytes(family[0][0], family, group)


def stage_shards(entries: Sequence[StageEntry], group: Optional[Any]) -> None:
    """Stage ``(param, master piece or None, lo, hi, staging slice or None)`` entries.

    Every rank must pass the same params in the same order (pieces may be None): the
    byte-gathered ones of each family are cast together (:func:`stage_bytes`: one MAX
    all-reduce of their partial amaxes over ``group``; None when this rank is alone).
    A caller staging the same entries every step keeps a :class:`StagePlan` instead.
    """
    StagePlan(entries).run(group)


@singledispatch
def stage_bytes(p: torch.Tensor, entries: Sequence[StageEntry], group: Optional[Any]) -> None:
    """Cast the master shards of byte-gathered params of ``p``'s family into their bytes."""
    if _registers_te(p):
        stage_bytes(p, entries, group)
        return
    raise TypeError(f"{type(p).__name__} is not gathered as bytes")


@stage_bytes.register
def _(p: QuantizedTensor, entries: Sequence[StageEntry], group: Optional[Any]) -> None:
    partial = [e[0].shard_amax(_to_logical(e[0], e[1]), e[2], e[3]) for e in entries]  # type: ignore[attr-defined]
    flat = torch.cat([a.reshape(-1) for a in partial])
    if group is not None:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    _reduce_over_shards(entries, partial, flat)
    off = 0
    for (q, x, lo, hi, dst), a in zip(entries, partial, strict=True):
        amax = flat[off : off + a.numel()].view_as(a)
        off += a.numel()
        out = q.shard_quantize(_to_logical(q, x), lo, hi, amax)  # type: ignore[attr-defined]
        if out is not None and dst is not None:
            dst.copy_(out.reshape(-1))


def _reduce_over_shards(entries: Sequence[StageEntry], partial: Sequence[torch.Tensor],
                        flat: torch.Tensor) -> None:
    """A tensor-parallel shard's per-tensor amax covers its slice of the whole weight: MAX it
    over the weight's amax-reduction group too (one collective per group, in entry order,
    which every rank of the group shares), so its bytes equal the whole tensor's slice."""
    by_group: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
    off = 0
    for (q, *_), a in zip(entries, partial, strict=True):
        g = getattr(q.quantizer, "amax_reduction", None)
        if g is not None and not callable(g):
            by_group.setdefault(id(g), (g, []))[1].append((off, a.numel()))
        off += a.numel()
    for g, spans in by_group.values():
        part = torch.cat([flat[o : o + n] for o, n in spans])
        dist.all_reduce(part, op=dist.ReduceOp.MAX, group=g)
        at = 0
        for o, n in spans:
            flat[o : o + n] = part[at : at + n]
            at += n


@singledispatch
def storage_bytes(p: torch.Tensor) -> int:
    """Bytes ``p`` holds (a quantized param: its data and scales, every kept orientation)."""
    if _registers_te(p):
        return storage_bytes(p)
    return p.numel() * p.element_size()


@storage_bytes.register
def _(p: QuantizedTensor) -> int:
    return p.nbytes()


@singledispatch
def storage_views(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every raw buffer ``p`` holds, by name, as views (a plain param: its values; a quantized
    one: its data and scales as stored, never a dequantized copy). What a bitwise snapshot
    copies (``lptrain.testing.parity``)."""
    if _registers_te(p):
        return storage_views(p)
    return {"value": p.detach()}


@storage_views.register
def _(p: QuantizedTensor) -> dict[str, torch.Tensor]:
    return p.storage_views()


@singledispatch
def grouped_members(p: torch.Tensor) -> list[torch.Tensor]:
    """The per-member tensors of a grouped ``[N, ...]`` weight (views of its storage): a
    plain tensor unbound along dim 0; a grouped quantized tensor's own member views (still
    quantized, each bit-identical to a discretely quantized member)."""
    if _registers_te(p):
        return grouped_members(p)
    return list(p.unbind(0))


@grouped_members.register
def _(p: QuantizedTensor) -> list[torch.Tensor]:
    members = getattr(p, "members", None)
    return list(members()) if callable(members) else list(p.unbind(0))


def _to_logical(p: torch.Tensor, x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """fp32 master -> the param's logical dtype (as a bf16 param would hold it)."""
    return None if x is None else x.reshape(-1).to(p.dtype)


def write_value(p: torch.Tensor, value: torch.Tensor) -> None:
    """Write a high-precision ``value`` into ``p`` (requantizing a quantized param)."""
    with torch.no_grad():
        p.copy_(value.view(p.shape).to(p.dtype))


def load_all_from_staging(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """:func:`load_from_staging` for a bucket's ``(param, staged slice)`` pairs: a plain param
    that aliases its slice (the common case) is skipped without a dispatch."""
    for p, staged in pairs:
        if _is_plain(p):
            if p.data_ptr() != staged.data_ptr():
                with torch.no_grad():
                    p.copy_(staged.view(p.shape))
        else:
            load_from_staging(p, staged)


def load_parts_from_staging(targets: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]]) -> None:
    """:func:`load_from_staging` for ``(param, staged parts)`` pairs whose parts, concatenated
    in order, are the param's staged value (a grouped weight's members gathered from several
    ranks). Plain params take every part in one batched copy straight into their member
    views (no concatenation; a copy either way, so bitwise the per-param load); the others
    load the concatenated value through their format."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    with torch.no_grad():
        for p, parts in targets:
            if _is_plain(p):
                flat = p.view(-1)
                off = 0
                for part in parts:
                    dsts.append(flat[off : off + part.numel()])
                    srcs.append(part)
                    off += part.numel()
            else:
                value = parts[0] if len(parts) == 1 else torch.cat(list(parts))
                load_from_staging(p, value.view(p.shape))
        if dsts:
            torch._foreach_copy_(dsts, srcs)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _is_plain(p: torch.Tensor) -> bool:
    """Whether ``p`` is an ordinary tensor: exactly torch's own type. Every quantized param,
    lptrain's and TE's, is a subclass (``nn.Parameter`` keeps a subclass's type), so the
    type alone decides, without :func:`is_quantized`'s dispatch (a per-param cost each
    stage and gather)."""
    return type(p) in _PLAIN_TYPES


def write_values(params: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """:func:`write_value` for many params: the plain ones in one batched cast-and-copy
    (round to nearest even either way: bitwise the per-param writes), the others one by one
    through their format."""
    plain = [(p, v) for p, v in zip(params, values, strict=True) if _is_plain(p)]
    with torch.no_grad():
        if plain:
            torch._foreach_copy_([p for p, _ in plain], [v.view(p.shape) for p, v in plain])
    if len(plain) != len(params):
        for p, v in zip(params, values, strict=True):
            if not _is_plain(p):
                write_value(p, v)
