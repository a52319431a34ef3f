"""The quantized-GEMM recipe catalog: one :class:`RecipeSpec` per recipe, torch-free.

Every per-recipe fact that more than one package needs lives in its entry:

* the configuration reads the allowed values of ``precision.fp8_recipe`` / ``fp4_recipe`` and
  of the format keys (``lptrain.config.schema``), the GEMM alignment, the Transformer Engine
  support facts (minimum and excluded compute capabilities, TE and CUDA versions) and which
  precision keys a recipe reads (``amax_history``, ``current_amax``) for its rules and for
  the ``docs/rules.md`` page;
* the precision package resolves ``emulated_recipe_class`` in ``lptrain.precision.recipes``
  (whose classes take their alignments from here), builds the recipe from the config by these
  flags, and builds Transformer Engine's ``te_recipe_class`` with ``te_fields``.

Adding a recipe is one entry here plus its emulated recipe class and quantizer in
``lptrain.precision``. Rules about one named recipe's own limits (MXFP8's grad-buffer reuse
and its sm120 exclusion, the E4M3 advice for MXFP8 and blockwise, the recipes that the compact
layer-wise gather and the single grouped expert weight support) name that recipe; a new
recipe is outside their allowed sets, so those paths refuse it until its support is written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Optional

Family = Literal["fp8", "fp4"]


@dataclass(frozen=True, kw_only=True)
class FormatFamily:
    """An element-format family: the two config keys that turn one of its recipes on."""

    name: Family
    format_key: str  # null = off, else the element format
    recipe_key: str  # which recipe of the family runs
    # The key an error about the family's recipe names: what a user sets to select it (the
    # recipe for FP8; the format for FP4, whose recipe key has one value and a default).
    selected_by: str


FAMILIES: dict[str, FormatFamily] = {
    "fp8": FormatFamily(name="fp8", format_key="precision.fp8_format",
                        recipe_key="precision.fp8_recipe", selected_by="precision.fp8_recipe"),
    "fp4": FormatFamily(name="fp4", format_key="precision.fp4_format",
                        recipe_key="precision.fp4_recipe", selected_by="precision.fp4_format"),
}


@dataclass(frozen=True, kw_only=True)
class RecipeSpec:
    """One quantized-GEMM recipe: what selects it, what it needs, and what runs it."""

    name: str  # the value of its family's recipe key
    family: Family
    formats: tuple[str, ...]  # values of the family's format key it runs with
    alignment: int  # every quantized GEMM dimension is a multiple of it (whole blocks)
    grouped_alignment: int  # each expert's token count in a grouped GEMM is padded to it
    min_sm: int  # oldest compute capability Transformer Engine runs it on (x10: sm90 = 90)
    unsupported_from_sm: Optional[int] = None  # TE refuses it from this compute capability on
    min_te: str  # first TE release with ``te_recipe_class``
    min_te_from_sm: tuple[tuple[int, str], ...] = ()  # (sm, version): from sm on, TE >= version
    min_cuda: Optional[str] = None  # CUDA version TE's GEMMs for it need (torch/TE build)
    te_recipe_class: str  # in ``transformer_engine.common.recipe``
    # Fields of the emulated recipe that TE's class takes under the same names (beyond
    # ``fp8_format``, which every FP8 recipe passes as TE's Format enum).
    te_fields: tuple[str, ...] = ()
    # TE attribute holding the power-of-2 scale choice of a current-amax recipe; None: only
    # the class QParams hold it (TE 2.8 added ``Float8CurrentScaling.use_power_2_scales``).
    te_power_2_attr: Optional[str] = None
    emulated_recipe_class: str  # in ``lptrain.precision.recipes``
    # Delayed scaling: the scale comes from an amax history one step late, so the recipe
    # reads fp8_margin, fp8_amax_history_len and fp8_amax_compute_algo and keeps state.
    amax_history: bool = False
    # The scale divides by this tensor's own amax, so ``precision.amax_epsilon`` applies (on
    # TE through the recipe's QParams).
    current_amax: bool = False
    # Where TE's native grouped-tensor GEMM path (the one it runs a single grouped expert
    # weight on, 2.19+) takes this recipe: the compute capabilities (x10) and the cuBLASLt
    # version it needs there beyond the path's own minimum; empty: not at all.
    grouped_tensor_path: tuple[tuple[int, int, Optional[str]], ...] = ()
    # Per-expert token padding on that path when larger than ``grouped_alignment`` (TE's
    # grouped MXFP8 quantization needs each group's rows to be a multiple of 128).
    grouped_tensor_alignment: Optional[int] = None
    # Longest quantization block along a GEMM dimension (1: one scale per tensor). A
    # tensor-parallel shard boundary must fall on a multiple of it, or the shard's blocks
    # differ from the whole tensor's (rule TP-BLOCK-BOUNDARY).
    block: int = 1
    # One fp32 scale (or second-level scale) per tensor from its amax: a tensor-parallel
    # shard needs the MAX of its shards' amaxes (reduced over the tensor-parallel group).
    per_tensor_amax: bool = False

    @property
    def keys(self) -> FormatFamily:
        return FAMILIES[self.family]


_FP8 = ("e4m3", "hybrid")

RECIPES: tuple[RecipeSpec, ...] = (
    RecipeSpec(
        name="delayed", family="fp8", formats=_FP8, alignment=16, grouped_alignment=16,
        min_sm=89, min_te="2.2", te_recipe_class="DelayedScaling",
        te_fields=("margin", "amax_history_len", "amax_compute_algo"),
        emulated_recipe_class="DelayedScaling", amax_history=True, per_tensor_amax=True,
    ),
    RecipeSpec(
        name="tensorwise", family="fp8", formats=_FP8, alignment=16, grouped_alignment=16,
        min_sm=89, min_te="2.2", te_recipe_class="Float8CurrentScaling",
        grouped_tensor_path=((90, 99, "13.5"), (100, 110, None)),
        te_power_2_attr="use_power_2_scales", emulated_recipe_class="TensorwiseScaling",
        current_amax=True, per_tensor_amax=True,
    ),
    RecipeSpec(
        # TE 2.3-2.8 run Float8BlockScaling on Hopper only; 2.9 adds Blackwell (through MXFP8
        # GEMMs). Its GEMMs need a CUDA 12.9+ build (TE's block-scaling check).
        name="blockwise", family="fp8", formats=_FP8, alignment=16, grouped_alignment=16,
        min_sm=90, min_te="2.3", min_te_from_sm=((100, "2.9"),), min_cuda="12.9",
        grouped_tensor_path=((90, 99, "13.6"),),
        te_recipe_class="Float8BlockScaling", emulated_recipe_class="BlockwiseScaling",
        current_amax=True, block=128,
    ),
    RecipeSpec(
        # TE refuses MXFP8 from compute capability 12.0 on ("not supported on 12.0+
        # architectures").
        name="mxfp8", family="fp8", formats=_FP8, alignment=32, grouped_alignment=32,
        min_sm=100, unsupported_from_sm=120, min_te="2.2", te_recipe_class="MXFP8BlockScaling",
        grouped_tensor_path=((100, 110, None),), grouped_tensor_alignment=128,
        emulated_recipe_class="MXFP8Scaling", block=32,
    ),
    RecipeSpec(
        name="nvfp4", family="fp4", formats=("e2m1",), alignment=32, grouped_alignment=128,
        min_sm=100, min_te="2.8", te_recipe_class="NVFP4BlockScaling",
        grouped_tensor_path=((100, 110, None),),  # and only with the RHT on
        te_fields=("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"),
        emulated_recipe_class="NVFP4Scaling", block=16, per_tensor_amax=True,
    ),
)

# Transformer Engine facts that are not per recipe, from TE's release history: its release tags
# v2.2-v2.18 and the release_v2.19 branch (2.19 has no tag yet), as recorded from the source in
# tests/data/te_api.json (scripts/te_manifest.py), which the tests hold these numbers to.
# TE_MIN_VERSION: the oldest TE lptrain's adapter is written for (QParams,
# Float8CurrentScaling). The first release of each recipe class is its ``min_te``:
# Float8CurrentScaling 2.2, Float8BlockScaling 2.3, NVFP4BlockScaling 2.8 (DelayedScaling and
# MXFP8BlockScaling predate 2.2).
TE_MIN_VERSION = "2.2"
# GroupedLinear applies the recipe's amax_epsilon (QParams) from 2.3; Linear already in 2.2.
GROUPED_AMAX_EPSILON_MIN_TE = "2.3"
# GroupedLinear(single_grouped_weight=...) appears in 2.14, but up to 2.18 its GEMMs run on
# the grouped weight's members (``weight.quantized_tensors``), made with requires_grad=False:
# the experts get no weight gradient, and TE reads ``main_grad`` from the members. From 2.19
# (``use_grouped_tensor=True``, the native grouped-tensor path) the GEMMs take the grouped
# parameter and its own ``main_grad``. From 2.15 the weight is also honoured only with
# NVTE_GROUPED_LINEAR_SINGLE_PARAM=1 at construction (the TE adapter sets both).
SINGLE_GROUPED_WEIGHT_MIN_TE = "2.19"
# TE 2.19's native grouped-tensor path (``is_module_grouped_tensor_path_supported``): bf16 or
# fp16 activations, compute capability 9.0 to 11.0, cuBLASLt 13.3+ (13.4+ on Hopper), and a
# recipe whose ``grouped_tensor_path`` lists the GPU (delayed scaling: none). TE runs a
# single grouped weight only on this path and raises otherwise.
GROUPED_TENSOR_PATH_MIN_CUBLASLT = "13.3"
GROUPED_TENSOR_PATH_MIN_CUBLASLT_HOPPER = "13.4"
GROUPED_TENSOR_PATH_SMS = (90, 110)


def parse_version(text: str) -> tuple[int, ...]:
    """'2.14.0.dev0+abc' -> (2, 14, 0); non-numeric tails are ignored (the one version parser:
    ``lptrain.config.world`` uses it too)."""
    out: list[int] = []
    for part in text.split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group(0)))
    return tuple(out)


def grouped_tensor_path_refusal(spec: Optional[RecipeSpec], sm: int, cublaslt: Optional[str],
                                activation_dtype: str, nvfp4_rht: bool) -> Optional[str]:
    """Why TE 2.19's native grouped-tensor path would not run ``spec`` (None: unquantized)
    on compute capability ``sm`` with cuBLASLt ``cublaslt``, or None when it would."""
    if activation_dtype not in ("bf16", "fp16"):
        return f"needs bf16 or fp16 activations (params_dtype={activation_dtype})"
    lo, hi = GROUPED_TENSOR_PATH_SMS
    if not lo <= sm <= hi:
        return f"runs on sm{lo}-sm{hi} only, not sm{sm}"
    have = parse_version(cublaslt) if cublaslt else None
    need = GROUPED_TENSOR_PATH_MIN_CUBLASLT_HOPPER if sm < 100 else GROUPED_TENSOR_PATH_MIN_CUBLASLT
    if have is not None and have < parse_version(need):
        return f"needs cuBLASLt >= {need} on sm{sm}"
    if spec is None:
        return None
    for first, last, extra in spec.grouped_tensor_path:
        if first <= sm <= last:
            if extra and have is not None and have < parse_version(extra):
                return f"runs {spec.name} on sm{sm} only with cuBLASLt >= {extra}"
            if spec.name == "nvfp4" and not nvfp4_rht:
                return "runs nvfp4 only with the random Hadamard transform (precision.nvfp4_rht=true)"
            return None
    return f"does not run the {spec.name} recipe on sm{sm}"


def recipe(name: Optional[str]) -> Optional[RecipeSpec]:
    """The entry named ``name`` (recipe names are unique across families), or None."""
    return next((r for r in RECIPES if r.name == name), None)


def recipes_of(family: Family) -> tuple[RecipeSpec, ...]:
    """The entries of one family, in catalog order."""
    return tuple(r for r in RECIPES if r.family == family)


def recipe_names(family: Family) -> tuple[str, ...]:
    """The allowed values of the family's recipe key, in catalog order."""
    return tuple(r.name for r in recipes_of(family))


def family_formats(family: Family) -> tuple[str, ...]:
    """The element formats of the family's recipes, in order of first appearance."""
    return tuple(dict.fromkeys(f for r in recipes_of(family) for f in r.formats))
