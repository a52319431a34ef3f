"""Transformer Engine's quantized tensors behind lptrain's parameter-storage interface.

The data-parallel engine asks every parameter the questions of
:mod:`lptrain.precision.param_storage`; this module answers them for TE's classes, through
TE's own storage API, with the policy lptrain's emulated tensors follow (so a run gathers the
same way on both backends):

========================  ================  =====================================================
TE class                  all-gather as     how
========================  ================  =====================================================
``Float8Tensor``,         bytes (uint8)     ``_data`` replaced by a view of the param buffer
current scaling                             (TE's ``replace_raw_data``); each rank casts its
                                            master shard with TE's ``cast_master_weights_to_fp8``
                                            (one MAX all-reduce of the amaxes); after the gather
                                            ``post_all_gather_processing`` rebuilds the transpose
``Float8BlockwiseQTensor``  bytes (uint8)   the same on ``_rowwise_data`` (TE >= 2.5: its cast
(128x128, TE >= 2.5)                        and raw-data replacement support blockwise)
everything else           bf16              staged from the fp32 master, every rank quantizes in
(delayed ``Float8Tensor``,                  place with ``quantize_`` (MXFP8 through the reused
MXFP8, NVFP4)                               grad buffer)
``GroupedTensor``         bf16              the same through the grouped storage's own API:
(single grouped weight,                     ``quantize(list_of_members)`` (the quantizer's
2.19+)                                      ``update_quantized`` per member; TE's grouped tensor
                                            has no ``quantize_``), members copied when unquantized
========================  ================  =====================================================

Masters start from TE's high-precision init values (``get_high_precision_init_val()``, the
CPU copy ``quantized_model_init(preserve_high_precision_init_val=True)`` keeps; a grouped
weight gets its members' values stacked, see ``te_adapter``'s ``make_grouped_weights``), which are
released once copied (``clear_high_precision_init_val()``): kept, they cost the model's size
in host memory on every rank. A parameter is never reshaped or ``.data``-assigned (TE
refuses the former for MXFP8/grouped/blockwise and requantizes into new storage on the
latter). ``data_ptr()`` of a TE tensor is 0: aliasing is checked on the raw bytes.

Imported lazily -- :mod:`lptrain.precision.param_storage` registers these types the first
time it meets a tensor whose class comes from ``transformer_engine`` -- so ``import lptrain``
never imports TE. Nothing outside :mod:`lptrain.precision` names a TE type.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Optional

import torch

_registered = False


def _te(module: str, name: str) -> Optional[type]:
    try:
        return getattr(importlib.import_module(f"transformer_engine.pytorch.tensor.{module}"), name)
    except (ImportError, AttributeError):
        return None


def _utils() -> Any:
    return importlib.import_module("transformer_engine.pytorch.tensor.utils")


def _current_scaling(p: Any) -> bool:
    cls = _te("float8_tensor", "Float8CurrentScalingQuantizer")
    return cls is not None and isinstance(p._get_quantizer(), cls)


# TE's ``replace_raw_data`` and master-weight cast take ``Float8BlockwiseQTensor`` from 2.4
# (``_cast_master_weights_to_fp8_blockwise_scaling``); before, blockwise weights gather in bf16.
BLOCKWISE_BYTES_MIN_TE = (2, 4)
# ``post_all_gather_processing`` (rebuild the transpose / column-wise copy after a byte
# gather) exists from 2.10; before, the cast's cache reset makes TE rebuild them on first use.
POST_ALL_GATHER_MIN_TE = (2, 10)


def _blockwise_bytes_supported() -> bool:
    from lptrain.precision.te_adapter import te_version

    v = te_version()
    return v is not None and v >= BLOCKWISE_BYTES_MIN_TE


def _raw_attr(p: Any) -> Optional[str]:
    """The row-wise byte attribute of a byte-gathered TE tensor (None: gathered in bf16)."""
    f8 = _te("float8_tensor", "Float8Tensor")
    bw = _te("float8_blockwise_tensor", "Float8BlockwiseQTensor")
    if f8 is not None and isinstance(p, f8) and _current_scaling(p):
        return "_data"
    if bw is not None and isinstance(p, bw) and p._is_2D_scaled and _blockwise_bytes_supported():
        return "_rowwise_data"
    return None


def register() -> bool:
    """Register TE's tensor classes with the param-storage dispatch (idempotent); returns
    whether TE's classes could be imported."""
    global _registered
    from lptrain.precision import param_storage as S

    classes = [c for c in (
        _te("float8_tensor", "Float8Tensor"), _te("mxfp8_tensor", "MXFP8Tensor"),
        _te("float8_blockwise_tensor", "Float8BlockwiseQTensor"), _te("nvfp4_tensor", "NVFP4Tensor"),
        _te("grouped_tensor", "GroupedTensor"),
    ) if c is not None]
    grouped = _te("grouped_tensor", "GroupedTensor")
    for cls in classes:
        if S.is_quantized.dispatch(cls) is S.is_quantized.dispatch(torch.Tensor):
            S.is_quantized.register(cls, lambda p: True)
            S.staging_dtype.register(cls, staging_dtype)
            S.high_precision_value.register(cls, high_precision_value)
            S.release_high_precision_init.register(cls, release_high_precision_init)
            S.place_in_buffer.register(cls, place_in_buffer)
            S.load_from_staging.register(cls, load_from_staging)
            S.stage_bytes.register(cls, stage_bytes)
            S.grouped_members.register(cls, grouped_members)
            S.storage_bytes.register(cls, storage_bytes)
            S.storage_views.register(cls, storage_views)
            S.release_storage.register(cls, release_storage)
            S.restore_storage.register(cls, restore_storage)
            if cls is grouped:
                S.high_precision_value.register(cls, grouped_high_precision_value)
                S.load_from_staging.register(cls, grouped_load_from_staging)
    _registered = bool(classes)
    return _registered


