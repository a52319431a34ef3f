"""Stand-in ``transformer_engine.pytorch.tensor.utils``: TE's ZeRO helpers for FP8 weights.

* ``replace_raw_data(tensor, new_raw_data)`` (2.2+; ``Float8Tensor``, and
  ``Float8BlockwiseQTensor`` from 2.4): copy the row-wise bytes into ``new_raw_data`` and make
  it the tensor's storage (``_data`` / ``_rowwise_data``); MXFP8 raises ``NotImplementedError``.
* ``cast_master_weights_to_fp8(model_weights, master_weights, start_offsets, group)``
  (current scaling 2.2+, blockwise 2.4+; ``fsdp_shard_model_weights`` 2.3+,
  ``manual_post_all_gather_processing`` 2.10+): each rank holds a flat shard (or None) of each
  weight's master starting at ``start_offset``; the partial amaxes (per tensor, or per
  128x128 tile) are MAX-reduced over ``group`` in one collective, the scales set from them on
  every rank, and each rank casts its shard into the weight's row-wise bytes. The transpose
  (Float8) is reset and the column-wise copy (blockwise) dropped, to be rebuilt after the
  all-gather. ``quantize_master_weights`` (2.14+) is the same entry point under its new name.
* ``post_all_gather_processing(weights)`` (2.10+): rebuild what the cast dropped (before
  2.10 the cast's cache reset makes the first use rebuild it).

The math is lptrain's emulated shard quantization (bit-faithful to TE's kernels by design).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import tensors as T

BLOCKWISE_BYTES_FROM = (2, 4)  # replace_raw_data / the master cast take blockwise tensors


def make_replace_raw_data(v: tuple[int, ...]) -> Any:
    def replace_raw_data(tensor: Any, new_raw_data: torch.Tensor) -> None:
        if isinstance(tensor, T.Float8Tensor):
            attr = "_data"
        elif isinstance(tensor, T.Float8BlockwiseQTensor) and v >= BLOCKWISE_BYTES_FROM:
            attr = "_rowwise_data"
        elif isinstance(tensor, T.MXFP8Tensor):
            raise NotImplementedError("replace_raw_data for MXFP8Tensor is not supported yet")
        else:
            raise ValueError(f"replace_raw_data for {type(tensor)} is not supported yet")
        old = getattr(tensor, attr)
        if old.dtype != new_raw_data.dtype:
            raise ValueError(f"The data types of raw data don't match: {old.dtype} vs {new_raw_data.dtype}")
        new_raw_data.detach().copy_(old)
        setattr(tensor, attr, new_raw_data)

    return replace_raw_data


def make_cast(v: tuple[int, ...], name: str = "cast_master_weights_to_fp8") -> Any:
    """TE's master-weight cast of release ``v`` (its keyword arguments as that release's)."""

    def cast_master_weights_to_fp8(model_weights: Sequence[Any], master_weights: Sequence[Optional[torch.Tensor]],
                                   start_offsets: Sequence[int], group: Any,
                                   fsdp_shard_model_weights: Any = None,
                                   manual_post_all_gather_processing: bool = False) -> None:
        entries = list(zip(model_weights, master_weights, start_offsets, strict=True))
        for w, _, _ in entries:
            if hasattr(w, "clear_high_precision_init_val"):
                w.clear_high_precision_init_val()
            q = w._get_quantizer()
            ok = isinstance(q, T.Float8CurrentScalingQuantizer) or (
                isinstance(q, T.Float8BlockQuantizer) and v >= BLOCKWISE_BYTES_FROM)
            if not ok:
                raise ValueError(f"cast_master_weights_to_fp8 for {type(q)} is not supported by this stand-in")
        xs = [None if m is None else m.to(w.dtype).reshape(-1) for w, m, _ in entries]
        partial = [w._emu.shard_amax(x, lo, lo + (0 if x is None else x.numel()))
                   for (w, _, lo), x in zip(entries, xs, strict=True)]
        packed = torch.cat([a.reshape(-1) for a in partial])
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)  # TE needs a process group
        off = 0
        for (w, _, lo), x, a in zip(entries, xs, partial, strict=True):
            amax = packed[off: off + a.numel()].view_as(a)
            off += a.numel()
            hi = lo + (0 if x is None else x.numel())
            q = w._emu.shard_quantize(x, lo, hi, amax)
            if isinstance(w, T.Float8Tensor):
                w._reset_caches()
                raw = w._data
            else:
                w.update_usage(rowwise_usage=True, columnwise_usage=False)
                raw = w._rowwise_data
            if q is not None:
                raw.reshape(-1)[lo:hi].copy_(q.reshape(-1))

    sig = inspect.signature(cast_master_weights_to_fp8)
    since = {"fsdp_shard_model_weights": (2, 3), "manual_post_all_gather_processing": (2, 10)}
    cast_master_weights_to_fp8.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=[p for p in sig.parameters.values() if v >= since.get(p.name, (0,))])
    cast_master_weights_to_fp8.__name__ = name
    return cast_master_weights_to_fp8


def post_all_gather_processing(model_weights: Any) -> None:
    for w in model_weights if isinstance(model_weights, list) else [model_weights]:
        if isinstance(w, T.Float8Tensor):
            w._create_transpose()
        elif isinstance(w, T.Float8BlockwiseQTensor):
            w._create_columnwise()
        elif isinstance(w, T.QuantizedTensor) and not isinstance(w, T.MXFP8Tensor):
            raise ValueError(f"post_processing for {type(w)} is not supported")
