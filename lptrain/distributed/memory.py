"""Per-rank memory of the data-parallel engine: measured from real buffers, or modelled.

Two views of the same accounting, so that they can be checked against each other:

* :func:`measured_memory` reads the live engine (``DataParallel`` buffers, the model's
  parameter storage, the optimizer children's masters and state);
* :func:`analytic_memory` computes the same numbers from parameter *descriptions* and the
  pure layout/ownership planners without allocating anything, so the memory planner can
  price a 1B or 8B configuration on a laptop.

Categories (bytes on one rank):

* ``params``: model parameter storage -- plain params (wherever they live, in or out of a
  param buffer) and quantized primary weights (all their FP8 bytes and scales, both
  orientations);
* ``param_buffer``: param-buffer bytes that are *not* a plain param's storage (padding, the
  staging slices of quantized params; 0 when the staging area reuses the grad buffer);
* ``grads``: the grad buffers, padding included;
* ``masters``: fp32 master weights this rank keeps (its shard, or the Muon matrices it owns);
* ``moments``: optimizer state tensors (AdamW exp_avg + exp_avg_sq, Muon momentum);
* ``padding``: layout padding in the grad and param buffers (already inside ``grads`` and
  ``param_buffer``; reported to compare layouts).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from lptrain.distributed.layout import (
    BufferKey,
    BufferLayout,
    ParamSpec,
    muon_buffer_key,
    plan_layer_wise_layout,
    plan_layout,
)

CATEGORIES = ("params", "param_buffer", "grads", "masters", "moments")


@dataclass
class MemoryBreakdown:
    """Bytes per category on one rank (see the module doc); ``total`` excludes ``padding``
    (it is inside ``grads`` and ``param_buffer``)."""

    params: int = 0
    param_buffer: int = 0
    grads: int = 0
    masters: int = 0
    moments: int = 0
    padding: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in CATEGORIES)

    def as_dict(self) -> dict[str, int]:
        return {**{c: getattr(self, c) for c in CATEGORIES}, "padding": self.padding,
                "total": self.total}


@dataclass(frozen=True)
class ParamDesc:
    """What the memory model needs to know about a parameter (no storage)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # logical dtype
    quantized: bool = False  # quantized primary weight (FP8 param gather)
    is_expert: bool = False
    is_muon: bool = False
    shared_embedding: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def describe_params(named_params: Iterable[tuple[str, torch.Tensor]]) -> list[ParamDesc]:
    """Descriptions of real or meta params (tags as set by the model)."""
    from lptrain.model.params import is_muon_param
    from lptrain.precision.param_storage import is_quantized

    return [
        ParamDesc(n, tuple(p.shape), p.dtype, is_quantized(p), bool(getattr(p, "is_expert", False)),
                  is_muon_param(p), bool(getattr(p, "shared_embedding", False)))
        for n, p in named_params
    ]


def quantized_bytes_per_element(p: torch.Tensor, probe: int = 256) -> float:
    """Bytes per element of ``p``'s quantized format (data + scales, the orientations ``p``
    keeps), measured on a ``probe x probe`` zero matrix with ``p``'s own quantizer: exact for
    shapes that are multiples of the format's blocks, close otherwise."""
    q = p.quantizer.quantize(torch.zeros(probe, probe, dtype=p.dtype))  # type: ignore[attr-defined]
    return q.nbytes() / (probe * probe)


def _specs(params: Sequence[ParamDesc], grad_dtype: torch.dtype, *, layer_wise: bool,
           muon: bool, staging: torch.dtype) -> list[ParamSpec]:
    out = []
    for d in params:
        key = BufferKey(staging if d.quantized else d.dtype, grad_dtype, d.quantized,
                        d.is_expert, muon and d.is_muon)
        if layer_wise and key.is_muon:
            key = muon_buffer_key(key, d.dtype)
        out.append(ParamSpec(d.name, d.shape, key, d.shared_embedding))
    return out


def plan_for(params: Sequence[ParamDesc], *, dp: int, optimizer: str, distributed: bool,
             param_layout: str = "compact", bucket_size: Optional[int] = None,
             grad_dtype: torch.dtype = torch.float32,
             quantized_staging_dtype: torch.dtype = torch.bfloat16) -> BufferLayout:
    """The layout the engine would build (pure). ``quantized_staging_dtype``: the
    ``staging_dtype`` of the quantized params (bf16, or uint8 for byte-gathered formats)."""
    layer_wise = optimizer == "muon" and distributed
    specs = _specs(params, grad_dtype, layer_wise=layer_wise, muon=optimizer == "muon",
                   staging=quantized_staging_dtype)
    if layer_wise:
        return plan_layer_wise_layout(specs, dp=dp, bucket_size=bucket_size, sharded=True,
                                      param_layout=param_layout)
    return plan_layout(specs, dp=dp, bucket_size=bucket_size, sharded=distributed)


