"""TE's storage layouts, filled by lptrain's emulated quantizers, and read back.

Per quantizer kind, what TE's C++ stores (the shapes TE's Python ``get_scale_shape`` /
``get_columnwise_shape`` describe; padding is zero):

* ``Float8Quantizer`` / ``Float8CurrentScalingQuantizer``: ``_data`` uint8 of the input's
  shape, ``_transpose`` the byte transpose ``[K, *rest]`` (not on compute capability 10.x,
  whose GEMMs take the row-wise bytes either way), ``_scale_inv`` (1,) fp32;
* ``MXFP8Quantizer``: ``_rowwise_data`` / ``_columnwise_data`` uint8 of the input's shape
  (column-wise blocks run down the rows, not transposed), E8M0 ``_rowwise_scale_inv``
  ``[M, K/32]`` padded to ``[128a, 4b]``, ``_columnwise_scale_inv`` ``[M/32, K]`` padded to
  ``[4a, 128b]``; with ``optimize_for_gemm`` (2.12+) the scales are GEMM-swizzled
  (:func:`swizzle`);
* ``Float8BlockQuantizer``: ``_rowwise_data`` of the input's shape, ``_columnwise_data``
  transposed ``[K, M]``; GEMM-ready fp32 scales: 1x128 row-wise ``[ceil(K/128), M pad 4]``
  (transposed), column-wise ``[ceil(M/128), K pad 4]``; 128x128 ``[ceil(M/128),
  ceil(K/128) pad 4]`` and, column-wise, ``[ceil(K/128), ceil(M/128) pad 4]``;
* ``NVFP4Quantizer``: packed E2M1 ``_rowwise_data`` ``[M, K/2]``, column-wise ``[K, M/2]``;
  E4M3 scales ``[M pad 128, K/16 pad 4]`` / ``[K pad 128, M/16 pad 4]``; fp32
  ``_amax_rowwise`` / ``_amax_columnwise`` (1,).
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Optional

import torch

from lptrain.precision import formats as F
from lptrain.precision import scaling as S

KINDS = ("Float8Quantizer", "Float8CurrentScalingQuantizer", "MXFP8Quantizer", "Float8BlockQuantizer",
         "NVFP4Quantizer")

# kind -> (module, tensor class, storage class names by release: 2.9+ "Storage", before "Base")
_CLASSES = {
    "Float8Quantizer": ("float8_tensor", "Float8Tensor"),
    "Float8CurrentScalingQuantizer": ("float8_tensor", "Float8Tensor"),
    "MXFP8Quantizer": ("mxfp8_tensor", "MXFP8Tensor"),
    "Float8BlockQuantizer": ("float8_blockwise_tensor", "Float8BlockwiseQTensor"),
    "NVFP4Quantizer": ("nvfp4_tensor", "NVFP4Tensor"),
}


def not_emulated(what: str) -> Exception:
    from ..extension import NotEmulatedError

    return NotEmulatedError(f"transformer_engine_torch: {what} is not emulated by lptrain.testing.te_python")


def python_class(kind: str, internal: bool) -> type:
    """TE's Python class the C++ constructs for ``kind`` (storage when ``internal``)."""
    module, name = _CLASSES[kind]
    if not internal:
        return getattr(importlib.import_module(f"transformer_engine.pytorch.tensor.{module}"), name)
    for path, cls in ((f"transformer_engine.pytorch.tensor.storage.{module}_storage", f"{name}Storage"),
                      (f"transformer_engine.pytorch.tensor._internal.{module}_base", f"{name}Base")):
        try:
            return getattr(importlib.import_module(path), cls)
        except (ImportError, AttributeError):
            continue
    raise not_emulated(f"the storage class of {name}")


def _fmt(te_dtype: Any) -> F.FP8Format:
    name = getattr(te_dtype, "name", str(te_dtype))
    if "E5M2" in name:
        return F.E5M2
    if "E4M3" in name:
        return F.E4M3
    raise not_emulated(f"FP8 element type {name}")


