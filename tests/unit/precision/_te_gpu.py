"""Shared pieces of the GPU tests (``test_te_*.py``): configs, skips per capability, compares.

Skips come from the rule catalog itself: a case is skipped with the reasons
``lptrain.config.rulesets.te_backend.te_refusals`` gives for this machine (GPU generation,
CUDA and TE versions), so the tests skip exactly where ``validate-config`` would refuse,
e.g. "mxfp8 is not supported on sm90" on a Hopper card.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from lptrain.config.schema import LPTrainConfig, PrecisionConfig

CONFIGS: dict[str, dict[str, Any]] = {
    "delayed": dict(fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4,
                    fp8_amax_compute_algo="max"),
    "tensorwise": dict(fp8_format="hybrid", fp8_recipe="tensorwise"),
    "blockwise": dict(fp8_format="e4m3", fp8_recipe="blockwise"),
    "mxfp8": dict(fp8_format="e4m3", fp8_recipe="mxfp8"),
    "nvfp4": dict(fp4_format="e2m1", nvfp4_stochastic_rounding=False),
}

# Normwise relative tolerance of GEMM outputs (y, dx, dW) between the two backends. The
# quantized operands are bit-identical (test_quantizer_bytes_match_te), so what differs is
# how the fp32 sum is formed (cuBLAS order, FP8 fprop fast accumulation) and the bf16
# rounding of each output element (<= 2^-9 relative on each side): two roundings of nearly
# the same sum differ by at most one bf16 ulp, 2^-8 relative per element, so normwise 4e-3
# bounds it with room for accumulation order (K <= 256: ~1e-5).
GEMM_RTOL = 4e-3
# NVFP4 wgrad operands go through RHT, whose bf16 results may differ by 1 ulp in rare cases
# (numerics.md 2.5; up to 0.1% of bytes, see the byte test); one flipped E2M1 code moves an
# element by up to a third of its value, so sqrt(1e-3 * (1/3)^2) ~ 1e-2 normwise: 2e-2.
NVFP4_WGRAD_RTOL = 2e-2


def prec(backend: str, name: str, **kw: Any) -> PrecisionConfig:
    base = PrecisionConfig(backend=backend, params_dtype="bf16")
    return dataclasses.replace(base, **CONFIGS[name], **kw)


def require_te_for(cfg: LPTrainConfig | PrecisionConfig) -> None:
    """Skip unless TE on this GPU supports ``cfg`` (reasons from the rule catalog)."""
    from lptrain.config.rulesets.te_backend import te_refusals
    from lptrain.config.world import World

    if isinstance(cfg, PrecisionConfig):
        cfg = LPTrainConfig(precision=cfg)
    cfg = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, backend="te"))
    world = World.detect()
    why = te_refusals(cfg, world)
    if why:
        pytest.skip(f"{world.target}, TE {world.te_version}, CUDA {world.cuda_version}: " + "; ".join(why))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Normwise relative difference ||a - b|| / ||b|| (fp64 on the CPU)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm()).item()


def te_quantizers(te_recipe: Any, mode: str, n: int) -> list[Any]:
    """TE's own quantizers for ``te_recipe`` (compact, unswizzled scales, both usages)."""
    try:
        from transformer_engine.pytorch.quantization import RecipeState
    except ImportError:  # TE < 2.9
        from transformer_engine.pytorch.fp8 import RecipeState
    qs = RecipeState.create(te_recipe, mode=mode, num_quantizers=n).make_quantizers()
    for q in qs:
        if hasattr(q, "optimize_for_gemm"):
            q.optimize_for_gemm = False
        if hasattr(q, "set_usage"):
            q.set_usage(rowwise=True, columnwise=True)
    return qs


# TE buffer attribute -> lptrain storage view name.
FIELD_MAP = (
    ("_data", "rowwise_data"),
    ("_rowwise_data", "rowwise_data"),
    ("_scale_inv", "scale_inv"),
    ("_rowwise_scale_inv", "rowwise_scale_inv"),
    ("_transpose", "columnwise_data"),
    ("_columnwise_data", "columnwise_data"),
    ("_columnwise_scale_inv", "columnwise_scale_inv"),
    ("_amax_rowwise", "amax_rowwise"),
    ("_amax_columnwise", "amax_columnwise"),
)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    if t.element_size() == 1:
        return t.view(torch.uint8)
    return t.view(torch.int32) if t.element_size() == 4 else t


def mismatch(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Fraction of differing elements between ours and the matching compact region of theirs
    (TE pads and may transpose scale buffers; the logical region is compared)."""
    a, b = _bytes(ours), _bytes(theirs)
    a = a.reshape(1, -1) if a.dim() == 1 else a.reshape(-1, a.shape[-1])
    b = b.reshape(1, -1) if b.dim() == 1 else b.reshape(-1, b.shape[-1])
    best = 1.0
    for cand in (b, b.t()):
        if cand.shape[0] >= a.shape[0] and cand.shape[1] >= a.shape[1]:
            region = cand[: a.shape[0], : a.shape[1]]
            if region.dtype == a.dtype:
                best = min(best, (region != a).float().mean().item())
    return best


def compare_buffers(name: str, ours: Any, theirs: Any, *, role: str) -> int:
    """Assert every buffer both tensors hold matches; returns how many were compared."""
    compared = 0
    views = ours.storage_views()
    for te_name, our_name in FIELD_MAP:
        t = getattr(theirs, te_name, None)
        o = views.get(our_name)
        if t is None or o is None:
            continue
        rht = name == "nvfp4" and role in ("input", "grad") and "columnwise" in our_name
        budget = 1e-3 if rht else 0.0
        assert mismatch(o, t) <= budget, (name, role, our_name)
        compared += 1
    return compared