def analytic_memory(
    params: Sequence[ParamDesc],
    *,
    dp: int,
    optimizer: str = "adamw",
    distributed: bool = True,
    param_layout: str = "compact",
    bucket_size: Optional[int] = None,
    grad_dtype: torch.dtype = torch.float32,
    quantized_bpe: float = 0.0,
    quantized_staging_dtype: torch.dtype = torch.bfloat16,
    reuse_grad_buffer: bool = False,
) -> list[MemoryBreakdown]:
    """Per-rank bytes for ``params`` at data-parallel size ``dp`` (one list entry per rank),
    without allocating. ``quantized_bpe``: bytes per element of a quantized param
    (:func:`quantized_bytes_per_element`). Experts use the same group size as dense params
    (no expert parallelism)."""
    from lptrain.optim.layerwise import plan_ownership, units_of_buffer

    layout = plan_for(params, dp=dp, optimizer=optimizer, distributed=distributed,
                      param_layout=param_layout, bucket_size=bucket_size, grad_dtype=grad_dtype,
                      quantized_staging_dtype=quantized_staging_dtype)
    desc = {d.name: d for d in params}
    layer_wise = optimizer == "muon" and distributed
    muon_specs = [b for b in layout.buffers if b.key.is_muon]
    owners = (plan_ownership(muon_specs, dense_size=dp, expert_size=dp, param_layout=param_layout)
              if layer_wise and muon_specs else {})
    param_bytes = 0
    for d in params:
        param_bytes += (math.ceil(d.numel * quantized_bpe) if d.quantized
                        else d.numel * d.dtype.itemsize)
    out = []
    for rank in range(dp):
        m = MemoryBreakdown(params=param_bytes)
        for b in layout.buffers:
            pad = b.numel - b.numel_unpadded
            m.grads += b.numel * b.key.grad_dtype.itemsize
            m.padding += pad * b.key.grad_dtype.itemsize
            if b.sharded:
                if not (reuse_grad_buffer and b.key.quantized):
                    # plain params and byte-gathered (uint8-staged) quantized ones are aliased
                    byte = b.key.param_dtype == torch.uint8
                    aliased = sum(desc[s.name].numel for s in b.params
                                  if byte or not desc[s.name].quantized)
                    m.param_buffer += (b.numel - aliased) * b.key.param_dtype.itemsize
                m.padding += pad * b.key.param_dtype.itemsize
            if b.key.is_muon and layer_wise:
                mine = sum(u.numel for u in units_of_buffer(b, member_level=param_layout == "compact")
                           if owners[u.key] == rank)
                m.masters += 4 * mine
                m.moments += 4 * mine
                continue
            state = 4 if b.key.is_muon else 8  # Muon momentum, or AdamW's two moments
            for s in b.params:
                n = b.overlap(b.buckets[s.bucket], s, rank, dp)
                m.masters += 4 * n
                m.moments += state * n
        out.append(m)
    return out


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def measured_memory(model: torch.nn.Module, buffers: Sequence[Any], children: Sequence[Any]) -> MemoryBreakdown:
    """This rank's bytes from the live engine: ``model``, the ``DataParallel`` buffers and
    the chained optimizer's children (call after one step: optimizer state is lazy)."""
    from lptrain.precision.param_storage import storage_bytes

    m = MemoryBreakdown()
    for p in model.parameters():
        m.params += storage_bytes(p)
    for b in buffers:
        m.grads += _tensor_bytes(b.grad_data)
        pad = b.spec.numel - b.spec.numel_unpadded
        m.padding += pad * b.grad_data.element_size()
        if b.param_data is not None:
            m.padding += pad * b.param_data.element_size()
            if not b.reuses_grad_buffer:
                # Aliased params (plain ones, byte-gathered row-wise FP8 data) live in it.
                aliased = sum(s.end - s.start for n, s in b.slots.items() if b.aliased.get(n))
                m.param_buffer += (b.param_data.numel() - aliased) * b.param_data.element_size()
    for child in children:
        for pc in child.pieces:
            m.masters += _tensor_bytes(pc.master)
        for opt in child.optimizers:
            for st in opt.state.values():
                for v in st.values():
                    if torch.is_tensor(v) and v.dim() > 0:
                        m.moments += _tensor_bytes(v)
    return m


def format_table(rows: dict[str, MemoryBreakdown], unit: float = 1.0, unit_name: str = "B") -> str:
    """A plain-text table: one row per configuration, one column per category."""
    cols = [*CATEGORIES, "padding", "total"]
    width = max(len(r) for r in rows) + 2
    head = "config".ljust(width) + "".join(f"{c:>14}" for c in cols)
    lines = [head + f"   ({unit_name} per rank)"]
    for name, m in rows.items():
        d = m.as_dict()
        lines.append(name.ljust(width) + "".join(f"{d[c] / unit:>14,.2f}" for c in cols))
    return "\n".join(lines)
