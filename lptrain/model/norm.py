"""RMSNorm (pre-norm), computed in fp32 whatever the parameter dtype."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight``; upcasts to fp32 (bf16 math is slow on CPU
    and loses precision in the mean), returns the input dtype."""

    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.scale().float()).to(x.dtype)

    def scale(self) -> torch.Tensor:
        """The weight as the forward uses it (the tensor-parallel norm sums its gradient)."""
        return self.weight
