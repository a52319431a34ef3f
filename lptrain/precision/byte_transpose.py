"""Byte-matrix transposes for the CPU emulation's columnwise copies (same bytes as
``t.t().contiguous()``, measured faster in the ranges where each path is taken).

Per-tensor FP8 stores its columnwise data as the byte transpose of the rowwise data, and
NVFP4 transposes its columnwise scale bytes; torch's byte transpose is the slowest of its
transposes on the CPU, and which workaround pays depends on the shape.
"""

from __future__ import annotations

import torch

from .formats import GATHER_DECODE_ELEMS
from .scratch import host_shortcuts, operand

_TINY_TRANSPOSE = 1 << 13  # elements x threads up to which torch's byte transpose is fastest


def _int16_transpose_fits(t: torch.Tensor) -> bool:
    """Whether :func:`transposed_bytes` takes its int16 copy: a CPU byte tensor of a small
    model's operand size (``_TINY_TRANSPOSE`` < elements x threads <= ``GATHER_DECODE_ELEMS``)
    with at most 256 columns (K = 64-256), where it measured ~1.5-2x faster than torch's
    byte transpose; outside that range it measured slower (fresh int16 pages, lost cache)."""
    if not host_shortcuts(t):  # the device (and compiled) path: torch's transpose
        return False
    n = t.numel() * torch.get_num_threads()
    return t.element_size() == 1 and _TINY_TRANSPOSE < n <= GATHER_DECODE_ELEMS and t.shape[1] <= 256


def transposed_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t.t()`` as a fresh contiguous tensor (never a view of ``t``) for a 2-D tensor (per-tensor
    FP8 data): the strided read widened to int16 and narrowed back where
    :func:`_int16_transpose_fits`, else torch's transpose. Same bytes either way."""
    if _int16_transpose_fits(t):
        w = torch.empty(t.shape[1], t.shape[0], dtype=torch.int16, device=t.device)
        w.copy_(t.view(torch.uint8).t())
        return w.to(torch.uint8).view(t.dtype)
    return t.t().clone(memory_format=torch.contiguous_format)


def transposed_copy(t: torch.Tensor) -> torch.Tensor:
    """``t.t()`` as a fresh contiguous tensor (never a view of ``t``), same bits, for a 2-D
    tensor.

    Why: for the NVFP4 columnwise scales ([M/16, K] bytes: few rows, many columns) torch's CPU
    transpose moves a 4-byte element several times faster than a byte, so bytes with a row
    count divisible by 4 are first gathered four rows to an int32 word (row 4q+j in byte j,
    little-endian): the transposed words are then the transposed bytes, in a quarter of the
    elements (~1.2 -> ~0.55 ms at 4096^2). Not for square byte matrices (4096^2: 38 ms
    against torch's 22), nor tiny ones (``_TINY_TRANSPOSE``: torch's fixed cost is lowest);
    everything else goes through :func:`transposed_bytes` (a small model's few-column
    operands: its int16 copy)."""
    r, c = t.shape
    if (host_shortcuts(t) and t.element_size() == 1 and r % 4 == 0 and t.is_contiguous()
            and t.numel() * torch.get_num_threads() > _TINY_TRANSPOSE and not _int16_transpose_fits(t)):
        b = t.view(r // 4, 4, c)
        w = torch.empty(r // 4, c, dtype=torch.int32, device=t.device)
        w.copy_(b[:, 3])
        for j in (2, 1, 0):
            w.bitwise_left_shift_(operand(8, w)).bitwise_or_(b[:, j])
        return w.t().clone(memory_format=torch.contiguous_format).view(t.dtype)
    return transposed_bytes(t)
