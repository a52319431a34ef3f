"""Buffer layout: where every parameter lives in the contiguous param/grad buffers.

Computed first, as plain data, without allocating anything, so that the real buffers, the
tests of the padding rules and the memory planner all read the same numbers.

Rules (the upstream data-parallel engine's, restated):

* Parameters are grouped into buffers by :class:`BufferKey` -- storage kind (the param dtype,
  or ``"quantized"`` for FP8/FP4 primary weights), grad dtype, dense or expert, Muon-managed or
  not -- so each buffer reduces over one group with one dtype.
* Inside a buffer, parameters are laid out in **reverse registration order** (backprop order):
  the first bucket to fill during backward sits at the start and can be reduced first.
* A bucket is closed once it holds at least ``bucket_size`` elements (``None``: one bucket).
* With the distributed optimizer, every param start is aligned to 64 elements and every bucket
  end is padded to ``lcm(dp, 128)`` so each bucket splits into ``dp`` equal shards (a shard
  ignores param boundaries: a param may straddle ranks); a tied embedding
  (``shared_embedding``) gets a bucket of its own, because its gradient is complete only
  after both of its uses.
* Without the distributed optimizer there is no padding at all.

Quantized primary weights travel in the all-gather in their ``staging_dtype``
(:mod:`lptrain.precision.param_storage` asks the tensor family):

* uint8 for ``shard_quantizable`` families (one per-tensor scale from current scaling, or
  128x128 tiles whose scales depend on tile amaxes alone and whose column-wise copy is a
  transpose): each rank quantizes its master shard into its own byte range after a MAX
  all-reduce of the partial amaxes, the bytes are gathered as they are (1 byte per element),
  and the column-wise copy is rebuilt locally;
* the logical dtype (bf16) for every other family: where the column-wise copy is quantized
  separately from the high-precision value (its own 1-D blocks, its own global scale, a random
  Hadamard transform, stochastic rounding), a byte shard cannot rebuild it, so the
  high-precision value is gathered and every rank requantizes (2 bytes per element on the
  wire; 4x the packed 4-bit size, in exchange for a gather that is bitwise identical to
  quantizing a bf16 param in the forward). The grad-buffer reuse option stages it in a view of
  the grad buffer instead of a separate param buffer.

Either way a quantized buffer's ``param_dtype`` is that staging dtype, and
:meth:`BufferLayout.report` shows the bytes of each buffer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

PARAM_START_ALIGN = 64  # elements
BUCKET_END_ALIGN = 128  # elements; buckets pad to lcm(dp, 128)


@dataclass(frozen=True)
class BufferKey:
    """What separates two buffers: each buffer has one dtype and one reduction group."""

    param_dtype: torch.dtype  # storage of plain params, staging dtype of quantized ones
    grad_dtype: torch.dtype
    quantized: bool
    is_expert: bool
    is_muon: bool

    def describe(self) -> str:
        kind = "quantized" if self.quantized else str(self.param_dtype).replace("torch.", "")
        grad = str(self.grad_dtype).replace("torch.", "")
        parts = [kind, f"grads {grad}", "expert" if self.is_expert else "dense"]
        if self.is_muon:
            parts.append("muon")
        return ", ".join(parts)


@dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know about one parameter (a real tensor or a description)."""

    name: str
    shape: tuple[int, ...]
    key: BufferKey
    shared_embedding: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ParamSlot:
    """A parameter's place: ``[start, end)`` elements of buffer ``buffer``, inside ``bucket``."""

    name: str
    shape: tuple[int, ...]
    buffer: int
    bucket: int
    start: int
    end: int


@dataclass(frozen=True)
class BucketSpec:
    """Elements ``[start, end)`` of a buffer; ``numel_unpadded`` of them hold parameters."""

    index: int
    start: int
    end: int
    numel_unpadded: int
    params: tuple[str, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def padding(self) -> int:
        return self.numel - self.numel_unpadded


SHARDING_LEVELS = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}


@dataclass
class BufferSpec:
    key: BufferKey
    sharded: bool = False  # buckets split into dp shards (distributed optimizer, non-Muon)
    # ZeRO-2: a sharded buffer keeps only this rank's reduced shard of each bucket's grads
    # (the full bucket exists from its first backward use until its reduce-scatter)
    shards_grads: bool = False
    # ZeRO-3: params too -- a bucket's full params exist only around its forward and backward
    shards_params: bool = False
    params: list[ParamSlot] = field(default_factory=list)
    buckets: list[BucketSpec] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.buckets[-1].end if self.buckets else 0

    @property
    def numel_unpadded(self) -> int:
        return sum(b.numel_unpadded for b in self.buckets)

    def padding_bytes(self) -> int:
        return (self.numel - self.numel_unpadded) * self.key.grad_dtype.itemsize

    def shard_range(self, bucket: BucketSpec, rank: int, size: int) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of ``bucket`` that ``rank`` of ``size`` shard-holders owns:
        its equal slice of a sharded buffer, the whole bucket otherwise. The one definition
        the grad reduce-scatter, the optimizer's master pieces and the memory models share."""
        if not self.sharded:
            return bucket.start, bucket.end
        n = bucket.numel // size
        return bucket.start + rank * n, bucket.start + (rank + 1) * n

    def shard_used(self, bucket: BucketSpec, rank: int, size: int) -> tuple[int, int]:
        """``(elements, of which param elements)`` of ``rank``'s shard of ``bucket``: what a
        rank keeps of a bucket whose grads (or params) are sharded; the rest is padding."""
        lo, hi = self.shard_range(bucket, rank, size)
        slots = [s for s in self.params if s.bucket == bucket.index]
        used = sum(max(0, min(hi, s.end) - max(lo, s.start)) for s in slots)
        return hi - lo, used

    def overlap(self, bucket: BucketSpec, slot: ParamSlot, rank: int, size: int) -> int:
        """Elements of ``slot`` inside ``rank``'s shard of ``bucket`` (0 when none)."""
        lo, hi = self.shard_range(bucket, rank, size)
        return max(0, min(hi, slot.end) - max(lo, slot.start))


