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
* ``stage_shards(entries, reduce_max)``: write this rank's master pieces into their staging
  slices; shard-quantizable params first MAX-reduce their partial amaxes (one collective for
  all of them) so every rank quantizes with the same scales.
* ``load_from_staging(p, staged)``: after a gather, make ``p`` hold ``staged`` (a no-op for an
  aliased plain param; the column-wise copy rebuilt for byte-gathered params; a
  requantization -- both orientations -- for the others).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import singledispatch
from typing import Optional

import torch

from lptrain.precision.tensors import QuantizedTensor


@singledispatch
def is_quantized(p: torch.Tensor) -> bool:
    return False


@is_quantized.register
def _(p: QuantizedTensor) -> bool:
    return True


@singledispatch
def staging_dtype(p: torch.Tensor) -> torch.dtype:
    return p.dtype


@staging_dtype.register
def _(p: QuantizedTensor) -> torch.dtype:
    return p.staging_dtype if p.shard_quantizable else p.dtype


@singledispatch
def high_precision_value(p: torch.Tensor) -> torch.Tensor:
    return p.detach().float()


@high_precision_value.register
def _(p: QuantizedTensor) -> torch.Tensor:
    init = p.high_precision_init_value()
    value = (init if init is not None else p.dequantize()).detach().float()
    return value.to(p.device)


@singledispatch
def release_high_precision_init(p: torch.Tensor) -> None:
    """Free a kept init copy once masters hold it (no-op for plain params)."""


@release_high_precision_init.register
def _(p: QuantizedTensor) -> None:
    p.clear_high_precision_init_value()


@singledispatch
def place_in_buffer(p: torch.Tensor, view: torch.Tensor) -> bool:
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
    if p.data_ptr() != staged.data_ptr():
        with torch.no_grad():
            p.copy_(staged.view(p.shape))


@load_from_staging.register
def _(p: QuantizedTensor, staged: torch.Tensor) -> None:
    if staged.dtype == torch.uint8 and p.shard_quantizable:
        p.rebuild_columnwise()
    else:
        p.requantize_from(staged.view(p.shape))


StageEntry = tuple[torch.Tensor, Optional[torch.Tensor], int, int, Optional[torch.Tensor]]


def stage_shards(entries: Sequence[StageEntry], reduce_max: Callable[[torch.Tensor], None]) -> None:
    """Stage ``(param, master piece or None, lo, hi, staging slice or None)`` entries.

    Every rank must pass the same params in the same order (pieces may be None): the
    shard-quantizable ones join one MAX all-reduce of their partial amaxes.
    """
    byte = [e for e in entries if staging_dtype(e[0]) == torch.uint8]
    for _p, x, _lo, _hi, dst in entries:
        if x is not None and dst is not None and dst.dtype != torch.uint8:
            dst.copy_(x.reshape(-1))
    if not byte:
        return
    partial = [e[0].shard_amax(_to_logical(e[0], e[1]), e[2], e[3]) for e in byte]  # type: ignore[attr-defined]
    flat = torch.cat([a.reshape(-1) for a in partial])
    reduce_max(flat)
    off = 0
    for (p, x, lo, hi, dst), a in zip(byte, partial, strict=True):
        amax = flat[off : off + a.numel()].view_as(a)
        off += a.numel()
        q = p.shard_quantize(_to_logical(p, x), lo, hi, amax)  # type: ignore[attr-defined]
        if q is not None and dst is not None:
            dst.copy_(q.reshape(-1))


def _to_logical(p: torch.Tensor, x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """fp32 master -> the param's logical dtype (as a bf16 param would hold it)."""
    return None if x is None else x.reshape(-1).to(p.dtype)


def write_value(p: torch.Tensor, value: torch.Tensor) -> None:
    """Write a high-precision ``value`` into ``p`` (requantizing a quantized param)."""
    with torch.no_grad():
        p.copy_(value.view(p.shape).to(p.dtype))
