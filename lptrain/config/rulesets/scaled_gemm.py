"""Scaled-GEMM rules: ``precision.quantized_gemm=scaled_mm`` only where torch has the kernel.

The kernel table is :mod:`lptrain.catalog.scaled_gemm`; these rules read it, so what is
refused here is what the emulated backend's dispatch (``lptrain.precision.scaled_gemm``) would
fail to find on the GPU. Part of the catalog's Precision section.
"""

from __future__ import annotations

from typing import Any

from lptrain.catalog import scaled_gemm as catalog
from lptrain.config.rules import Rule, quant_recipe, recipe_key
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World

S = "Precision"


def gemm_sm(c: LPTrainConfig, w: World) -> int:
    """The compute capability the GEMMs run on (x10); 0 on the CPU (no CUDA device, or
    ``run.device=cpu``)."""
    return w.sm if w.cuda and c.run.device != "cpu" else 0


def _where(c: LPTrainConfig, w: World) -> str:
    sm = gemm_sm(c, w)
    return f"sm{sm}" if sm else "the CPU"


def _no_kernel(c: LPTrainConfig, w: World) -> dict[str, Any]:
    p = c.precision
    if p.backend != "emulated" or p.quantized_gemm != "scaled_mm":
        return {}
    k = catalog.kernel(quant_recipe(c))
    if k is None:
        return {}
    sm = gemm_sm(c, w)
    why = catalog.refusal(k, sm, w.cublaslt_version if sm else None)
    if why is None:
        return {}
    others = [r for r in catalog.recipes_with_kernel(sm, w.cublaslt_version if sm else None)
              if r != k.recipe]
    alt = (f", or a recipe with a kernel on {_where(c, w)} ({'/'.join(others)})" if others else "")
    return {"keys": ("precision.quantized_gemm", recipe_key(c)), "why": why,
            "where": _where(c, w), "recipe": k.recipe, "alt": alt}


def _dequantized_on_te(c: LPTrainConfig, w: World) -> bool:
    return (c.precision.backend == "te" and c.precision.quantized_gemm == "dequantized"
            and quant_recipe(c) is not None)


def _kernel_table() -> str:
    return "; ".join(f"{k.recipe}: {k.fprop[0]} x {k.fprop[1]} on {k.where} (CUDA >= {k.min_cuda})"
                     for k in catalog.KERNELS)


RULES = [
    Rule(
        id="PREC-SCALED-MM-KERNEL", severity="error",
        keys=("precision.quantized_gemm", "precision.fp8_recipe", "precision.fp4_recipe"),
        when=_no_kernel,
        message="precision.quantized_gemm=scaled_mm: torch has no scaled GEMM for {recipe} on "
                "{where} ({why})",
        fix="set precision.quantized_gemm=auto (dequantized GEMMs where there is no kernel){alt}",
        condition="backend=emulated and quantized_gemm=scaled_mm -> the recipe's kernel exists "
                  "on the target: " + _kernel_table(),
        why="torch's scaled-GEMM kernels (cuBLASLt) exist per scaling type on some GPUs and CUDA "
            "versions only; the call would fail at the first GEMM",
        section=S,
    ),
    Rule(
        id="PREC-DEQUANTIZED-TE", severity="error",
        keys=("precision.quantized_gemm", "precision.backend"), when=_dequantized_on_te,
        message="precision.quantized_gemm=dequantized with precision.backend=te: Transformer "
                "Engine's GEMMs always take the quantized operands as stored",
        fix="set precision.quantized_gemm=auto, or precision.backend=emulated to run "
            "dequantized fp32 GEMMs",
        condition="backend=te -> quantized_gemm auto or scaled_mm",
        why="a setting that is accepted must be honoured",
        section=S,
    ),
]
