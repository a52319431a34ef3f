"""Shared by the scaled-GEMM tests: the stated error bound against an fp64 GEMM."""

from __future__ import annotations

import torch

from lptrain.catalog.scaled_gemm import error_bound


def assert_within_bound(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, recipe: str) -> None:
    """``got`` ~ ``a @ b.T`` (fp32 operand values, exact in fp64) within the stated bound."""
    a64, b64 = a.double(), b.double()
    ref = a64 @ b64.t()
    mag = a64.abs() @ b64.abs().t()
    ka, kb = error_bound(recipe, a.shape[1], got.dtype)
    err = (got.double() - ref).abs()
    slack = ka * mag + kb * ref.abs()
    assert bool((err <= slack).all()), f"max excess {(err - slack).max().item():.3g}"
    assert err.max() > 0 or ref.abs().max() > 0  # the comparison saw values
