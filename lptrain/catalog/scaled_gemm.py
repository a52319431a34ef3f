"""Where torch's scaled-GEMM kernels exist: the one table ``precision.quantized_gemm`` reads.

``precision.quantized_gemm=scaled_mm`` runs each quantized GEMM of the emulated backend on
torch's scaled-GEMM entry point (``torch.nn.functional.scaled_mm``, or ``torch._scaled_mm`` on
a torch without it; ``scaled_grouped_mm`` for MoE experts) with the operands as stored: FP8/FP4
codes plus their scales, never dequantized. Each recipe maps to one kernel (a pair of scaling
types), which torch has only on some devices and CUDA (cuBLASLt) versions. This table holds
those facts, the way :mod:`lptrain.catalog.recipes` holds Transformer Engine's: the rules
(``PREC-SCALED-MM-*``), ``quantized_gemm=auto``, the docs' "which GEMM runs where" table and
the virtual GPU's kernel checks (:mod:`lptrain.testing.virtual_cuda.scaled_mm`) all read it.

The facts follow torch's CUDA implementation (``aten/src/ATen/native/cuda/ScaledBlas.cpp``,
``GroupedBlas.cpp``): FP8 GEMMs exist from compute capability 8.9; on 8.9 and 9.0 cuBLASLt
multiplies only a row-major A by a column-major B (both operands K-major, "TN"), Blackwell
takes every layout; the DeepSeek-style 1x128 / 128x128 block scales run on 9.0 only, with
cuBLASLt 12.9+; MX (1x32, E8M0) and NVFP4 (1x16, E4M3 plus a per-tensor fp32 scale) block
scales from 10.0, with CUDA 12.8+, their scales in cuBLAS's swizzled 128x4 layout. On the CPU
torch runs TensorWise and RowWise FP8 only. The grouped kernels (``scaled_grouped_mm``, CUDA
compute capability 9.x or 10.x only, bf16 output only): row-wise E4M3 (a CUTLASS sm90 kernel,
so 9.0), MXFP8 and NVFP4 on 10.0 (a torch built with MSLK, FBGEMM GenAI before; torch's own
tests run them on 10.0 only).

Torch-free: ``validate-config`` reads it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lptrain.catalog.recipes import parse_version

# The values of precision.quantized_gemm.
QUANTIZED_GEMMS: tuple[str, ...] = ("auto", "dequantized", "scaled_mm")


@dataclass(frozen=True, kw_only=True)
class ScaledKernel:
    """One recipe's scaled GEMM: the scaling types of its operands per GEMM and where torch
    runs it. Scaling types are ``torch.nn.functional.ScalingType`` member names."""

    recipe: str  # the recipe catalog name (lptrain.catalog.recipes)
    fprop: tuple[str, str]  # (A = input x, B = weight W)
    dgrad: tuple[str, str]  # (A = output grad dy, B = W column-wise)
    wgrad: tuple[str, str]  # (A = dy column-wise, B = x column-wise)
    cpu: bool  # torch's CPU build runs it
    min_sm: int  # oldest compute capability (x10) with the kernel
    max_sm: Optional[int] = None  # newest (x10); None: every later one
    min_cuda: str  # the CUDA / cuBLASLt version the kernel needs
    swizzled_scales: bool = False  # scales in cuBLAS's 128x4 tiled layout (SWIZZLE_32_4_4)
    # compute capabilities (x10, inclusive ranges) where torch has a grouped kernel for the
    # experts' GEMMs, the element format it needs for both operands (None: any the recipe
    # makes), and the expert GEMMs lptrain runs on it (``scaled_gemm.grouped``: one
    # ``scaled_grouped_mm`` for all experts); every other expert GEMM runs one scaled GEMM
    # per expert. wgrad never: the grouped kernels write bf16 only, and the weight gradient
    # goes to ``main_grad`` in fp32.
    grouped_sm: tuple[tuple[int, int], ...] = ()
    grouped_format: Optional[str] = None
    grouped_gemms: tuple[str, ...] = ()
    # the torch build flag(s) the grouped kernel needs ("A|B": either), and the multiples
    # (each expert's rows, K) its packing needs
    grouped_build: str = ""
    grouped_align: tuple[int, int] = (1, 16)
    note: str = ""

    def runs_on(self, sm: int, cuda_version: Optional[str]) -> bool:
        """Whether torch has this kernel on compute capability ``sm`` (0: the CPU) with CUDA
        ``cuda_version`` (None: assumed new enough)."""
        return refusal(self, sm, cuda_version) is None

    def grouped_on(self, sm: int) -> bool:
        """Whether torch has this recipe's grouped kernel on compute capability ``sm``."""
        return any(lo <= sm <= hi for lo, hi in self.grouped_sm)

    def grouped_runs(self, gemm: str, sm: int) -> bool:
        """Whether lptrain runs the experts' ``gemm`` (fprop / dgrad / wgrad) as one grouped
        scaled GEMM on compute capability ``sm``."""
        return gemm in self.grouped_gemms and self.grouped_on(sm)

    @property
    def where(self) -> str:
        """The devices in words: ``CPU, sm89+`` / ``sm90 only``."""
        gpus = (f"sm{self.min_sm} only" if self.max_sm == self.min_sm else
                f"sm{self.min_sm}-sm{self.max_sm}" if self.max_sm else f"sm{self.min_sm}+")
        return f"CPU, {gpus}" if self.cpu else gpus


