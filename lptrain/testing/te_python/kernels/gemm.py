"""``generic_gemm`` and the grouped GEMMs: cuBLASLt's semantics in row-major terms.

TE calls cuBLAS column-major; read row-major, ``generic_gemm(A, transa, B, transb, D, ...)``
computes ``D = op_B(B) @ op_A(A)`` with ``op_X`` a transpose when ``transX`` -- the forward
``TN`` (``y = x @ W^T``), the data gradient ``NN`` (``dx = dy @ W``) and the weight gradient
``NT`` (``dW = dy^T @ x``). A quantized operand is read as the C++ reads it: ``A`` row-wise
when ``transa`` else column-wise, ``B`` column-wise when ``transb`` else row-wise (the
column-wise copy of MXFP8/blockwise/NVFP4 is its own quantization; per-tensor FP8's is the
byte transpose). The product is formed in fp32 from the exactly dequantized operands (the
emulation's GEMM, as lptrain's emulated backend runs it), scaled by ``alpha``, added to
``beta * D`` when ``accumulate`` (into an fp32 ``main_grad`` for the fused weight-gradient
accumulation), plus ``bias``, and written in the output dtype -- or quantized by the output
quantizer. A fused GELU or bias gradient is not emulated (lptrain's layers have no bias).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from . import cast
from . import layouts as L


def _is_quantized(t: Any) -> bool:
    return not isinstance(t, torch.Tensor) or type(t).__module__.startswith("transformer_engine")


def _matrix(t: Any, rowwise: bool) -> torch.Tensor:
    """A GEMM operand as fp32 ``[rows, last]`` in its logical orientation."""
    if _is_quantized(t):
        vals = L.dequantize(t, orientation="rowwise" if rowwise else "columnwise")
    else:
        vals = t.detach().float()
    return vals.reshape(-1, vals.shape[-1]) if vals.dim() != 2 else vals


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(t.shape) if isinstance(t, torch.Tensor) and not _is_quantized(t) else L.logical_shape(t)


def _product(A: Any, transa: bool, B: Any, transb: bool) -> tuple[torch.Tensor, tuple[int, ...]]:
    a = _matrix(A, rowwise=transa)
    b = _matrix(B, rowwise=not transb)
    op_a = a.t() if transa else a
    op_b = b.t() if transb else b
    if op_b.shape[1] != op_a.shape[0]:
        raise RuntimeError(f"generic_gemm: shapes {tuple(op_b.shape)} x {tuple(op_a.shape)} do not match "
                           f"(transa={transa}, transb={transb})")
    out = op_b @ op_a
    bshape = _shape(B)
    shape = (*bshape[:-1], out.shape[1]) if not transb and len(bshape) > 2 else tuple(out.shape)
    return out, shape


def _write(result: torch.Tensor, shape: tuple[int, ...], D: Optional[torch.Tensor], out_dtype: Any,
           quantizer: Any, accumulate: bool, alpha: float, beta: Optional[float],
           bias: Optional[torch.Tensor]) -> Any:
    if alpha != 1.0:
        result = result * alpha
    if bias is not None and bias.numel():
        result = result + bias.float()
    if quantizer is not None:
        src = result.reshape(shape)
        if D is not None:
            return cast.quantize(src, quantizer, D)
        dtype = L.torch_dtype(out_dtype) if out_dtype is not None else torch.bfloat16
        return cast.quantize(src.to(dtype), quantizer)
    with torch.no_grad():
        if D is not None:
            target = D.reshape(-1, D.shape[-1]) if D.dim() != 2 else D
            if accumulate:
                b = 1.0 if beta is None else float(beta)
                result = target.float() * b + result if b != 1.0 else target.float() + result
            target.copy_(result.reshape(target.shape).to(D.dtype))
            return D
    dtype = L.torch_dtype(out_dtype) if out_dtype is not None else torch.bfloat16
    return result.reshape(shape).to(dtype)


def generic_gemm(A: Any, transa: bool, B: Any, transb: bool, D: Any, quantizer: Any, output_dtype: Any,
                 bias: Any, bias_type: Any, gelu: bool, gelu_in: Any, grad: bool, workspace: Any,
                 workspace_size: int, accumulate: bool, use_split_accumulator: bool,
                 comm_overlap: Any = None, comm_type: Any = None, extra_output: Any = None,
                 bulk_overlap: bool = False, alpha: float = 1.0, beta: Optional[float] = None) -> list[Any]:
    """``tex.generic_gemm`` -> ``[D, bias_grad, gelu_input, extra_output]``."""
    if gelu:
        raise L.not_emulated("generic_gemm with a fused GELU")
    if comm_overlap is not None:
        raise L.not_emulated("generic_gemm with communication overlap (userbuffers)")
    has_bias = isinstance(bias, torch.Tensor) and bias.numel() > 0
    if grad and has_bias:
        raise L.not_emulated("generic_gemm with a fused bias gradient")
    result, shape = _product(A, transa, B, transb)
    out = _write(result, shape, D, output_dtype, quantizer, accumulate, float(alpha), beta,
                 bias if has_bias else None)
    return [out, None, None, extra_output]


def _numel(t: Any) -> int:
    if isinstance(t, torch.Tensor) and not _is_quantized(t):
        return t.numel()
    shape = L.logical_shape(t)
    n = 1
    for s in shape:
        n *= s
    return n


def te_general_grouped_gemm(A: Sequence[Any], transa: bool, B: Sequence[Any], transb: bool,
                            D: Optional[Sequence[torch.Tensor]], D_type: Any, m_splits: Sequence[int],
                            bias: Sequence[torch.Tensor], bias_type: Any, single_output: bool,
                            pre_gelu_out: Sequence[torch.Tensor], grad: bool, workspace: Any,
                            workspace_size: int, accumulate: bool, use_split_accumulator: bool,
                            math_sm_count: int = 0) -> Any:
    """``tex.te_general_grouped_gemm``: one GEMM per member; ``single_output`` writes them
    one after another into ``D[0]``; returns ``bias``."""
    if any(isinstance(g, torch.Tensor) and g.numel() for g in pre_gelu_out):
        raise L.not_emulated("te_general_grouped_gemm with a fused GELU")
    offset = 0
    outs = []
    for i, (a, b) in enumerate(zip(A, B, strict=True)):
        if _numel(a) == 0 or _numel(b) == 0:
            rows = _shape(b)[1 if transb else 0] if _shape(b) else 0
            n = _shape(a)[1 if not transa else 0] if _shape(a) else 0
            if single_output:
                target = D[0].reshape(-1, D[0].shape[-1])[offset:offset + rows] if D else None
                offset += rows
            else:
                target = D[i] if D else None
            if target is not None and target.numel() and not accumulate:
                with torch.no_grad():
                    target.zero_()
            outs.append(target if target is not None else torch.zeros(rows, n, dtype=L.torch_dtype(D_type)))
            continue
        result, shape = _product(a, transa, b, transb)
        if single_output:
            full = D[0].reshape(-1, D[0].shape[-1])
            target = full[offset:offset + result.shape[0]]
            offset += result.shape[0]
        else:
            target = D[i] if D else None
        outs.append(_write(result, shape, target, D_type, None, accumulate, 1.0, None, None))
    return bias


def functions() -> dict[str, Any]:
    return {"generic_gemm": generic_gemm, "te_general_grouped_gemm": te_general_grouped_gemm}