def torch_dtype(te_dtype: Any) -> torch.dtype:
    if isinstance(te_dtype, torch.dtype):
        return te_dtype
    table = {"kFloat32": torch.float32, "kBFloat16": torch.bfloat16, "kFloat16": torch.float16,
             "kByte": torch.uint8, "kInt32": torch.int32}
    name = getattr(te_dtype, "name", str(te_dtype))
    if name not in table:
        raise not_emulated(f"output type {name}")
    return table[name]


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad2(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = torch.zeros(rows, cols, dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def non_tn_fp8_gemm() -> bool:
    """TE's ``nvte_is_non_tn_fp8_gemm_supported``: compute capability 10.x (Blackwell)."""
    return torch.cuda.get_device_capability()[0] == 10


def swizzle(scales: torch.Tensor) -> torch.Tensor:
    """cuBLAS's block-scaling-factor layout of a ``[128a, 4b]`` scale grid: each 128x4 tile
    becomes 512 contiguous bytes, row r of the tile at ``(r % 32) * 16 + (r // 32) * 4``."""
    rows, cols = scales.shape
    t = scales.reshape(rows // 128, 4, 32, cols // 4, 4)  # tile row, r//32, r%32, tile col, c
    return t.permute(0, 3, 2, 1, 4).reshape(rows, cols).contiguous()


def unswizzle(scales: torch.Tensor) -> torch.Tensor:
    rows, cols = scales.shape
    t = scales.reshape(rows // 128, cols // 4, 32, 4, 4)
    return t.permute(0, 3, 2, 1, 4).reshape(rows, cols).contiguous()


def _usage(q: Any) -> tuple[bool, bool]:
    return bool(getattr(q, "rowwise_usage", True)), bool(getattr(q, "columnwise_usage", True))


# -- the casts -------------------------------------------------------------------------------------


def _float8(kind: str, q: Any, x2d: torch.Tensor, shape: tuple[int, ...]) -> dict[str, Any]:
    fmt = _fmt(q.dtype)
    xf = x2d.float()
    amax = S.amax(xf).reshape(1)
    if kind == "Float8Quantizer":  # delayed: the recipe's scale; an atomic max into the history slot
        scale = q.scale.reshape(1).float()
        if isinstance(q.amax, torch.Tensor) and q.amax.numel():  # (an empty amax: nothing recorded)
            with torch.no_grad():
                q.amax.reshape(1).copy_(torch.maximum(q.amax.reshape(1), amax.to(q.amax.dtype)))
    else:
        if getattr(q, "with_amax_reduction", False):
            group = q.amax_reduction_group
            amax = S.maybe_reduce_amax(amax, group)
        scale = S.compute_scale_from_amax(amax, fmt.max, bool(q.force_pow_2_scales), float(q.amax_epsilon))
        with torch.no_grad():  # up to 2.1x the quantizer owns the buffers; later ones are the C++'s
            for attr, value in (("amax", amax), ("scale", scale)):
                buf = getattr(q, attr, None)
                if isinstance(buf, torch.Tensor):
                    buf.reshape(1).copy_(value)
    data = F.cast_to_fp8(xf * scale, fmt, inplace=True)
    row, col = _usage(q)
    with_data = row or non_tn_fp8_gemm()
    with_t = col and not non_tn_fp8_gemm()
    return {"data": data.reshape(shape) if with_data else None,
            "data_transpose": data.t().contiguous().reshape(_tshape(shape)) if with_t else None,
            "fp8_scale_inv": torch.reciprocal(scale), "fp8_dtype": q.dtype}


def _tshape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[-1], *shape[:-1]) if shape else shape


def _mxfp8(q: Any, x2d: torch.Tensor, shape: tuple[int, ...]) -> dict[str, Any]:
    from lptrain.precision.tensors.mxfp8 import MXFP8Quantizer

    row, col = _usage(q)
    m, k = x2d.shape
    emu = MXFP8Quantizer("input", row, col, fp8_format=_fmt(q.dtype))
    f = emu._quantize_fields(x2d)
    swz = bool(getattr(q, "optimize_for_gemm", False))
    out: dict[str, Any] = {"fp8_dtype": q.dtype, "with_gemm_swizzled_scales": swz,
                           "rowwise_data": None, "rowwise_scale_inv": None,
                           "columnwise_data": None, "columnwise_scale_inv": None}
    if row:
        s = _pad2(f["rowwise_scale_inv"], _up(m, 128), _up(k // 32, 4))
        out["rowwise_data"] = f["rowwise_data"].reshape(shape)
        out["rowwise_scale_inv"] = swizzle(s) if swz else s
    if col:
        s = _pad2(f["columnwise_scale_inv"], _up(m // 32, 4), _up(k, 128))
        out["columnwise_data"] = f["columnwise_data"].reshape(shape)
        out["columnwise_scale_inv"] = swizzle(s.t().contiguous()).t().contiguous() if swz else s
    return out


def _blockwise(q: Any, x2d: torch.Tensor, shape: tuple[int, ...]) -> dict[str, Any]:
    from lptrain.precision.tensors.blockwise import BlockwiseQuantizer

    if getattr(q, "all_gather_usage", False):
        raise not_emulated("Float8BlockQuantizer with all_gather_usage (compact scales)")
    row, col = _usage(q)
    m, k = x2d.shape
    dim = int(q.block_scaling_dim)
    emu = BlockwiseQuantizer("input", row, col, fp8_format=_fmt(q.dtype), block_dim=dim,
                             power_2_scale=bool(q.force_pow_2_scales), amax_epsilon=float(q.amax_epsilon))
    f = emu._quantize_fields(x2d)
    nm, nk = -(-m // 128), -(-k // 128)
    out: dict[str, Any] = {"fp8_dtype": q.dtype, "is_2D_scaled": dim == 2, "rowwise_data": None,
                           "rowwise_scale_inv": None, "columnwise_data": None, "columnwise_scale_inv": None}
    try:
        fmt_enum = importlib.import_module("transformer_engine_torch").Float8BlockScaleTensorFormat
        out["data_format"] = fmt_enum.GEMM_READY
    except AttributeError:
        pass
    if row:
        out["rowwise_data"] = f["rowwise_data"].reshape(shape)
        s = f["rowwise_scale_inv"]  # 2D [nm, nk]; 1D [M, nk]
        out["rowwise_scale_inv"] = _pad2(s, nm, _up(nk, 4)) if dim == 2 else _pad2(s.t(), nk, _up(m, 4))
    if col:
        out["columnwise_data"] = f["columnwise_data"].reshape(_tshape(shape))
        s = f["columnwise_scale_inv"]  # 2D [nk, nm]; 1D [K, nm]
        out["columnwise_scale_inv"] = _pad2(s, nk, _up(nm, 4)) if dim == 2 else _pad2(s.t(), nm, _up(k, 4))
    return out


def _nvfp4(q: Any, x2d: torch.Tensor, shape: tuple[int, ...]) -> dict[str, Any]:
    from lptrain.precision.tensors.nvfp4 import NVFP4Quantizer

    row, col = _usage(q)
    m, k = x2d.shape
    group = q.amax_reduction_group if getattr(q, "with_amax_reduction", False) else None
    sr = bool(getattr(q, "stochastic_rounding", False))
    gen = None
    if sr:  # TE's kernels draw from CUDA's default generator (the virtual GPU's)
        gen = torch.cuda.default_generators[0]
    emu = NVFP4Quantizer("grad" if sr else "input", row, col, with_rht=bool(getattr(q, "with_rht", False)),
                         stochastic_rounding=sr, use_2d=bool(getattr(q, "with_2d_quantization", False)),
                         generator=gen, amax_reduction=group)
    f = emu._quantize_fields(x2d)
    swz = bool(getattr(q, "optimize_for_gemm", False))
    out: dict[str, Any] = {"fp4_dtype": q.dtype, "with_gemm_swizzled_scales": swz, "rowwise_data": None,
                           "rowwise_scale_inv": None, "columnwise_data": None, "columnwise_scale_inv": None,
                           "amax_rowwise": None, "amax_columnwise": None}
    if row:
        s = _pad2(f["rowwise_scale_inv"], _up(m, 128), _up(-(-k // 16), 4))
        out["rowwise_data"] = f["rowwise_data"].reshape(*shape[:-1], k // 2)
        out["rowwise_scale_inv"] = swizzle(s) if swz else s
        out["amax_rowwise"] = f["amax_rowwise"].reshape(1).float()
    if col:
        s = _pad2(f["columnwise_scale_inv"], _up(k, 128), _up(-(-m // 16), 4))
        out["columnwise_data"] = f["columnwise_data"]
        out["columnwise_scale_inv"] = swizzle(s) if swz else s
        out["amax_columnwise"] = f["amax_columnwise"].reshape(1).float()
    return out


def compute(kind: str, q: Any, x2d: torch.Tensor, shape: tuple[int, ...]) -> dict[str, Any]:
    """The constructor keywords (data, scales, dtype) of ``kind``'s cast of ``x2d``."""
    if kind in ("Float8Quantizer", "Float8CurrentScalingQuantizer"):
        return _float8(kind, q, x2d, shape)
    if kind == "MXFP8Quantizer":
        return _mxfp8(q, x2d, shape)
    if kind == "Float8BlockQuantizer":
        return _blockwise(q, x2d, shape)
    return _nvfp4(q, x2d, shape)


def empty(kind: str, q: Any, shape: tuple[int, ...], device: Any) -> dict[str, Any]:
    """Uninitialised (zero) buffers of ``kind`` for ``shape``: a cast of zeros with the
    quantizer's state left untouched."""
    x = torch.zeros(math.prod(shape[:-1]) if shape else 1, shape[-1] if shape else 1,
                    dtype=torch.float32, device=device)
    if kind == "Float8Quantizer":
        row, col = _usage(q)
        with_data, with_t = row or non_tn_fp8_gemm(), col and not non_tn_fp8_gemm()
        u8 = torch.zeros(shape, dtype=torch.uint8, device=device)
        return {"data": u8 if with_data else None,
                "data_transpose": torch.zeros(_tshape(shape), dtype=torch.uint8, device=device) if with_t else None,
                "fp8_scale_inv": torch.reciprocal(q.scale.reshape(1).float()).clone(), "fp8_dtype": q.dtype}
    if kind == "Float8CurrentScalingQuantizer":
        saved = {a: getattr(q, a).clone() for a in ("amax", "scale") if isinstance(getattr(q, a, None), torch.Tensor)}
        out = compute(kind, _NoReduce(q), x, shape)
        for a, v in saved.items():
            getattr(q, a).copy_(v)
        return out
    if kind == "NVFP4Quantizer":
        out = compute(kind, _NoReduce(q), x, shape)
        return out
    return compute(kind, q, x, shape)


class _NoReduce:
    """A quantizer view without amax reduction or stochastic rounding (empty buffers)."""

    def __init__(self, q: Any) -> None:
        self._q = q

    def __getattr__(self, name: str) -> Any:
        if name in ("with_amax_reduction", "stochastic_rounding"):
            return False
        return getattr(self._q, name)


# -- refilling an existing tensor (convert_and_update_tensor) ---------------------------------------

_ATTR = {"data": "_data", "data_transpose": "_transpose", "fp8_scale_inv": "_scale_inv",
         "rowwise_data": "_rowwise_data", "rowwise_scale_inv": "_rowwise_scale_inv",
         "columnwise_data": "_columnwise_data", "columnwise_scale_inv": "_columnwise_scale_inv",
         "amax_rowwise": "_amax_rowwise", "amax_columnwise": "_amax_columnwise"}


def fill(kind: str, out: Any, fields: dict[str, Any], shape: tuple[int, ...]) -> None:
    """Write ``fields`` into ``out``'s buffers in place (a buffer of the right size is kept,
    so views of it -- a byte-gathered parameter's bucket -- see the new values)."""
    for key, attr in _ATTR.items():
        if key not in fields or not hasattr(out, attr):
            continue
        new = fields[key]
        old = getattr(out, attr)
        if new is None:
            if (key == "data" and old is not None) or key != "data":  # TE drops unused row-wise data only off 10.x
                setattr(out, attr, None)
            continue
        if isinstance(old, torch.Tensor) and old.numel() == new.numel() and old.dtype == new.dtype \
                and old.untyped_storage().nbytes():
            with torch.no_grad():
                old.copy_(new.reshape(old.shape))
        else:
            setattr(out, attr, new)
    if kind in ("Float8Quantizer", "Float8CurrentScalingQuantizer"):
        out._transpose_invalid = fields.get("data_transpose") is None
        out._fp8_dtype = fields["fp8_dtype"]
    if "with_gemm_swizzled_scales" in fields and hasattr(out, "_with_gemm_swizzled_scales"):
        out._with_gemm_swizzled_scales = fields["with_gemm_swizzled_scales"]


# -- reading back --------------------------------------------------------------------------------


def _has(t: Any, attr: str) -> Optional[torch.Tensor]:
    v = getattr(t, attr, None)
    return v if isinstance(v, torch.Tensor) else None


def logical_shape(t: Any) -> tuple[int, ...]:
    """The logical (row-wise) shape of a TE quantized tensor or storage object."""
    for attr in ("_data", "_rowwise_data"):
        d = _has(t, attr)
        if d is not None:
            if type(t).__name__.startswith("NVFP4"):
                return (*d.shape[:-1], d.shape[-1] * 2)
            return tuple(d.shape)
    for attr in ("_transpose", "_columnwise_data"):
        d = _has(t, attr)
        if d is not None:
            if type(t).__name__.startswith("MXFP8"):
                return tuple(d.shape)
            s = tuple(d.shape)
            if type(t).__name__.startswith("NVFP4"):
                s = (*s[:-1], s[-1] * 2)
            return (*s[1:], s[0])
    raise not_emulated(f"reading a {type(t).__name__} with no data")


def dequantize(t: Any, prefer_rowwise: bool = True, orientation: Optional[str] = None) -> torch.Tensor:
    """fp32 values of a TE quantized tensor/storage in its logical shape, from the row-wise
    or column-wise buffers (``orientation``; default: row-wise where present)."""
    name = type(t).__name__
    shape = logical_shape(t)
    m, k = (math.prod(shape[:-1]) if shape else 1), (shape[-1] if shape else 1)
    row_ok = _has(t, "_data") is not None or _has(t, "_rowwise_data") is not None
    use_row = row_ok if orientation is None else orientation == "rowwise"
    if name.startswith("Float8Tensor") or name.startswith("Float8TensorBase") or name.startswith("Float8TensorStorage"):
        fmt = _fmt(t._fp8_dtype)
        sinv = t._scale_inv.reshape(1).float()
        if use_row and _has(t, "_data") is not None:
            vals = F.fp8_to_float(t._data.reshape(m, k), fmt) * sinv
        else:
            src = t._transpose if _has(t, "_transpose") is not None else t._data
            vals = F.fp8_to_float(src.reshape(k, m), fmt).t() * sinv if src is t._transpose else \
                F.fp8_to_float(src.reshape(m, k), fmt) * sinv
        return vals.reshape(shape)
    if name.startswith("MXFP8"):
        fmt = _fmt(t._fp8_dtype)
        swz = bool(getattr(t, "_with_gemm_swizzled_scales", False))
        if use_row:
            codes = t._rowwise_scale_inv
            codes = unswizzle(codes) if swz else codes
            s = S.e8m0_to_dequant_scale(codes[:m, : k // 32]).repeat_interleave(32, 1)
            return (F.fp8_to_float(t._rowwise_data.reshape(m, k), fmt) * s).reshape(shape)
        codes = t._columnwise_scale_inv
        codes = unswizzle(codes.t().contiguous()).t() if swz else codes
        s = S.e8m0_to_dequant_scale(codes[: m // 32, :k]).repeat_interleave(32, 0)
        return (F.fp8_to_float(t._columnwise_data.reshape(m, k), fmt) * s).reshape(shape)
    if name.startswith("Float8BlockwiseQ"):
        fmt = _fmt(t._fp8_dtype)
        two_d = bool(t._is_2D_scaled)
        nm, nk = -(-m // 128), -(-k // 128)
        if use_row:
            vals = F.fp8_to_float(t._rowwise_data.reshape(m, k), fmt)
            s = t._rowwise_scale_inv
            grid = s[:nm, :nk] if two_d else s[:nk, :m].t()  # [nm, nk] / [M, nk]
            full = grid.repeat_interleave(128, 0)[:m] if two_d else grid
            return (vals * full.repeat_interleave(128, 1)[:, :k]).reshape(shape)
        vals = F.fp8_to_float(t._columnwise_data.reshape(k, m), fmt)  # [K, M]
        s = t._columnwise_scale_inv
        grid = s[:nk, :nm] if two_d else s[:nm, :k].t()  # [nk, nm] / [K, nm]
        full = grid.repeat_interleave(128, 0)[:k] if two_d else grid
        return (vals * full.repeat_interleave(128, 1)[:, :m]).t().reshape(shape)
    if name.startswith("NVFP4"):
        swz = bool(getattr(t, "_with_gemm_swizzled_scales", False))
        if use_row:
            codes = F.unpack_fp4(t._rowwise_data.reshape(m, k // 2))
            sb = t._rowwise_scale_inv
            sb = unswizzle(sb) if swz else sb
            scale = S.nvfp4_dequant_block_scale(sb[:m, : k // 16], t._amax_rowwise)
            return (F.e2m1_to_float(codes) * scale.repeat_interleave(16, 1)).reshape(shape)
        codes = F.unpack_fp4(t._columnwise_data.reshape(k, m // 2))
        sb = t._columnwise_scale_inv
        sb = unswizzle(sb) if swz else sb
        scale = S.nvfp4_dequant_block_scale(sb[:k, : m // 16], t._amax_columnwise)
        return (F.e2m1_to_float(codes) * scale.repeat_interleave(16, 1)).t().reshape(shape)
    raise not_emulated(f"dequantize of {name}")