_TW = ("TensorWise", "TensorWise")
KERNELS: tuple[ScaledKernel, ...] = (
    ScaledKernel(recipe="delayed", fprop=_TW, dgrad=_TW, wgrad=_TW, cpu=True, min_sm=89,
                 min_cuda="12.1", grouped_sm=((90, 90),), grouped_format="e4m3",
                 grouped_gemms=("fprop", "dgrad"),
                 note="one fp32 scale per operand; the grouped kernel is row-wise E4M3 (each "
                      "expert's scale repeated over its rows), so E5M2 gradients (hybrid) run "
                      "dgrad one scaled GEMM per expert"),
    ScaledKernel(recipe="tensorwise", fprop=_TW, dgrad=_TW, wgrad=_TW, cpu=True, min_sm=89,
                 min_cuda="12.1", grouped_sm=((90, 90),), grouped_format="e4m3",
                 grouped_gemms=("fprop", "dgrad"), note="as delayed"),
    ScaledKernel(recipe="blockwise", fprop=("BlockWise1x128", "BlockWise128x128"),
                 dgrad=("BlockWise1x128", "BlockWise128x128"),
                 wgrad=("BlockWise1x128", "BlockWise1x128"), cpu=False, min_sm=90, max_sm=90,
                 min_cuda="12.9",
                 note="DeepSeek-style block scales: cuBLASLt runs them on Hopper only"),
    ScaledKernel(recipe="mxfp8", fprop=("BlockWise1x32", "BlockWise1x32"),
                 dgrad=("BlockWise1x32", "BlockWise1x32"), wgrad=("BlockWise1x32", "BlockWise1x32"),
                 cpu=False, min_sm=100, min_cuda="12.8", swizzled_scales=True,
                 grouped_sm=((100, 100),), grouped_format="e4m3", grouped_gemms=("fprop", "dgrad"),
                 grouped_build="USE_MSLK|USE_FBGEMM_GENAI", grouped_align=(32, 128),
                 note="E8M0 scales per 32; the grouped kernel needs a torch built with MSLK "
                      "(FBGEMM GenAI before): elsewhere one scaled GEMM per expert"),
    ScaledKernel(recipe="nvfp4", fprop=("BlockWise1x16", "BlockWise1x16"),
                 dgrad=("BlockWise1x16", "BlockWise1x16"), wgrad=("BlockWise1x16", "BlockWise1x16"),
                 cpu=False, min_sm=100, min_cuda="12.8", swizzled_scales=True,
                 grouped_sm=((100, 100),),
                 note="E4M3 scales per 16 plus the per-tensor fp32 scale (TensorWise); the "
                      "grouped kernel as MXFP8's (not used: one scaled GEMM per expert); needs "
                      "torch.nn.functional.scaled_mm (torch._scaled_mm has no second-level scale)"),
)

# cuBLASLt on compute capability 8.9 and 9.0 multiplies only row-major A by column-major B.
TN_ONLY_BELOW_SM = 100
# FP8 GEMMs need compute capability 8.9 (Ada) or newer.
FP8_MIN_SM = 89


