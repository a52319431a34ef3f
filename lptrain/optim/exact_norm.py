"""A sum of squares that depends on the set of elements only: not on how they are cut into
shards, buckets, ranks or pipeline stages, nor on the order they are added in.

Why: the distributed optimizer cuts every bucket into equal data-parallel shards, so a
parameter straddling two shards is split at a position the whole buffer layout decides.
Per-piece norms summed in any order then depend on those cuts, and the cuts differ with the
pipeline split (each stage has its own, smaller buffers): the gradient norm of a pipelined run
differed from the unpipelined one in its last bit, enough to move a clip coefficient. Here it
does not.

How (a binned summation in the style of Demmel and Nguyen's reproducible sums): every element
is squared exactly (an fp32 value squared fits the 53 bits of fp64), the largest square over
the world ``M < 2^e`` fixes a grid, and each square is cut, exactly, into :data:`BINS` parts
that are integer multiples of ``2^(e - 30)``, ``2^(e - 60)`` and ``2^(e - 90)``, at most
``2^30`` of each: the parts are summed as int64 per bin on each rank and over the world (exact
and associative), and the total is rounded to fp64 once. What is dropped -- the parts of each
square below ``2^(e - 90)`` -- is dropped element by element, the same way wherever the element
lives; it is below ``n 2^-90`` of the sum (``n`` the element count).

The cut of a value ``r`` to the grid ``u`` is ``q = (r + C) - C`` with ``C = 1.5 x 2^52 u``
(round to nearest, exact while ``|r| < 2^51 u``), then ``r - q`` is exact: the classic
error-free extraction.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

BINS = 3
WIDTH = 30  # bits per bin: an int64 bin holds 2^33 parts per rank without overflow


def local_stats(values: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``[largest finite square, has NaN, has inf]`` of this rank's values (fp64, for one
    MAX all-reduce over the world). The largest square is the square of the largest
    magnitude, taken on the values as they are (no copy)."""
    out = torch.zeros(3, dtype=torch.float64, device=device)
    for v in values:
        if v.numel():
            finite = torch.isfinite(v)
            top = torch.where(finite, v.abs(), 0).max().to(torch.float64)
            out[0] = torch.maximum(out[0], top * top)
            out[1] = torch.maximum(out[1], torch.isnan(v).any().to(torch.float64))
            out[2] = torch.maximum(out[2], torch.isinf(v).any().to(torch.float64))
    return out


def binned_counts(values: Sequence[torch.Tensor], largest: torch.Tensor) -> torch.Tensor:
    """``[BINS]`` int64: this rank's squares cut into the grid of the world's ``largest``
    square (a device tensor: nothing is read on the host). Each value is squared in fp64
    (exact), one tensor at a time."""
    device = largest.device
    counts = torch.zeros(BINS, dtype=torch.int64, device=device)
    e = torch.frexp(largest).exponent.to(torch.int32)  # largest < 2^e
    one = torch.ones((), dtype=torch.float64, device=device)
    for v in values:
        if not v.numel():
            continue
        r = v.reshape(-1).to(torch.float64).square()
        r = torch.where(torch.isfinite(r), r, 0.0)
        for k in range(BINS):
            u = torch.ldexp(one, e - (k + 1) * WIDTH)
            c = u * 1.5 * 2.0 ** 52
            q = (r + c) - c
            counts[k] += (q / u).to(torch.int64).sum()
            r = r - q
    return counts


def exact_sum(counts: Sequence[int], largest: float, has_nan: bool, has_inf: bool) -> float:
    """The world's sum from its bins (host side): the integer ``sum_k counts[k] 2^(W (BINS-1-k))``
    scaled by ``2^(e - BINS W)``, rounded to fp64 once."""
    if has_nan:
        return math.nan
    if has_inf:
        return math.inf
    if largest == 0.0:
        return 0.0
    e = math.frexp(largest)[1]
    n = 0
    for c in counts:
        n = (n << WIDTH) + int(c)
    return math.ldexp(float(n), e - BINS * WIDTH)


def world_square_sum(values: Sequence[torch.Tensor], device: torch.device,
                     group: Optional[Any] = None) -> float:
    """The sum of the squares of every rank's ``values`` (float tensors of any dtype up to
    fp32, each element on exactly one rank) over ``group`` (None: the world), reproducibly
    (see the module doc). Collective: two all-reduces (the largest square, then the bins)
    and one host read."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    stats = local_stats(values, device)
    if distributed:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    counts = binned_counts(values, stats[0])
    if distributed:
        dist.all_reduce(counts, group=group)
    # one host read: the stats' bits travel as int64 beside the counts
    packed = torch.cat([stats.view(torch.int64), counts]).tolist()
    largest, has_nan, has_inf = (struct.unpack("<d", struct.pack("<q", v))[0] for v in packed[:3])
    return exact_sum(packed[3:], largest, bool(has_nan), bool(has_inf))
