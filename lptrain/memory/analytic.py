"""The memory model priced from parameter descriptions, without a config or an allocation.

:func:`analytic_memory` takes :class:`ParamDesc` records (shapes, dtypes and the model's tags,
e.g. from a meta-device model through :func:`describe_params`) and the data-parallel settings
to compare, plans the layout the engine would build (:func:`plan_for`) and accounts each
rank with :func:`lptrain.memory.accounting.rank_memory`, so a 1B or 8B layout can be priced
on a laptop and a tiny one checked against :func:`lptrain.memory.measure.measured_memory`.
Experts use the same group size as dense params (no expert parallelism); the scalar
optimizer is AdamW.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from lptrain.distributed.layerwise_layout import muon_buffer_key, plan_layer_wise_layout
from lptrain.distributed.layout import BufferKey, BufferLayout, ParamSpec, plan_layout
from lptrain.memory.accounting import OptimizerLayout, Sharding, StoredParam, rank_memory
from lptrain.memory.breakdown import MemoryBreakdown


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
    (:func:`quantized_bytes_per_element`)."""
    from lptrain.optim.layerwise import plan_ownership

    layout = plan_for(params, dp=dp, optimizer=optimizer, distributed=distributed,
                      param_layout=param_layout, bucket_size=bucket_size, grad_dtype=grad_dtype,
                      quantized_staging_dtype=quantized_staging_dtype)
    layer_wise = optimizer == "muon" and distributed
    muon_specs = [b for b in layout.buffers if b.key.is_muon]
    owners = (plan_ownership(muon_specs, dense_size=dp, expert_size=dp, param_layout=param_layout)
              if layer_wise and muon_specs else {})
    stored = {
        d.name: StoredParam(d.numel, math.ceil(d.numel * quantized_bpe) if d.quantized
                            else d.numel * d.dtype.itemsize, d.quantized)
        for d in params
    }
    placement = OptimizerLayout(layer_wise, param_layout, owners)
    return [rank_memory(layout, stored, Sharding(dp, rank, dp, rank), placement,
                        reuse_grad_buffer=reuse_grad_buffer) for rank in range(dp)]