@dataclass
class BufferLayout:
    """Every buffer of a model for one data-parallel size."""

    buffers: list[BufferSpec]
    dp: int
    strategy: str = "optim"  # ddp.data_parallel_sharding_strategy

    @property
    def sharded(self) -> bool:
        return any(b.sharded for b in self.buffers)

    def slot(self, name: str) -> ParamSlot:
        for b in self.buffers:
            for s in b.params:
                if s.name == name:
                    return s
        raise KeyError(name)

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buffers)

    @property
    def numel_unpadded(self) -> int:
        return sum(b.numel_unpadded for b in self.buffers)

    def padding_percent(self) -> float:
        return 100.0 * (self.numel - self.numel_unpadded) / max(1, self.numel)

    def padding_bytes(self) -> int:
        return sum(b.padding_bytes() for b in self.buffers)

    def report(self) -> str:
        lines = [
            f"{len(self.buffers)} buffer(s), dp {self.dp}, "
            f"{'sharded' if self.sharded else 'replicated'} optimizer ({self.strategy}): "
            f"{self.numel_unpadded:,} param elements, padding {self.numel - self.numel_unpadded:,} "
            f"elements ({self.padding_percent():.3f}%, {self.padding_bytes():,} grad bytes)"
        ]
        for i, b in enumerate(self.buffers):
            staging = (
                f", param buffer {b.numel * b.key.param_dtype.itemsize:,} bytes "
                f"({str(b.key.param_dtype).replace('torch.', '')})"
                if b.sharded else ""
            )
            sharded_grads = (
                f" (kept: this rank's shard, {b.numel // self.dp * b.key.grad_dtype.itemsize:,} bytes)"
                if b.shards_grads else ""
            )
            lines.append(
                f"  buffer {i} [{b.key.describe()}]: {len(b.params)} params, "
                f"{len(b.buckets)} bucket(s), {b.numel:,} elements, grad buffer "
                f"{b.numel * b.key.grad_dtype.itemsize:,} bytes{sharded_grads}{staging}"
            )
        return "\n".join(lines)