def kernel(recipe: Optional[str]) -> Optional[ScaledKernel]:
    """The scaled kernel of a recipe (None: unknown recipe or unquantized)."""
    return next((k for k in KERNELS if k.recipe == recipe), None)


def refusal(k: ScaledKernel, sm: int, cuda_version: Optional[str]) -> Optional[str]:
    """Why torch has no ``k`` on compute capability ``sm`` (0: CPU) with ``cuda_version``,
    or None when it has."""
    if sm == 0:
        return None if k.cpu else f"torch's CPU build has no {k.fprop[0]} x {k.fprop[1]} kernel"
    if sm < k.min_sm or (k.max_sm is not None and sm > k.max_sm):
        return f"torch has the {k.fprop[0]} x {k.fprop[1]} kernel on {k.where} only, not sm{sm}"
    if cuda_version is not None and parse_version(cuda_version) < parse_version(k.min_cuda):
        return f"the {k.fprop[0]} kernel needs CUDA (cuBLASLt) >= {k.min_cuda}, not {cuda_version}"
    return None


def grouped_kernel(scaling_a: str, scaling_b: str) -> Optional[ScaledKernel]:
    """The kernel whose fprop scaling types are ``(scaling_a, scaling_b)`` (the grouped GEMMs'
    operands: input or gradient x weight); None for a pair no recipe uses."""
    return next((k for k in KERNELS if k.fprop == (scaling_a, scaling_b)), None)


def recipes_with_kernel(sm: int, cuda_version: Optional[str]) -> tuple[str, ...]:
    """The recipes that have a scaled kernel here, in catalog order."""
    return tuple(k.recipe for k in KERNELS if k.runs_on(sm, cuda_version))


def resolve(choice: str, recipe: Optional[str], sm: int, cuda_version: Optional[str],
            backend: str) -> str:
    """What ``precision.quantized_gemm=choice`` runs: ``auto`` is ``scaled_mm`` on a CUDA
    device (``sm`` > 0) where the recipe has a kernel, and on Transformer Engine (whose GEMMs
    always take the operands as stored), else ``dequantized``. On the CPU ``auto`` stays
    ``dequantized``: the emulation every bit-exactness test is anchored to."""
    if choice != "auto":
        return choice
    if recipe is None:
        return "dequantized"
    if backend == "te":
        return "scaled_mm"
    k = kernel(recipe)
    return "scaled_mm" if sm > 0 and k is not None and k.runs_on(sm, cuda_version) else "dequantized"


# ---- the stated error bound of a scaled GEMM (tested per recipe against fp64) --------------

ACCUM_U = 2.0 ** -24  # fp32 accumulation: unit roundoff
# Hopper's FP8 tensor-core fast accumulation keeps about 14 bits (DeepSeek-V3's measurement);
# only per-tensor FP8 fprop on sm89/sm90 uses it (as TE and torchao do).
FAST_ACCUM_U = 2.0 ** -14
_OUT_U = {"float32": 0.0, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
_BLOCK = {"TensorWise": 0, "BlockWise1x128": 128, "BlockWise128x128": 128, "BlockWise1x32": 32,
          "BlockWise1x16": 16}


def error_bound(recipe: str, k: int, out_dtype: object, fast_accum: bool = False) -> tuple[float, float]:
    """``(a, b)``: a scaled GEMM of ``recipe`` over a reduction of ``k`` elements is within
    ``a * sum_k |A_ik B_kj| + b * |C_ij|`` of the fp64 GEMM of the same dequantized operands,
    element by element. ``a`` counts one rounding per product and per partial sum (K), two
    per block for its scale products and two for the per-tensor scales; ``b`` is the output
    dtype's unit roundoff (0 for fp32). ``out_dtype``: a torch dtype or its name."""
    kern = kernel(recipe)
    if kern is None:
        raise ValueError(f"no scaled kernel for recipe {recipe!r}")
    block = _BLOCK[kern.fprop[0]]
    blocks = -(-k // block) if block else 0
    u = FAST_ACCUM_U if fast_accum else ACCUM_U
    return (k + 2 * blocks + 2) * u, _OUT_U[str(out_dtype).removeprefix("torch.")]
