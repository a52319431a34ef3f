"""The unquantized GEMMs' dtype choice: native 16-bit on CUDA, fp32 elsewhere.

bf16 activations and weights multiply in bf16 with fp32 accumulation on CUDA (cuBLAS, as TE
and Megatron run them); on the CPU a bf16 matmul is ~80x slower than fp32, so the operands
are upcast (rounding the fp32 result once gives the same values). The weight gradient is
always formed in fp32, for the fused accumulation into ``main_grad``.
"""

from __future__ import annotations

import torch


def native_16bit_gemm(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether an unquantized GEMM of ``a`` and ``b`` runs in their own 16-bit dtype.

    On CUDA with 16-bit operands of one dtype, cuBLAS multiplies in that dtype with fp32
    accumulation (what TE and Megatron do for bf16 GEMMs). Everywhere else (CPU, fp32 runs)
    the operands are upcast and multiplied in fp32: bf16 matmul is ~80x slower on CPU, and
    rounding the fp32 result once gives the same values.
    """
    return a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)


# torch >= 2.8 has ``mm(a, b, out_dtype=...)``: a 16-bit GEMM with an fp32 output (CUDA only).
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


def wgrad_fp32(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = dy^T x, formed in fp32 (as TE's and Megatron's fused wgrad into ``main_grad``).

    ``dy`` [M, N] and ``x`` [M, K] are 2-D. On CUDA with 16-bit operands this is one cuBLAS
    16-bit GEMM with an fp32 output (tensor cores, fp32 accumulation): the products of bf16
    values are exact in fp32, so it differs from the upcast fp32 GEMM only in summation
    order. The upcast form ran as a SIMT sgemm: 66% of an H200 step of a 16x2048 bf16 GPT.
    """
    if _MM_OUT_DTYPE and native_16bit_gemm(dy, x):
        return torch.mm(dy.t(), x, out_dtype=torch.float32)
    return dy.float().t() @ x.float()
