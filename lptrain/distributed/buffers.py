"""Contiguous param and grad buffers allocated from a :class:`BufferSpec`.

* ``grad_data``: zeros of the grad dtype; every param's ``main_grad`` is a view into it.
* ``param_data`` (distributed optimizer only): the param all-gather area. Plain params are
  *placed* in it (their ``.data`` becomes a view, so gathering updates the model in place);
  quantized primary weights keep their own storage and are staged here in their staging
  dtype, then requantized after the gather (see :mod:`lptrain.precision.param_storage`).
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
from lptrain.precision.param_storage import load_from_staging, place_in_buffer

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
        self.grad_data = torch.zeros(spec.numel, dtype=spec.key.grad_dtype, device=device)
        self.reuses_grad_buffer = bool(self.sharded and reuse_grad_buffer and spec.key.quantized)
        self.param_data: Optional[torch.Tensor] = None
        if self.sharded:
            if self.reuses_grad_buffer:
                as_param = self.grad_data.view(spec.key.param_dtype)
                self.param_data = as_param[: spec.numel]
            else:
                self.param_data = torch.zeros(spec.numel, dtype=spec.key.param_dtype, device=device)
        self.aliased: dict[str, bool] = {}
        for name, p in self.params.items():
            s = self.slots[name]
            p.main_grad = self.grad_data[s.start : s.end].view(p.shape)
            if self.param_data is not None:
                self.aliased[name] = place_in_buffer(p, self.param_data[s.start : s.end])
        if self.reuses_grad_buffer:
            self.grad_data.zero_()  # placing staged the values; grads must start from zero
        self.groups = groups.for_buffer(spec.key.is_expert)
        self.buckets = [Bucket(self, i, self.groups) for i in range(len(spec.buckets))]
        self.bucket_of = {n: self.buckets[s.bucket] for n, s in self.slots.items()}

    @property
    def key(self):  # -> BufferKey
        return self.spec.key

    def load_params_from_staging(self, bucket: Bucket) -> None:
        """After ``bucket``'s gather: refresh non-aliased params, then free a reused slice."""
        if self.param_data is None:
            return
        for name in bucket.param_names:
            s = self.slots[name]
            load_from_staging(self.params[name], self.param_data[s.start : s.end])
        if self.reuses_grad_buffer:
            bucket.param_view.zero_()

    def zero_grads(self) -> None:
        self.grad_data.zero_()
        for b in self.buckets:
            b.zero_grads()

    def nbytes(self) -> dict[str, int]:
        out = {"grad": self.grad_data.numel() * self.grad_data.element_size()}
        if self.param_data is not None and not self.reuses_grad_buffer:
            out["param"] = self.param_data.numel() * self.param_data.element_size()
        return out


def buckets_in_forward_order(buffers: Sequence[ParamAndGradBuffer]) -> list[Bucket]:
    """Buckets in the order the forward pass needs them (buffers lay params out backwards)."""
    out: list[Bucket] = []
    for b in buffers:
        out.extend(reversed(b.buckets))
    return out
