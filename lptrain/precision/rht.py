"""NVFP4 random Hadamard transform (numerics.md 2.5, TE ``get_rht_matrix``).

R = diag(s) H16 / 4 with the Sylvester Hadamard H16[i, j] = (-1)^popcount(i & j) and TE's
fixed sign vector s. Every entry is +-0.25 (exact in bf16 and fp32) and R is orthogonal:
R R^T = I exactly in fp32 (each entry of the product is a sum of sixteen +-1/16 terms).
It is applied to the columnwise (wgrad) operands of inputs and grads: groups of 16 consecutive
tokens of x^T are multiplied by R with fp32 accumulation and the result is rounded to bf16.
The rotation cancels inside the wgrad GEMM because both operands get the same R.
"""

from __future__ import annotations

import torch

RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
RHT_SIZE = 16


def hadamard16() -> torch.Tensor:
    """The 16x16 Sylvester Hadamard matrix (entries +-1), fp32."""
    i = torch.arange(RHT_SIZE)
    parity = torch.zeros(RHT_SIZE, RHT_SIZE, dtype=torch.int64)
    anded = i[:, None] & i[None, :]
    for bit in range(4):
        parity ^= (anded >> bit) & 1
    return (1 - 2 * parity).to(torch.float32)


def rht_matrix() -> torch.Tensor:
    """R = diag(s) H / 4 as fp32 (values +-0.25; identical when stored as bf16)."""
    s = torch.tensor(RHT_SIGNS, dtype=torch.float32)
    return (s[:, None] * hadamard16()) * 0.25


def apply_rht(x_t: torch.Tensor, inverse: bool = False, round_to_bf16: bool = True) -> torch.Tensor:
    """Rotate each group of 16 consecutive elements of the last dim: y = g @ R (fp32 accumulate).

    ``x_t`` is the transposed operand [K, M] (M = tokens, divisible by 16). Returns fp32 values;
    with ``round_to_bf16`` they are rounded to bf16 first (TE's ``convert_accum_to_bf16``).
    ``inverse`` multiplies by R^T instead (used to un-rotate for dequantization).
    """
    if x_t.shape[-1] % RHT_SIZE:
        raise ValueError(f"RHT needs the token dim divisible by 16, got {x_t.shape[-1]}")
    r = rht_matrix().to(x_t.device)
    if inverse:
        r = r.t().contiguous()
    g = x_t.float().reshape(-1, RHT_SIZE)
    y = (g @ r).reshape(x_t.shape)
    if round_to_bf16:
        y = y.bfloat16().float()
    return y