def align_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to`` (the layouts' alignment rules)."""
    return (n + to - 1) // to * to


def layout_one_buffer(
    specs: Sequence[ParamSpec], buffer_index: int, *, bucket_size: Optional[int], dp: int, sharded: bool
) -> BufferSpec:
    """One buffer of ``specs`` (one key) in backprop order, cut into buckets (the module
    doc's rules); the layer-wise layouts reuse it for their non-Muon and compact buffers."""
    out = BufferSpec(key=specs[0].key, sharded=sharded)
    end_align = math.lcm(dp, BUCKET_END_ALIGN) if sharded else 1
    bucket_start = 0
    cursor = 0
    current: list[ParamSpec] = []
    unpadded = 0

    def close() -> None:
        nonlocal bucket_start, cursor, current, unpadded
        if not current:
            return
        end = align_up(cursor, end_align)
        out.buckets.append(
            BucketSpec(
                index=len(out.buckets),
                start=bucket_start,
                end=end,
                numel_unpadded=unpadded,
                params=tuple(p.name for p in current),
            )
        )
        bucket_start = cursor = end
        current, unpadded = [], 0

    for p in reversed(specs):  # backprop order
        if sharded and p.shared_embedding:
            close()
        start = align_up(cursor, PARAM_START_ALIGN) if sharded else cursor
        end = start + p.numel
        out.params.append(ParamSlot(p.name, p.shape, buffer_index, len(out.buckets), start, end))
        current.append(p)
        unpadded += p.numel
        cursor = end
        if (sharded and p.shared_embedding) or (
            bucket_size is not None and cursor - bucket_start >= bucket_size
        ):
            close()
    close()
    return out


def shard_count(key: BufferKey, dp: int, expert_dp: Optional[int]) -> int:
    """The ranks a buffer's buckets are sharded over: ``dp``, or ``expert_dp`` for expert
    buffers when it is given (the expert-data-parallel group, which spans the tensor-parallel
    ranks and differs from ``dp`` under tensor or expert parallelism)."""
    return expert_dp if key.is_expert and expert_dp else dp


def plan_layout(
    specs: Sequence[ParamSpec], *, dp: int, bucket_size: Optional[int], sharded: bool,
    expert_dp: Optional[int] = None,
) -> BufferLayout:
    """Group ``specs`` (in registration order) into buffers and buckets; allocates nothing.

    ``sharded`` (the distributed optimizer) applies to every buffer except Muon's: Newton-
    Schulz needs whole matrices, so Muon buffers use the compact layout (no padding, grads
    all-reduced, whole params per rank). Expert buffers are padded for ``expert_dp`` shards
    (:func:`shard_count`).
    """
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    by_key: dict[BufferKey, list[ParamSpec]] = {}
    for s in specs:
        by_key.setdefault(s.key, []).append(s)
    buffers = [
        layout_one_buffer(
            group, i, bucket_size=bucket_size, dp=shard_count(key, dp, expert_dp),
            sharded=sharded and not key.is_muon,
        )
        for i, (key, group) in enumerate(by_key.items())
    ]
    return BufferLayout(buffers=buffers, dp=dp, strategy="optim" if sharded else "no_shard")


def param_specs(
    named_params: Sequence[tuple[str, torch.Tensor]],
    *,
    grad_reduce_in_fp32: bool,
    separate_muon: bool = False,
) -> list[ParamSpec]:
    """Describe real (or meta) parameters for :func:`plan_layout`, reading the tags the model
    set (``is_expert``, ``shared_embedding``, ``use_muon``) and the precision interface's
    staging dtype for quantized primary weights."""
    from lptrain.model.params import is_muon_param
    from lptrain.precision.param_storage import is_quantized, staging_dtype

    out = []
    for name, p in named_params:
        grad_dtype = torch.float32 if grad_reduce_in_fp32 else p.dtype
        key = BufferKey(
            param_dtype=staging_dtype(p),
            grad_dtype=grad_dtype,
            quantized=is_quantized(p),
            is_expert=bool(getattr(p, "is_expert", False)),
            is_muon=separate_muon and is_muon_param(p),
        )
        out.append(
            ParamSpec(name, tuple(p.shape), key, bool(getattr(p, "shared_embedding", False)))
        )
    return out


def plan_run_layout(cfg: Any, specs: Sequence[ParamSpec], dp: int,
                    expert_dp: Optional[int] = None) -> BufferLayout:
    """The layout a run uses (``cfg``: an ``LPTrainConfig``): the layer-wise Muon layout when
    ``optimizer.use_layer_wise_optimizer``, else :func:`plan_layout`, with the sharding
    strategy's grad and param sharding marked on its sharded buffers. The engine and the
    memory planner both call this, so they cannot choose differently. ``dp`` / ``expert_dp``:
    the shard counts of the dense and expert buffers (one optimizer instance's groups)."""
    if cfg.optimizer.use_layer_wise_optimizer:
        from lptrain.distributed.layerwise_layout import plan_layer_wise_layout

        layout = plan_layer_wise_layout(
            specs, dp=dp, bucket_size=cfg.ddp.bucket_size, sharded=cfg.ddp.use_distributed_optimizer,
            param_layout=cfg.optimizer.layer_wise_param_layout, expert_dp=expert_dp,
        )
    else:
        layout = plan_layout(
            specs, dp=dp, bucket_size=cfg.ddp.bucket_size, sharded=cfg.ddp.use_distributed_optimizer,
            expert_dp=expert_dp,
        )
    return with_strategy(layout, cfg.ddp.data_parallel_sharding_strategy)


def with_strategy(layout: BufferLayout, strategy: Optional[str]) -> BufferLayout:
    """Mark ``layout``'s sharded buffers with what ``strategy`` shards beyond the optimizer
    state. That includes padded layer-wise Muon buffers (``sharded`` too): each whole matrix
    lies inside one rank's equal shard, so its owner's reduced grad shard holds the whole
    gradient and its param shard the whole value -- the owner-side whole-param layout
    Newton-Schulz needs. Compact Muon buffers are never sharded (grads all-reduced, params
    gathered unevenly) and keep everything whole; the rule DDP-SHARDED-GRADS-NOT-MUON
    refuses them under sharded grads."""
    strategy = strategy or ("optim" if layout.sharded else "no_shard")
    level = SHARDING_LEVELS[strategy]
    layout.strategy = strategy
    for b in layout.buffers:
        if b.sharded:
            b.shards_grads = level >= 2
            b.shards_params = level >= 3
    return layout


def run_param_specs(cfg: Any, named_params: Sequence[tuple[str, torch.Tensor]]) -> list[ParamSpec]:
    """Specs of a run's real params: Muon params in their own (layer-wise: logical-dtype) buffers."""
    grad_fp32 = bool(cfg.ddp.grad_reduce_in_fp32)
    if cfg.optimizer.use_layer_wise_optimizer:
        from lptrain.distributed.layerwise_layout import layer_wise_param_specs

        return layer_wise_param_specs(named_params, grad_reduce_in_fp32=grad_fp32)
    return param_specs(named_params, grad_reduce_in_fp32=grad_fp32, separate_muon=cfg.optimizer.name == "muon")
