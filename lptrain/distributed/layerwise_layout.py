"""Layer-wise (Muon) distributed optimizer layouts: whole matrices on their owner.

Kept apart from :func:`lptrain.distributed.layout.plan_layout`, whose behaviour is
unchanged (it builds the non-Muon buffers here too). The layer-wise optimizer needs whole
matrices on their owner, so its Muon buffers use one of two layouts:

* compact (default): no padding at all; grads are all-reduced and the owners' updated
  params are all-gathered unevenly (lptrain.optim.layerwise);
* padded: every whole param is placed inside one of the ``dp`` equal shards of its bucket
  (64-element aligned), so the bucket reduce-scatters and all-gathers exactly like a
  distributed-optimizer bucket, at the price of shard padding.

Both key Muon buffers by the param's *logical* dtype, not by quantized storage: with FP8
param gather, keying FP8 Muon params apart from bf16 ones (e.g. the router) split Muon grads
into two all-reduce buffers where FP8-param-gather-off has one, and a collective's fp32
summation order depends on the buffer it runs on (about 1 ULP, which Newton-Schulz amplifies
into visible loss drift).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch

from lptrain.distributed.layout import (
    BUCKET_END_ALIGN,
    PARAM_START_ALIGN,
    BucketSpec,
    BufferKey,
    BufferLayout,
    BufferSpec,
    ParamSlot,
    ParamSpec,
    align_up,
    layout_one_buffer,
    param_specs,
    shard_count,
)

PADDED_SHARD_CAP = 1.3  # a shard may fill up to 1.3x the bucket's mean shard load


def ns_cost(shape: Sequence[int]) -> int:
    """Newton-Schulz FLOPs proxy of one param: ``min^2 * max`` per matrix (times the number
    of grouped members of a 3-D ``[E, out, in]`` weight); numel for non-matrices."""
    if len(shape) < 2:
        return math.prod(shape)
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * m * m * n


def layer_wise_param_specs(
    named_params: Sequence[tuple[str, torch.Tensor]], *, grad_reduce_in_fp32: bool
) -> list[ParamSpec]:
    """:func:`param_specs` with Muon params separated and keyed by their logical dtype (FP8
    and bf16 Muon grads share one all-reduce buffer; see the section comment)."""
    specs = param_specs(named_params, grad_reduce_in_fp32=grad_reduce_in_fp32, separate_muon=True)
    out = []
    for spec, (_name, p) in zip(specs, named_params, strict=True):
        if spec.key.is_muon:
            spec = ParamSpec(
                spec.name,
                spec.shape,
                muon_buffer_key(spec.key, p.dtype),
                spec.shared_embedding,
            )
        out.append(spec)
    return out


def muon_buffer_key(key: BufferKey, logical_dtype: torch.dtype) -> BufferKey:
    """The buffer key of a layer-wise Muon param: logical dtype, never quantized storage."""
    return BufferKey(
        param_dtype=logical_dtype,
        grad_dtype=key.grad_dtype,
        quantized=False,
        is_expert=key.is_expert,
        is_muon=True,
    )


def plan_layer_wise_layout(
    specs: Sequence[ParamSpec],
    *,
    dp: int,
    bucket_size: Optional[int],
    sharded: bool,
    param_layout: str = "compact",
    expert_dp: Optional[int] = None,
) -> BufferLayout:
    """Like :func:`plan_layout` (same grouping and non-Muon buffers), with Muon buffers in
    the ``compact`` (no padding, replicated grads) or ``padded`` (shard-aligned whole params)
    layer-wise layout. Allocates nothing."""
    if param_layout not in ("compact", "padded"):
        raise ValueError(
            f"optimizer.layer_wise_param_layout={param_layout!r}: use compact or padded"
        )
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    by_key: dict[BufferKey, list[ParamSpec]] = {}
    for s in specs:
        by_key.setdefault(s.key, []).append(s)
    buffers = []
    for i, (key, group) in enumerate(by_key.items()):
        d = shard_count(key, dp, expert_dp)
        if key.is_muon and param_layout == "padded":
            buffers.append(_layout_padded_buffer(group, i, bucket_size=bucket_size, dp=d))
        else:
            buffers.append(
                layout_one_buffer(
                    group, i, bucket_size=bucket_size, dp=d, sharded=sharded and not key.is_muon
                )
            )
    return BufferLayout(buffers=buffers, dp=dp, strategy="optim" if sharded else "no_shard")


def _layout_padded_buffer(
    specs: Sequence[ParamSpec], buffer_index: int, *, bucket_size: Optional[int], dp: int
) -> BufferSpec:
    """Whole params packed into ``dp`` equal, 64-aligned shards per bucket (upstream's LPT
    rule: params by NS cost descending, each to the least cumulatively loaded shard among
    those still under ``PADDED_SHARD_CAP`` x the mean, else to the least-filled shard).

    A bucket closes once it holds ``max(bucket_size, 0.9 * dp * largest param)`` elements, so
    it has room for ``dp`` copies of its largest matrix and the imbalance stays bounded.
    """
    out = BufferSpec(key=specs[0].key, sharded=True)
    divisor = math.lcm(PARAM_START_ALIGN, math.lcm(dp, BUCKET_END_ALIGN) // dp)
    loads = [0] * dp  # cumulative NS cost per shard, kept across buckets
    chunks: list[list[ParamSpec]] = []
    current: list[ParamSpec] = []
    for p in reversed(specs):  # backprop order
        current.append(p)
        numel = sum(s.numel for s in current)
        largest = max(s.numel for s in current)
        target = max(bucket_size or 0, int(0.9 * dp * largest))
        if bucket_size is not None and numel >= target:
            chunks.append(current)
            current = []
    if current:
        chunks.append(current)
    bucket_start = 0
    for chunk in chunks:
        mean = sum(s.numel for s in chunk) / dp
        cursors = [0] * dp
        placed: list[tuple[ParamSpec, int, int]] = []  # spec, shard, offset
        for s in sorted(chunk, key=lambda s: (-ns_cost(s.shape), s.name)):
            fits = [
                r for r in range(dp)
                if align_up(cursors[r], PARAM_START_ALIGN) + s.numel <= PADDED_SHARD_CAP * mean
            ]
            if fits:
                r = min(fits, key=lambda r: (loads[r], r))
            else:
                r = min(range(dp), key=lambda r: (cursors[r], r))
            off = align_up(cursors[r], PARAM_START_ALIGN)
            placed.append((s, r, off))
            cursors[r] = off + s.numel
            loads[r] += ns_cost(s.shape)
        shard = align_up(max(cursors), divisor)
        index = len(out.buckets)
        slots = sorted(
            (ParamSlot(s.name, s.shape, buffer_index, index, bucket_start + r * shard + off,
                       bucket_start + r * shard + off + s.numel)
             for s, r, off in placed),
            key=lambda sl: sl.start,
        )
        out.params.extend(slots)
        out.buckets.append(
            BucketSpec(
                index=index,
                start=bucket_start,
                end=bucket_start + dp * shard,
                numel_unpadded=sum(s.numel for s in chunk),
                params=tuple(sl.name for sl in slots),
            )
        )
        bucket_start += dp * shard
    return out


def padded_owner(bucket: BucketSpec, slot: ParamSlot, dp: int) -> int:
    """The rank whose shard holds ``slot`` in a padded layer-wise bucket."""
    shard = bucket.numel // dp
    r = (slot.start - bucket.start) // shard
    if slot.end > bucket.start + (r + 1) * shard:
        raise AssertionError(f"{slot.name} crosses a shard boundary of bucket {bucket.index}")
    return r