def staging_dtype(p: Any) -> torch.dtype:
    return torch.uint8 if _raw_attr(p) is not None else p.dtype


def high_precision_value(p: Any) -> torch.Tensor:
    get = getattr(p, "get_high_precision_init_val", None)
    init = get() if callable(get) else None
    value = init if init is not None else p.dequantize()
    return value.detach().to(device=p.device, dtype=torch.float32)


def grouped_high_precision_value(p: Any) -> torch.Tensor:
    """A grouped weight's masters: the kept init value, else its members' values stacked
    (TE's ``GroupedTensor`` has no ``dequantize`` of its own)."""
    get = getattr(p, "get_high_precision_init_val", None)
    init = get() if callable(get) else None
    if init is None:
        # a quantized member's dequantize(), a plain member's (unquantized grouped weight) fp32 copy
        init = torch.stack([m.dequantize().float() for m in grouped_members(p)])
    return init.detach().to(device=p.device, dtype=torch.float32)


def grouped_load_from_staging(p: Any, staged: torch.Tensor) -> None:
    """After a gather: write the staged values into a grouped weight's storage through TE's
    grouped API, ``quantize(list_of_member_values)`` (each member requantized in place by
    the quantizer's ``update_quantized``); an unquantized grouped weight's members are
    views of its storage and take a copy."""
    parts = list(staged.view(p.shape).unbind(0))
    with torch.no_grad():
        if getattr(p, "quantizer", None) is None:
            for member, src in zip(grouped_members(p), parts, strict=True):
                member.copy_(src)
        else:
            p.quantize(parts)


def release_high_precision_init(p: Any) -> None:
    clear = getattr(p, "clear_high_precision_init_val", None)
    if callable(clear):
        clear()


def place_in_buffer(p: Any, view: torch.Tensor) -> bool:
    """Byte-gathered: the row-wise bytes become ``view`` (TE's ``replace_raw_data``);
    others: the staging slice gets the high-precision value, the tensor keeps its storage."""
    attr = _raw_attr(p)
    if view.dtype == torch.uint8 and attr is not None:
        raw = getattr(p, attr)
        _utils().replace_raw_data(p, view.view(raw.shape))
        return True
    view.copy_(high_precision_value(p).reshape(-1).to(view.dtype))
    return False


