"""Shared recipes and helpers for the quantized linear / autocast tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lptrain.precision import recipes as R

# name -> recipe constructor. Per-tensor recipes use HYBRID (E4M3 fwd, E5M2 grads) as TE's
# default; blockwise and MXFP8 use E4M3 everywhere (their TE defaults).
RECIPES: dict[str, Callable[[], Any]] = {
    "delayed": lambda: R.DelayedScaling(fp8_format="hybrid", amax_history_len=4, amax_compute_algo="max"),
    "tensorwise": lambda: R.TensorwiseScaling(fp8_format="hybrid"),
    "blockwise": lambda: R.BlockwiseScaling(fp8_format="e4m3"),
    "mxfp8": lambda: R.MXFP8Scaling(fp8_format="e4m3"),
    "nvfp4": lambda: R.NVFP4Scaling(disable_rht=True, disable_stochastic_rounding=True),
    "nvfp4_rht": lambda: R.NVFP4Scaling(disable_stochastic_rounding=True),
    "nvfp4_sr": lambda: R.NVFP4Scaling(disable_rht=True),
    "nvfp4_rht_sr": lambda: R.NVFP4Scaling(),
}

IN, OUT, TOKENS = 96, 64, 128


def data(seed: int = 0, tokens: int = TOKENS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [tokens, IN], W [OUT, IN] (std 1/sqrt(IN)), dy [tokens, OUT], all fp32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, IN, generator=g)
    w = torch.randn(OUT, IN, generator=g) / IN**0.5
    dy = torch.randn(tokens, OUT, generator=g)
    return x, w, dy


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Normwise relative error ||a - ref||_F / ||ref||_F (in fp64)."""
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm()).item()
