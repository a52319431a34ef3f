"""The grouped-tensor kernels: TE 2.19+'s ``GroupedLinear`` on its native grouped-tensor path
(a single grouped expert weight, ``use_grouped_tensor=True``).

TE's Python packs the experts' operands into ``GroupedTensorStorage`` objects (one flat
buffer per field, ``num_tensors`` members) and calls four extension functions, emulated here
with the C++ semantics:

* ``splits_to_offsets_multi(split_sizes, device, *, strides, include_leading_zero, dtypes,
  bulk_allocate)`` -> ``(split_sizes as int64 on device, [offsets])``: per output ``i`` the
  inclusive prefix sum of the splits times ``strides[i]``, with a leading zero when
  ``include_leading_zero[i]`` (length ``N + 1``), in ``dtypes[i]``;
* ``group_quantize(tensor, quantizer, num_tensors, first_dims, last_dims=None,
  tensor_offsets=None, noop_flag=None, output=None)``: the rows of a 2-D ``tensor`` split
  into members (``first_dims``: each member's rows, a device int64 tensor; None: equal
  parts) and each member cast by ``quantizer`` -- into a new grouped tensor (TE's
  ``GroupedTensorStorage`` when ``quantizer.internal``, else ``GroupedTensor``, built with
  the keywords TE's C++ passes) or, with uniform members only, refilled in place into
  ``output`` (TE's weight cache). MXFP8 only: each member's fields are the emulated MXFP8
  cast of that member (:mod:`.layouts`), data concatenated row after row, scale grids
  (each member's padded ``get_scale_shape``, GEMM-swizzled per member with
  ``optimize_for_gemm``) concatenated -- the layout TE's own Python views members in. TE's
  kernel refuses a first dimension that is not a multiple of 128; with GEMM-swizzled scales
  it writes the row-wise scales in 128-row tiles of the whole tensor, while the
  grouped GEMM reads member ``i``'s scales after the 128-row-padded grids of the members
  before it, so a member of other than a multiple of 128 rows misplaces its neighbour's
  scales: refused here (lptrain pads single-grouped MXFP8 experts to 128 rows on TE);
* ``te_general_grouped_gemm_for_grouped_tensor(A, transa, B, transb, D, bias, bias_scale,
  alpha, beta, ...)``: per member ``D_i = alpha_i * op_B(B_i) @ op_A(A_i) + beta_i * D_i``
  in row-major terms (as :func:`.gemm.generic_gemm`: forward ``TN``, data gradient ``NN``,
  weight gradient ``NT``), the product in fp32 from exactly dequantized operands (row-wise
  or column-wise copy as the transposes say), written into ``D``'s member in its dtype (an
  fp32 ``main_grad`` for the fused weight-gradient accumulation, ``beta = 1``); a member
  with no rows gives zeros (or leaves an accumulated gradient as it was). ``alpha`` /
  ``beta`` hold one value per member on Blackwell, one shared value on Hopper; the C++'s
  refusals are kept (device, cuBLASLt 13.3+ / 13.4+ on Hopper, alpha/beta counts, A and B
  not both MXFP8 or both unquantized); an operand with unswizzled scales is swizzled first,
  as the extension does;
* ``get_grouped_gemm_setup_workspace_size(num_tensors)``: the bytes of the setup workspace.

Bias and the discrete-operand variants (``..._for_discrete_in`` / ``_out``) are not emulated:
lptrain's experts have no bias and take this path only with a single grouped weight.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import torch

from . import cast
from . import layouts as L


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


# ---- offsets ------------------------------------------------------------------------------------


def splits_to_offsets_multi(split_sizes: Any, device: Any, *, strides: list[int], include_leading_zero: list[bool],
                            dtypes: list[torch.dtype], bulk_allocate: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``tex.splits_to_offsets_multi`` (see the module doc)."""
    if not (len(strides) == len(include_leading_zero) == len(dtypes)):
        raise RuntimeError("strides, include_leading_zero, and dtypes must have matching lengths")
    sizes = split_sizes if isinstance(split_sizes, torch.Tensor) else torch.tensor(list(split_sizes))
    sizes = sizes.to(device=device, dtype=torch.int64)
    scan = torch.cumsum(sizes, 0)
    outs = []
    for stride, lead, dtype in zip(strides, include_leading_zero, dtypes, strict=True):
        s = scan * int(stride)
        if lead:
            s = torch.cat([s.new_zeros(1), s])
        outs.append(s.to(dtype))
    return sizes, outs