def load_from_staging(p: Any, staged: torch.Tensor) -> None:
    """After a gather: rebuild what the byte cast dropped, or requantize in place."""
    if staged.dtype == torch.uint8 and _raw_attr(p) is not None:
        post = getattr(_utils(), "post_all_gather_processing", None)
        if post is not None:  # TE >= 2.10 (POST_ALL_GATHER_MIN_TE)
            post([p])
        return
    with torch.no_grad():
        p.quantize_(staged.view(p.shape))


# TE's storage attributes, all classes (a missing or None attribute holds nothing)
_STORAGE = ("_data", "_transpose", "_scale_inv", "_rowwise_data", "_columnwise_data",
            "_rowwise_scale_inv", "_columnwise_scale_inv", "_amax_rowwise", "_amax_columnwise",
            "rowwise_data", "columnwise_data", "scale_inv", "columnwise_scale_inv", "amax",
            "columnwise_amax")


def storage_bytes(p: Any) -> int:
    """Bytes of a TE tensor's storage (each distinct buffer once)."""
    seen: set[int] = set()
    total = 0
    for name in _STORAGE:
        t = getattr(p, name, None)
        if isinstance(t, torch.Tensor) and id(t) not in seen and t.numel():
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def storage_views(p: Any) -> dict[str, torch.Tensor]:
    """A TE tensor's storage buffers by attribute name (each distinct buffer once). Never
    ``p.detach().clone()``: for a ``GroupedTensor`` that is TE's default dispatch, which
    dequantizes every member and stacks them (a high-precision copy, not the bytes)."""
    out: dict[str, torch.Tensor] = {}
    for name in _STORAGE:
        t = getattr(p, name, None)
        if isinstance(t, torch.Tensor) and t.numel() and all(t is not v for v in out.values()):
            out[name] = t.detach()
    return out


def grouped_members(p: Any) -> list[torch.Tensor]:
    """A ``GroupedTensor``'s member tensors (TE refuses ``weight[i]`` and ``unbind``)."""
    members = getattr(p, "quantized_tensors", None)
    if members is None and hasattr(p, "split_into_quantized_tensors"):
        members = p.split_into_quantized_tensors()
    if members is None:
        raise TypeError(f"{type(p).__name__} is not a grouped tensor")
    return list(members)


def stage_bytes(p: Any, entries: Sequence[Any], group: Any) -> None:
    """Cast this rank's master shards of byte-gathered TE weights into their (aliased) bytes.

    ``entries``: ``(param, master piece or None, lo, hi, staging slice)`` of one family, the
    same params in the same order on every rank. TE's cast does the amax all-reduce over
    ``group``; without a group (one rank) every master covers its whole param, which is then
    quantized in place (the same amax and scale).
    """
    params = [e[0] for e in entries]
    for q in params:  # (rule DDP-SHARDED-PARAMS-TE-BYTES refuses the config up front)
        raw = getattr(q, _raw_attr(q) or "_data", None)
        if isinstance(raw, torch.Tensor) and raw.numel() and not raw.untyped_storage().nbytes():
            raise RuntimeError("a TE byte-gathered weight's bytes are released (sharded params): "
                               "TE casts masters into the whole weight")
    if group is None:
        for q, x, _lo, _hi, _dst in entries:
            if x is not None:
                q.quantize_(x.reshape(q.shape).to(q.dtype))
        return
    masters = [None if x is None else x.reshape(-1) for _, x, _, _, _ in entries]
    starts = [lo for _, _, lo, _, _ in entries]
    cast = getattr(_utils(), "quantize_master_weights", None) or _utils().cast_master_weights_to_fp8
    cast(params, masters, starts, group)


_DATA_ATTRS = ("_data", "_transpose", "_rowwise_data", "_columnwise_data")


def release_storage(p: Any) -> None:
    """ZeRO-3: free the raw data buffers of a TE tensor (scales kept; see param_storage)."""
    sizes = {}
    for a in _DATA_ATTRS:
        t = getattr(p, a, None)
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
            sizes[a] = t.untyped_storage().nbytes()
            t.untyped_storage().resize_(0)
    p._lptrain_released = sizes


def restore_storage(p: Any) -> None:
    for a, n in (getattr(p, "_lptrain_released", None) or {}).items():
        t = getattr(p, a, None)
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() != n:
            t.untyped_storage().resize_(n)
    p._lptrain_released = {}
