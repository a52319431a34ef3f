"""Transposes, the multi-tensor ops and the master-weight partial casts.

* ``fp8_transpose(input, dtype, out=None)``: the byte transpose ``[K, *rest]`` of FP8 data
  (rebuilding a column-wise copy after a byte all-gather); ``swap_first_dims``.
* ``multi_tensor_scale(chunk, noop, [src, dst], scale)``: ``dst = src * scale`` per pair, the
  no-op flag set to 1 when a result is not finite (TE's overflow check);
  ``multi_tensor_compute_scale_and_scale_inv(chunk, noop, [amaxes, scales, scale_invs], max,
  pow2, eps)``: per tensor, TE's ``compute_scale_from_amax`` and its reciprocal.
* ``fp8_block_scaling_compute_partial_amax`` / ``fp8_block_scaling_partial_cast``: a
  data-parallel rank's flat shard (``start_offset`` into an ``[h, w]`` weight) of a 128x128
  block-scaled weight: the shard's per-block amaxes (max over the elements it holds), then
  its elements cast with their block's scale into the weight's row-wise bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from lptrain.precision import formats as F
from lptrain.precision import scaling as S

from .layouts import _fmt


def fp8_transpose(input: torch.Tensor, dtype: Any = None, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    shape = tuple(input.shape)
    k = shape[-1] if shape else 1
    t = input.reshape(-1, k).t().contiguous().reshape((k, *shape[:-1]) if shape else ())
    if out is None:
        return t
    with torch.no_grad():
        out.copy_(t.reshape(out.shape))
    return out


def swap_first_dims(tensor: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    t = tensor.transpose(0, 1).contiguous()
    if out is None:
        return t
    with torch.no_grad():
        out.copy_(t)
    return out


def multi_tensor_scale(chunk_size: int, noop: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]],
                       scale: float) -> None:
    with torch.no_grad():
        for src, dst in zip(*tensor_lists, strict=True):
            r = src.float() * float(scale)
            if not bool(torch.isfinite(r).all()):
                noop.fill_(1)
            dst.copy_(r.to(dst.dtype))


def multi_tensor_compute_scale_and_scale_inv(chunk_size: int, noop: torch.Tensor,
                                             tensor_lists: Sequence[Sequence[torch.Tensor]], max_fp8: float,
                                             force_pow_2_scales: bool = False, epsilon: float = 0.0) -> None:
    with torch.no_grad():
        for amax, scale, scale_inv in zip(*tensor_lists, strict=True):
            s = S.compute_scale_from_amax(amax.float(), float(max_fp8), bool(force_pow_2_scales), float(epsilon))
            scale.copy_(s.reshape(scale.shape))
            scale_inv.reshape(-1)[: s.numel()].copy_(torch.reciprocal(s).reshape(-1))


def _shard_blocks(n: int, h: int, w: int, start: int, block: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.arange(start, start + n, device=device)
    return idx // w // block, idx % w // block


def fp8_block_scaling_compute_partial_amax(tensor: torch.Tensor, amax: torch.Tensor, h: int, w: int,
                                           start_offset: int, block_len: int) -> None:
    with torch.no_grad():
        x = tensor.detach().reshape(-1).float().abs()
        br, bc = _shard_blocks(x.numel(), h, w, start_offset, block_len, x.device)
        flat = amax.reshape(amax.shape[0], -1)
        cols = flat.shape[1]
        grid = torch.zeros(flat.numel(), dtype=torch.float32, device=x.device)
        grid.scatter_reduce_(0, br * cols + bc, x, reduce="amax", include_self=True)
        flat.copy_(torch.maximum(flat, grid.view_as(flat)))


def fp8_block_scaling_partial_cast(inp: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, h: int, w: int,
                                   start_offset: int, block_len: int, out_dtype: Any) -> None:
    with torch.no_grad():
        x = inp.detach().reshape(-1).float()
        br, bc = _shard_blocks(x.numel(), h, w, start_offset, block_len, x.device)
        s = scale.reshape(scale.shape[0], -1)[br, bc]
        out.reshape(-1).copy_(F.cast_to_fp8(x * s, _fmt(out_dtype), inplace=True).reshape(-1))


def functions() -> dict[str, Any]:
    return {"fp8_transpose": fp8_transpose, "swap_first_dims": swap_first_dims,
            "multi_tensor_scale": multi_tensor_scale,
            "multi_tensor_compute_scale_and_scale_inv": multi_tensor_compute_scale_and_scale_inv,
            "fp8_block_scaling_compute_partial_amax": fp8_block_scaling_compute_partial_amax,
            "fp8_block_scaling_partial_cast": fp8_block_scaling_partial_cast}
