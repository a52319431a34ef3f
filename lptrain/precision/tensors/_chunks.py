"""Row-chunked evaluation of the per-block quantization kernels.

Why: on CPU the cost of these memory-bound kernels is dominated by page-faulting fresh
full-size fp32 temporaries (``x * scale`` of a 4096x4096 tensor is a new 64 MiB buffer).
Running the same vectorised math over row chunks of ~2 MiB keeps every temporary small and
reused by the allocator, about halving quantization time. Chunks are whole blocks (``align``
rows), so results are bit-identical to one full-size evaluation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TARGET_ELEMS = 1 << 19  # ~2 MiB of fp32 per chunk


def map_row_chunks(
    fn: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], x: torch.Tensor, align: int = 1
) -> tuple[torch.Tensor, ...]:
    """Apply ``fn`` to row chunks of ``x`` [M, K] (multiples of ``align`` rows) and concatenate
    each of its outputs along dim 0."""
    return map_row_ranges(lambda c, _r0: fn(c), x, align)


def row_ranges(m: int, k: int, align: int = 1, target: int = 0) -> list[tuple[int, int]]:
    """The [r0, r1) row ranges :func:`map_row_ranges` evaluates for an [m, k] tensor (callers
    that write each chunk's result into preallocated outputs use the same chunking);
    ``target``: elements per chunk instead of :data:`TARGET_ELEMS`."""
    rows = max(align, ((target or TARGET_ELEMS) // max(k, 1)) // align * align)
    return [(r, min(m, r + rows)) for r in range(0, m, rows)] or [(0, 0)]


def map_row_ranges(
    fn: Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]], x: torch.Tensor, align: int = 1
) -> tuple[torch.Tensor, ...]:
    """:func:`map_row_chunks` where ``fn`` also gets the chunk's first row (to pick the
    matching rows of precomputed per-block data)."""
    m, k = x.shape
    rows = max(align, (TARGET_ELEMS // max(k, 1)) // align * align)
    if rows >= m:
        return fn(x, 0)
    parts = [fn(x[r : r + rows], r) for r in range(0, m, rows)]
    return tuple(torch.cat(group) for group in zip(*parts, strict=True))
