"""Contiguous param and grad buffers allocated from a :class:`BufferSpec`.

* ``grad_data``: zeros of the grad dtype; every param's ``main_grad`` is a view into it.
* ``param_data`` (distributed optimizer only): the param all-gather area. Plain params are
  *placed* in it (their ``.data`` becomes a view, so gathering updates the model in place);
  quantized primary weights keep their own storage and are staged here in their staging
  dtype, then requantized after the gather (see :mod:`lptrain.precision.param_storage`).
* Sharded grads (``ddp.data_parallel_sharding_strategy=optim_grads``, ZeRO-2): there is no
  buffer-long ``grad_data``. Each bucket has its own full grad tensor, allocated (zeroed)
  at the bucket's first use in a backward and released (its storage resized to 0, so the
  ``main_grad`` views stay valid objects) right after its reduce-scatter; what persists is
  ``grad_shard``: this rank's reduced shard of every bucket, back to back. The values,
  the collective and its inputs are those of the ``optim`` strategy, so training is
  bitwise the same. :meth:`grad_slice` reads either layout by buffer element range.
* Grad-buffer reuse (the ``ddp.reuse_grad_buf_*`` option): a quantized buffer's staging
  area is a view of its own grad buffer (bf16 over the first half of an fp32 buffer), so the
  all-gather costs no extra memory. Then every bucket's staging slice is zeroed right after
  its params are requantized, so the next backward accumulates into zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

import torch

from lptrain.distributed.bucket_group import Bucket
from lptrain.distributed.layout import BufferSpec
from lptrain.precision.param_storage import (
    is_quantized,
    load_all_from_staging,
    load_from_staging,
    place_in_buffer,
    release_storage,
    restore_storage,
)

if TYPE_CHECKING:
    from lptrain.distributed.groups import ParallelGroups


class ParamAndGradBuffer:
    """One buffer of the layout: storage, main_grad views, buckets."""

    def __init__(
        self,
        spec: BufferSpec,
        index: int,
        params: dict[str, torch.nn.Parameter],
        groups: ParallelGroups,
        *,
        reuse_grad_buffer: bool,
        device: torch.device,
    ) -> None:
        self.spec = spec
        self.index = index
        self.sharded = spec.sharded
        self.slots = {s.name: s for s in spec.params}
        self.params = {s.name: params[s.name] for s in spec.params}
        self.device = device
        self.groups = groups.for_buffer(spec.key.is_expert)
        self.shards_grads = bool(self.sharded and spec.shards_grads)
        if self.shards_grads and reuse_grad_buffer and spec.key.quantized:
            raise ValueError(
                "ddp.reuse_grad_buf_for_mxfp8_param_ag needs the whole grad buffer: it cannot "
                "be combined with sharded grads (data_parallel_sharding_strategy=optim_grads*)"
            )
        # ZeRO-2: no buffer-long grad tensor (see the module doc); the buckets own theirs
        self.grad_data = (
            torch.zeros(spec.numel, dtype=spec.key.grad_dtype, device=device)
            if not self.shards_grads else torch.empty(0, dtype=spec.key.grad_dtype, device=device)
        )
        self.grad_shard: Optional[torch.Tensor] = None
        self._shard_offset: list[int] = []
        if self.shards_grads:
            size, off = self.groups.intra.size, 0
            for b in spec.buckets:
                self._shard_offset.append(off)
                off += b.numel // size
            self.grad_shard = torch.zeros(off, dtype=spec.key.grad_dtype, device=device)
        self.reuses_grad_buffer = bool(self.sharded and reuse_grad_buffer and spec.key.quantized)
        self.shards_params = bool(self.sharded and spec.shards_params)
        self.param_data: Optional[torch.Tensor] = None
        self.param_shard: Optional[torch.Tensor] = None
        if self.shards_params:  # ZeRO-3: the buckets own their full params (see Bucket)
            self.param_shard = torch.zeros(
                len(self.grad_shard) if self.grad_shard is not None else 0,
                dtype=spec.key.param_dtype, device=device,
            )
        elif self.sharded:
            if self.reuses_grad_buffer:
                as_param = self.grad_data.view(spec.key.param_dtype)
                self.param_data = as_param[: spec.numel]
            else:
                self.param_data = torch.zeros(spec.numel, dtype=spec.key.param_dtype, device=device)
        self.aliased: dict[str, bool] = {}
        self._staged: dict[int, list[tuple[torch.nn.Parameter, torch.Tensor]]] = {}
        self.buckets = [Bucket(self, i, self.groups) for i in range(len(spec.buckets))]
        self.bucket_of = {n: self.buckets[s.bucket] for n, s in self.slots.items()}
        for name, p in self.params.items():
            s = self.slots[name]
            if self.shards_grads:
                b = self.bucket_of[name]
                p.main_grad = b.full_grad[s.start - b.start : s.end - b.start].view(p.shape)
            else:
                p.main_grad = self.grad_data[s.start : s.end].view(p.shape)
            if self.param_data is not None:
                self.aliased[name] = place_in_buffer(p, self.param_data[s.start : s.end])
            elif self.shards_params:
                b = self.bucket_of[name]
                self.aliased[name] = place_in_buffer(p, b.full_param[s.start - b.start : s.end - b.start])
        if self.shards_params:  # this rank's shard of the values just placed
            for b in self.buckets:
                self.param_shard_of(b).copy_(self._shard_view(b.full_param, b))
        if self.reuses_grad_buffer:
            self.grad_data.zero_()  # placing staged the values; grads must start from zero
        if self.shards_grads:
            for b in self.buckets:
                b.release_grads()

    @property
    def key(self):  # -> BufferKey
        return self.spec.key

    def load_params_from_staging(self, bucket: Bucket) -> None:
        """After ``bucket``'s gather: refresh non-aliased params, then free a reused slice.
        With sharded params the staging area is the bucket's full-param tensor, and a
        quantized param gets its released bytes back before they are refilled."""
        if self.shards_params:
            assert bucket.full_param is not None
            for name in bucket.param_names:
                s, p = self.slots[name], self.params[name]
                restore_storage(p)
                load_from_staging(p, bucket.full_param[s.start - bucket.start : s.end - bucket.start])
            return
        if self.param_data is None:
            return
        pairs = self._staged.get(bucket.index)
        if pairs is None:  # (the slices are views of a buffer that lives as long as this one)
            pairs = [(self.params[n], self.param_data[self.slots[n].start : self.slots[n].end])
                     for n in bucket.param_names]
            self._staged[bucket.index] = pairs
        load_all_from_staging(pairs)
        if self.reuses_grad_buffer:
            bucket.param_view.zero_()

    def release_quantized(self, bucket: Bucket) -> None:
        """Sharded params: free the bytes the bucket's quantized params hold themselves."""
        for name in bucket.param_names:
            p = self.params[name]
            if is_quantized(p):
                release_storage(p)

    def grad_slice(self, lo: int, hi: int) -> torch.Tensor:
        """Grads of buffer elements ``[lo, hi)``: a view of ``grad_data``, or with sharded
        grads of this rank's reduced shard (``[lo, hi)`` must lie inside it)."""
        if not self.shards_grads:
            return self.grad_data[lo:hi]
        assert self.grad_shard is not None
        for b in self.buckets:
            if b.start <= lo < b.end:
                s_lo, s_hi = b.shard_range()
                if not (s_lo <= lo and hi <= s_hi):
                    raise IndexError(f"grads [{lo}, {hi}) are not in this rank's shard of {b!r}")
                off = self._shard_offset[b.index] + lo - s_lo
                return self.grad_shard[off : off + hi - lo]
        raise IndexError(f"grads [{lo}, {hi}) are outside buffer {self.index}")

    def _shard_view(self, full: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        lo, hi = bucket.shard_range()
        return full[lo - bucket.start : hi - bucket.start]

    def param_slice(self, lo: int, hi: int) -> torch.Tensor:
        """The staging slice of buffer elements ``[lo, hi)`` (inside this rank's shard):
        a view of ``param_data``, or with sharded params of the kept ``param_shard``."""
        if self.param_shard is None:
            assert self.param_data is not None
            return self.param_data[lo:hi]
        for b in self.buckets:
            if b.start <= lo < b.end:
                s_lo, _ = b.shard_range()
                off = self._shard_offset[b.index] + lo - s_lo
                return self.param_shard[off : off + hi - lo]
        raise IndexError(f"params [{lo}, {hi}) are outside buffer {self.index}")

    def param_shard_of(self, bucket: Bucket) -> torch.Tensor:
        lo, hi = bucket.shard_range()
        return self.param_slice(lo, hi)

    def shard_of(self, bucket: Bucket) -> torch.Tensor:
        """This rank's reduced shard of ``bucket`` (sharded grads only)."""
        lo, hi = bucket.shard_range()
        return self.grad_slice(lo, hi)

    def zero_grads(self) -> None:
        if self.shards_grads:
            for b in self.buckets:
                b.release_grads()  # a bucket is allocated zeroed at its first use
        else:
            self.grad_data.zero_()
        for b in self.buckets:
            b.zero_grads()

    def nbytes(self) -> dict[str, int]:
        """Bytes this buffer holds now (with sharded grads: the kept shards, plus any bucket
        whose full grads are allocated at this moment)."""
        if self.shards_grads:
            assert self.grad_shard is not None
            grad = self.grad_shard.numel() * self.grad_shard.element_size()
            grad += sum(b.full_grad_nbytes() for b in self.buckets)
        else:
            grad = self.grad_data.numel() * self.grad_data.element_size()
        out = {"grad": grad}
        if self.param_shard is not None:
            out["param"] = self.param_shard.numel() * self.param_shard.element_size() + sum(
                b._full_param_bytes for b in self.buckets if b.full_param is not None and b.params_present)
        if self.param_data is not None and not self.reuses_grad_buffer:
            out["param"] = self.param_data.numel() * self.param_data.element_size()
        return out


def buckets_in_forward_order(buffers: Sequence[ParamAndGradBuffer]) -> list[Bucket]:
    """Buckets in the order the forward pass needs them (buffers lay params out backwards)."""
    out: list[Bucket] = []
    for b in buffers:
        out.extend(reversed(b.buckets))
    return out