def get_grouped_gemm_setup_workspace_size(num_tensors: int) -> int:
    """``tex.get_grouped_gemm_setup_workspace_size``: the per-member pointer and shape arrays
    the setup kernel writes (here nothing reads it)."""
    return 64 * max(1, int(num_tensors))


# ---- members of a grouped tensor --------------------------------------------------------------


def member_shapes(g: Any) -> list[tuple[int, int]]:
    """Each member's 2-D shape."""
    n = int(g.num_tensors)
    first, last = g.logical_shape
    if g.first_dims is not None and g.last_dims is not None:
        return list(zip(g.first_dims.tolist(), g.last_dims.tolist(), strict=True))
    if g.first_dims is not None:
        return [(int(m), int(last)) for m in g.first_dims.tolist()]
    if g.last_dims is not None:
        return [(int(first), int(k)) for k in g.last_dims.tolist()]
    shapes = getattr(g, "tensor_shapes", None)
    if shapes:
        return [(1, int(s[0])) if len(s) == 1 else (int(s[0]), int(s[1])) for s in shapes]
    return [(int(first) // n, int(last))] * n


def _offsets(sizes: list[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


Layout = tuple[list[tuple[int, int]], list[int]]


def layout(g: Any) -> Layout:
    """Each member's 2-D shape and where its elements start in the flat buffer:
    ``tensor_offsets`` when the grouped tensor carries them (the C++ reads them first), else
    the sum of the members before (read once per call: the dims live on the device)."""
    shapes = member_shapes(g)
    offsets = getattr(g, "tensor_offsets", None)
    if offsets is not None:
        return shapes, [int(v) for v in offsets.tolist()[:len(shapes)]]
    return shapes, _offsets([a * b for a, b in shapes])[:-1]


def _mxfp8_scale_sizes(shapes: list[tuple[int, int]], columnwise: bool) -> list[int]:
    if columnwise:
        return [_up(m // 32, 4) * _up(k, 128) for m, k in shapes]
    return [_up(m, 128) * _up(-(-k // 32), 4) for m, k in shapes]


def _kind(g: Any) -> Optional[str]:
    q = getattr(g, "quantizer", None)
    if q is None:
        return None
    kind = cast._kind(q)
    if kind != "MXFP8Quantizer":
        raise L.not_emulated(f"grouped tensors with {kind} (only MXFP8 and unquantized are)")
    return kind


class _MXFP8Member:
    """One member of an MXFP8 grouped tensor, read the way :func:`.layouts.dequantize` reads
    TE's ``MXFP8TensorStorage`` (the class name selects the layout)."""

    def __init__(self, g: Any, i: int, lay: Layout) -> None:
        shapes, starts = lay
        m, k = shapes[i]
        lo = starts[i]
        self._fp8_dtype = g.quantizer.dtype
        self._with_gemm_swizzled_scales = bool(g._with_gemm_swizzled_scales)
        self._rowwise_data = self._rowwise_scale_inv = None
        self._columnwise_data = self._columnwise_scale_inv = None
        if g.rowwise_data is not None:
            s = _offsets(_mxfp8_scale_sizes(shapes, False))
            self._rowwise_data = g.rowwise_data.reshape(-1)[lo:lo + m * k].view(m, k)
            self._rowwise_scale_inv = g.scale_inv.reshape(-1)[s[i]:s[i + 1]].view(_up(m, 128), -1)
        if g.columnwise_data is not None:
            s = _offsets(_mxfp8_scale_sizes(shapes, True))
            self._columnwise_data = g.columnwise_data.reshape(-1)[lo:lo + m * k].view(m, k)
            self._columnwise_scale_inv = g.columnwise_scale_inv.reshape(-1)[s[i]:s[i + 1]].view(_up(m // 32, 4), -1)


_MXFP8Member.__name__ = "MXFP8Member"


def member_values(g: Any, i: int, rowwise: bool, lay: Optional[Layout] = None) -> torch.Tensor:
    """Member ``i`` of grouped tensor ``g`` as fp32 ``[m, k]``: a plain member's values, or a
    quantized member dequantized from its row-wise or column-wise copy (``lay``: its
    :func:`layout`, computed if not given)."""
    shapes, starts = lay = lay or layout(g)
    m, k = shapes[i]
    if _kind(g) is None:
        return g.rowwise_data.reshape(-1)[starts[i]:starts[i] + m * k].view(m, k).float()
    if m == 0:
        return torch.zeros(0, k, device=(g.rowwise_data if g.rowwise_data is not None else g.columnwise_data).device)
    return L.dequantize(_MXFP8Member(g, i, lay), orientation="rowwise" if rowwise else "columnwise")


def _member_target(g: Any, i: int, lay: Layout) -> torch.Tensor:
    """Member ``i`` of a plain grouped tensor as a writable ``[m, k]`` view of its buffer."""
    if _kind(g) is not None:
        raise L.not_emulated("a grouped GEMM writing a quantized output")
    shapes, starts = lay
    m, k = shapes[i]
    return g.rowwise_data.reshape(-1)[starts[i]:starts[i] + m * k].view(m, k)


# ---- group_quantize ------------------------------------------------------------------------------


def _grouped_class(internal: bool) -> type:
    mod = "transformer_engine.pytorch.tensor.storage.grouped_tensor_storage" if internal else \
        "transformer_engine.pytorch.tensor.grouped_tensor"
    return getattr(importlib.import_module(mod), "GroupedTensorStorage" if internal else "GroupedTensor")


def _check_rows(rows: list[int], swizzled: bool) -> None:
    total = sum(rows)
    if total % 128:
        raise RuntimeError("group_quantize (MXFP8): the first logical dimension of a grouped tensor "
                           f"must be divisible by 128 (got {total})")
    if swizzled and any(r % 128 for r in rows):
        raise RuntimeError(
            f"group_quantize (MXFP8) of members with {rows} rows: every member's rows must be divisible "
            "by 128 -- TE's kernel swizzles the row-wise scales in 128-row tiles of the whole tensor "
            "while its grouped GEMM reads member i's scales after the 128-row-padded grids of the "
            "members before it, so a member boundary inside a tile misplaces the next member's scales "
            "(a silent wrong product on a GPU; refused here)")


def _cast_members(x: torch.Tensor, quantizer: Any, shapes: list[tuple[int, int]]) -> dict[str, Optional[torch.Tensor]]:
    """The concatenated fields of every member's MXFP8 cast (see the module doc)."""
    row, col = L._usage(quantizer)
    parts: dict[str, list[torch.Tensor]] = {"data": [], "scale_inv": [], "columnwise_data": [],
                                            "columnwise_scale_inv": []}
    start = 0
    for m, k in shapes:
        piece = x[start:start + m]
        start += m
        if m == 0:
            continue
        f = L.compute("MXFP8Quantizer", quantizer, piece, (m, k))
        if row:
            parts["data"].append(f["rowwise_data"].reshape(-1))
            parts["scale_inv"].append(f["rowwise_scale_inv"].reshape(-1))
        if col:
            parts["columnwise_data"].append(f["columnwise_data"].reshape(-1))
            parts["columnwise_scale_inv"].append(f["columnwise_scale_inv"].reshape(-1))
    empty = x.new_empty(0, dtype=torch.uint8)
    used = {"data": row, "scale_inv": row, "columnwise_data": col, "columnwise_scale_inv": col}
    return {name: (torch.cat(p) if p else empty) if used[name] else None for name, p in parts.items()}


def group_quantize(tensor: torch.Tensor, quantizer: Any, num_tensors: int, first_dims: Optional[torch.Tensor],
                   last_dims: Optional[torch.Tensor] = None, tensor_offsets: Optional[torch.Tensor] = None,
                   noop_flag: Optional[torch.Tensor] = None, output: Any = None) -> Any:
    """``tex.group_quantize`` (see the module doc)."""
    if tensor.dim() != 2:
        raise RuntimeError("Tensor must be 2D")
    kind = cast._kind(quantizer)
    if kind != "MXFP8Quantizer":
        raise L.not_emulated(f"group_quantize with {kind} (only MXFP8 is emulated)")
    if last_dims is not None:
        raise L.not_emulated("group_quantize with varying last dimensions")
    if getattr(quantizer, "with_2d_quantization", False):
        raise L.not_emulated("group_quantize with 2-D MXFP8 quantization")
    n = int(num_tensors)
    first, last = (int(s) for s in tensor.shape)
    rows = [int(r) for r in first_dims.tolist()] if first_dims is not None else [first // n] * n
    shapes = [(r, last) for r in rows]
    x = tensor.detach()
    if output is not None:
        if first_dims is not None or tensor_offsets is not None:
            raise RuntimeError("group_quantize: output reuse currently requires uniform tensor shapes.")
        if int(output.num_tensors) != n or tuple(output.logical_shape) != (first, last):
            raise RuntimeError("group_quantize: output has a different number of tensors or logical shape.")
        if output.quantizer is None:
            raise RuntimeError("group_quantize: output must have quantized storage.")
        if output.quantizer is not quantizer:
            raise RuntimeError("group_quantize: output must have been created by the same quantizer.")
        if cast._noop(noop_flag) or first == 0 or last == 0:
            return output
        _check_rows(rows, swizzled=bool(getattr(quantizer, "optimize_for_gemm", False)))
        fields = _cast_members(x, quantizer, shapes)
        with torch.no_grad():
            for name, value in fields.items():
                buf = getattr(output, "rowwise_data" if name == "data" else name)
                if value is not None and buf is not None:
                    buf.reshape(-1).copy_(value)
        return output
    if first_dims is not None and tensor_offsets is None:
        tensor_offsets = torch.cat([first_dims.new_zeros(1), torch.cumsum(first_dims.to(torch.int64) * last, 0)])
    fields: dict[str, Any] = {}
    if first and last and not cast._noop(noop_flag):
        _check_rows(rows, swizzled=bool(getattr(quantizer, "optimize_for_gemm", False)))
        fields = _cast_members(x, quantizer, shapes)
    else:  # (TE returns the allocated, unwritten output)
        row, col = L._usage(quantizer)
        sizes = {"data": first * last if row else None, "columnwise_data": first * last if col else None,
                 "scale_inv": sum(_mxfp8_scale_sizes(shapes, False)) if row else None,
                 "columnwise_scale_inv": sum(_mxfp8_scale_sizes(shapes, True)) if col else None}
        fields = {k: None if v is None else torch.zeros(v, dtype=torch.uint8, device=x.device) for k, v in sizes.items()}
    kwargs = {"shape": [first, last], "stride": [last, 1], "dtype": x.dtype, "num_tensors": n,
              "quantizer": quantizer, **fields, "amax": None, "columnwise_amax": None, "scale": None,
              "first_dims": first_dims, "last_dims": None, "tensor_offsets": tensor_offsets,
              "with_gemm_swizzled_scales": bool(getattr(quantizer, "optimize_for_gemm", False))}
    return cast._construct(_grouped_class(bool(getattr(quantizer, "internal", False))), kwargs)


# ---- the grouped GEMM ----------------------------------------------------------------------------


def _check_gemm(A: Any, B: Any, D: Any, alpha: torch.Tensor, beta: torch.Tensor) -> None:
    """The C++'s refusals: the device and cuBLASLt (13.3+, 13.4+ on Hopper), the member counts,
    alpha/beta (one per member on Blackwell, one on Hopper), operands both MXFP8 or both
    unquantized, and a 16- or 32-bit output. (An MXFP8 operand whose scales are not
    GEMM-swizzled is swizzled by the extension first: a layout change the dequantization
    reads through, so no refusal.)"""
    from . import device

    api = "te_general_grouped_gemm_for_grouped_tensor"
    major, minor = torch.cuda.get_device_capability()
    sm, cublas = major * 10 + minor, device.cublaslt_version()
    if not 90 <= sm <= 110:
        raise RuntimeError(f"{api} requires Hopper (SM90) or Blackwell (SM10x and SM110).")
    if cublas < 130300 or (sm < 100 and cublas < 130400):
        need = "13.3+" if sm >= 100 else "13.4+ on Hopper (SM90)"
        raise RuntimeError(f"{api} requires cuBLAS {need}, but run-time cuBLAS version is {cublas}")
    n = int(A.num_tensors)
    if n < 1 or int(B.num_tensors) != n or int(D.num_tensors) != n:
        raise RuntimeError("Grouped GEMM: number of tensors must be at least 1 and the same in A, B and D")
    per_member = 100 <= sm <= 110
    for name, t in (("alpha", alpha), ("beta", beta)):
        if t.numel() != (n if per_member else 1):
            raise RuntimeError(f"Grouped GEMM: {name} must have {'num_tensors' if per_member else '1'} "
                               f"element(s), got {t.numel()}")
    kinds = {_kind(A), _kind(B)}
    if len(kinds) != 1:
        raise RuntimeError("Grouped GEMM: A and B must both use MXFP8 scaling or both not.")
    if D.rowwise_data is None or D.rowwise_data.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise RuntimeError("Grouped GEMM: D must be BF16, FP16, or FP32.")


def _per_member(t: torch.Tensor, n: int) -> list[float]:
    vals = [float(v) for v in t.reshape(-1).tolist()]
    return vals * n if len(vals) == 1 else vals


def te_general_grouped_gemm_for_grouped_tensor(A: Any, transa: bool, B: Any, transb: bool, D: Any, bias: Any,
                                               bias_scale: Any, alpha: torch.Tensor, beta: torch.Tensor,
                                               workspace_setup: Any, workspace_cublas: Any,
                                               use_split_accumulator: bool, math_sm_count: int) -> Any:
    """``tex.te_general_grouped_gemm_for_grouped_tensor`` (see the module doc)."""
    if bias is not None:
        raise L.not_emulated("a grouped-tensor GEMM with a bias")
    _check_gemm(A, B, D, alpha, beta)
    n = int(A.num_tensors)
    alphas, betas = _per_member(alpha, n), _per_member(beta, n)
    la, lb, ld = layout(A), layout(B), layout(D)
    with torch.no_grad():
        for i in range(n):
            target = _member_target(D, i, ld)
            if target.numel() == 0:
                continue
            a = member_values(A, i, transa, la)
            b = member_values(B, i, not transb, lb)
            op_a = a.t() if transa else a
            op_b = b.t() if transb else b
            if op_b.shape[1] != op_a.shape[0]:
                raise RuntimeError(f"grouped GEMM member {i}: shapes {tuple(op_b.shape)} x {tuple(op_a.shape)} "
                                   f"do not match (transa={transa}, transb={transb})")
            product = op_b @ op_a if op_b.shape[1] else torch.zeros(op_b.shape[0], op_a.shape[1], device=op_b.device)
            out = product * alphas[i] if alphas[i] != 1.0 else product
            if betas[i] != 0.0:
                old = target.float()
                out = out + (old * betas[i] if betas[i] != 1.0 else old)
            target.copy_(out.to(target.dtype))
    return D


def functions() -> dict[str, Any]:
    return {"splits_to_offsets_multi": splits_to_offsets_multi, "group_quantize": group_quantize,
            "te_general_grouped_gemm_for_grouped_tensor": te_general_grouped_gemm_for_grouped_tensor,
            "get_grouped_gemm_setup_workspace_size": get_grouped_gemm_setup_workspace_size}


__all__ = ["functions", "layout", "member_shapes", "member_values"]
