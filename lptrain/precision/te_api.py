"""Every Transformer Engine member lptrain calls, with the releases it is called on.

The TE-facing modules (:mod:`lptrain.precision.te_adapter`, :mod:`lptrain.precision.te_storage`)
reach into TE by name; a name TE lacks at a release lptrain allows is a crash on a GPU that
no CPU test sees. Each entry here names one member and the first release lptrain calls it on
-- the gate of the path that calls it (a recipe's ``min_te``, a feature's minimum), or the
oldest TE lptrain supports -- and, for a member with a fallback, the last. The tests hold the
table to TE's source (``tests/data/te_api.json``, written by ``scripts/te_manifest.py``) and
hold the two modules to the table: a TE member they name that is not declared here fails.

``owner`` is a class (as the manifest keys it: the public path lptrain imports it from), a
module (for functions), or ``PARAM`` (attributes TE's modules attach to parameters).
``kind``: ``member`` (method, property or attribute), ``function`` (a module function),
``kwarg`` (a constructor or function keyword lptrain passes) or ``class`` (the class
itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from lptrain.catalog.recipes import (
    GROUPED_AMAX_EPSILON_MIN_TE,
    SINGLE_GROUPED_WEIGHT_MIN_TE,
    TE_MIN_VERSION,
    recipe,
)

PT = "transformer_engine.pytorch"
TENSOR = f"{PT}.tensor"
UTILS = f"{TENSOR}.utils"
RECIPE = "transformer_engine.common.recipe"
F8 = f"{TENSOR}.float8_tensor.Float8Tensor"
BW = f"{TENSOR}.float8_blockwise_tensor.Float8BlockwiseQTensor"
MX = f"{TENSOR}.mxfp8_tensor.MXFP8Tensor"
NV = f"{TENSOR}.nvfp4_tensor.NVFP4Tensor"
GT = f"{TENSOR}.grouped_tensor.GroupedTensor"
FA = f"{PT}.optimizers.FusedAdam"
PARAM = "parameter"

# First releases of the paths below (the te_storage / te_adapter gates).
BLOCKWISE_BYTES = "2.4"  # te_storage.BLOCKWISE_BYTES_MIN_TE
POST_ALL_GATHER = "2.10"  # te_storage.POST_ALL_GATHER_MIN_TE
NEW_API = "2.9"  # te.pytorch.autocast / quantized_model_init; quantization.FP8GlobalStateManager
QUANTIZE_MASTER = "2.14"
SGW = SINGLE_GROUPED_WEIGHT_MIN_TE


def _min_te(name: str) -> str:
    spec = recipe(name)
    assert spec is not None, name
    return spec.min_te


@dataclass(frozen=True)
class TECall:
    owner: str
    member: str
    since: str
    until: Optional[str] = None  # last release it is called on (a newer path takes over)
    kind: Literal["member", "function", "kwarg", "class"] = "member"
    why: str = ""


TE_CALLS: tuple[TECall, ...] = (
    # recipes (te_adapter.te_recipe)
    *(TECall(RECIPE, cls, _min_te(name), kind="class", why=f"the {name} recipe")
      for name, cls in (("delayed", "DelayedScaling"), ("tensorwise", "Float8CurrentScaling"),
                        ("blockwise", "Float8BlockScaling"), ("mxfp8", "MXFP8BlockScaling"),
                        ("nvfp4", "NVFP4BlockScaling"))),
    TECall(RECIPE, "Format", TE_MIN_VERSION, kind="class", why="fp8_format"),
    TECall(f"{RECIPE}.Format", "HYBRID", TE_MIN_VERSION),
    TECall(f"{RECIPE}.Format", "E4M3", TE_MIN_VERSION),
    TECall(f"{RECIPE}.QParams", "power_2_scale", TE_MIN_VERSION, kind="kwarg"),
    TECall(f"{RECIPE}.QParams", "amax_epsilon", TE_MIN_VERSION, kind="kwarg"),
    *(TECall(f"{RECIPE}.{cls}", q, _min_te(name), why="assigned after construction")
      for name, cls in (("tensorwise", "Float8CurrentScaling"), ("blockwise", "Float8BlockScaling"))
      for q in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")),
    TECall(f"{RECIPE}.Float8CurrentScaling", "use_power_2_scales", "2.8",
           why="read where it exists (the QParams hold the choice before)"),
    *(TECall(f"{RECIPE}.DelayedScaling", kw, TE_MIN_VERSION, kind="kwarg")
      for kw in ("fp8_format", "margin", "amax_history_len", "amax_compute_algo")),
    *(TECall(f"{RECIPE}.{cls}", "fp8_format", _min_te(name), kind="kwarg")
      for name, cls in (("tensorwise", "Float8CurrentScaling"), ("blockwise", "Float8BlockScaling"),
                        ("mxfp8", "MXFP8BlockScaling"))),
    *(TECall(f"{RECIPE}.NVFP4BlockScaling", kw, _min_te("nvfp4"), kind="kwarg")
      for kw in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization")),
    # contexts (te_adapter)
    TECall(PT, "autocast", NEW_API, kind="function"),
    *(TECall(f"{PT}.autocast", kw, NEW_API, kind="kwarg") for kw in ("enabled", "recipe", "amax_reduction_group")),
    TECall(PT, "fp8_autocast", TE_MIN_VERSION, until="2.8", kind="function"),
    *(TECall(f"{PT}.fp8_autocast", kw, TE_MIN_VERSION, until="2.8", kind="kwarg")
      for kw in ("enabled", "fp8_recipe", "fp8_group")),
    TECall(PT, "quantized_model_init", NEW_API, kind="function"),
    *(TECall(f"{PT}.quantized_model_init", kw, NEW_API, kind="kwarg")
      for kw in ("enabled", "recipe", "preserve_high_precision_init_val")),
    TECall(PT, "fp8_model_init", TE_MIN_VERSION, until="2.8", kind="function"),
    *(TECall(f"{PT}.fp8_model_init", kw, TE_MIN_VERSION, until="2.8", kind="kwarg")
      for kw in ("enabled", "recipe", "preserve_high_precision_init_val")),
    TECall(f"{PT}.fp8.FP8GlobalStateManager", "is_fp8_enabled", TE_MIN_VERSION, until="2.8"),
    TECall(f"{PT}.fp8.FP8GlobalStateManager", "get_fp8_recipe", TE_MIN_VERSION, until="2.8"),
    TECall(f"{PT}.quantization.FP8GlobalStateManager", "is_fp8_enabled", NEW_API),
    TECall(f"{PT}.quantization.FP8GlobalStateManager", "get_fp8_recipe", NEW_API),
    TECall(f"{PT}.distributed", "get_activation_recompute_contexts", TE_MIN_VERSION, kind="function"),
    # modules (te_adapter.te_linear / te_grouped_linear)
    *(TECall(f"{PT}.Linear", kw, TE_MIN_VERSION, kind="kwarg")
      for kw in ("in_features", "out_features", "bias", "init_method", "params_dtype",
                 "fuse_wgrad_accumulation", "device")),
    TECall(f"{PT}.Linear", "name", "2.3", kind="kwarg", why="dropped where TE lacks it"),
    *(TECall(f"{PT}.Linear", kw, TE_MIN_VERSION, kind="kwarg", why="tensor parallelism")
      for kw in ("tp_group", "tp_size", "parallel_mode", "sequence_parallel")),
    TECall(f"{PT}.Linear", "sequence_parallel", TE_MIN_VERSION, why="sequence-first activations under SP"),
    *(TECall(f"{PT}.GroupedLinear", kw, TE_MIN_VERSION, kind="kwarg")
      for kw in ("num_gemms", "in_features", "out_features", "bias", "init_method", "params_dtype",
                 "fuse_wgrad_accumulation", "device")),
    TECall(f"{PT}.GroupedLinear", "name", "2.11", kind="kwarg", why="dropped where TE lacks it"),
    TECall(f"{PT}.GroupedLinear", "single_grouped_weight", SGW, kind="kwarg"),
    TECall(f"{PT}.GroupedLinear", "use_grouped_tensor", SGW, kind="kwarg"),
    TECall(f"{PT}.GroupedLinear", "single_grouped_weight", SGW),
    TECall(f"{PT}.GroupedLinear", "use_grouped_tensor", SGW),
    TECall(f"{PT}.GroupedLinear", "make_grouped_weights", SGW, why="overridden to keep init values"),
    TECall(f"{PT}.GroupedLinear", "num_gemms", TE_MIN_VERSION),
    TECall(f"{PT}.GroupedLinear", "forward", TE_MIN_VERSION),
    # parameters: kept init values (te_storage.high_precision_value / release; te_adapter.keep_init)
    TECall(PARAM, "_high_precision_init_val", TE_MIN_VERSION),
    TECall(PARAM, "get_high_precision_init_val", TE_MIN_VERSION),
    TECall(PARAM, "clear_high_precision_init_val", TE_MIN_VERSION),
    # quantized tensors (te_storage)
    *(TECall(cls, "dequantize", since) for cls, since in
      ((F8, TE_MIN_VERSION), (BW, _min_te("blockwise")), (MX, TE_MIN_VERSION), (NV, _min_te("nvfp4")))),
    *(TECall(cls, "quantize_", since) for cls, since in
      ((F8, TE_MIN_VERSION), (BW, _min_te("blockwise")), (MX, TE_MIN_VERSION), (NV, _min_te("nvfp4")))),
    TECall(F8, "_get_quantizer", TE_MIN_VERSION, why="current scaling is byte-gathered"),
    TECall(f"{TENSOR}.float8_tensor", "Float8CurrentScalingQuantizer", TE_MIN_VERSION, kind="class"),
    *(TECall(F8, a, TE_MIN_VERSION) for a in ("_data", "_transpose", "_scale_inv")),
    TECall(BW, "_is_2D_scaled", BLOCKWISE_BYTES),
    *(TECall(cls, a, since) for cls, since in ((BW, _min_te("blockwise")), (MX, TE_MIN_VERSION),
                                               (NV, _min_te("nvfp4")))
      for a in ("_rowwise_data", "_columnwise_data", "_rowwise_scale_inv", "_columnwise_scale_inv")),
    *(TECall(NV, a, _min_te("nvfp4")) for a in ("_amax_rowwise", "_amax_columnwise")),
    TECall(UTILS, "replace_raw_data", TE_MIN_VERSION, kind="function"),
    TECall(UTILS, "cast_master_weights_to_fp8", TE_MIN_VERSION, until="2.13", kind="function"),
    TECall(UTILS, "quantize_master_weights", QUANTIZE_MASTER, kind="function"),
    TECall(UTILS, "post_all_gather_processing", POST_ALL_GATHER, kind="function"),
    # the single grouped weight (te_storage / te_adapter.member_weight)
    TECall(f"{TENSOR}.grouped_tensor", "GroupedTensor", SGW, kind="class"),
    *(TECall(GT, a, SGW) for a in ("quantized_tensors", "split_into_quantized_tensors", "quantize",
                                   "quantizer", "rowwise_data", "columnwise_data", "scale_inv",
                                   "columnwise_scale_inv", "amax", "columnwise_amax")),
    TECall(f"{RECIPE}.Float8CurrentScaling", "fp8_quant_fwd_inp", GROUPED_AMAX_EPSILON_MIN_TE,
           why="amax_epsilon in grouped expert GEMMs"),
    # quantization statistics (te_numerics): the modules' quantizers, copied and re-run
    *(TECall(f"{PT}.{m}", a, TE_MIN_VERSION, why="statistics probe")
      for m in ("Linear", "GroupedLinear") for a in ("quantizers", "fp8")),
    *(TECall(f"{TENSOR}.{mod}.{q}", a, since, why="statistics probe: a row-wise copy")
      for mod, q, since in (("float8_tensor", "Float8Quantizer", TE_MIN_VERSION),
                            ("float8_tensor", "Float8CurrentScalingQuantizer", TE_MIN_VERSION),
                            ("mxfp8_tensor", "MXFP8Quantizer", TE_MIN_VERSION),
                            ("float8_blockwise_tensor", "Float8BlockQuantizer", _min_te("blockwise")),
                            ("nvfp4_tensor", "NVFP4Quantizer", _min_te("nvfp4")))
      for a in ("copy", "set_usage")),
    *(TECall(f"{TENSOR}.{mod}.{q}", "optimize_for_gemm", "2.12", why="set off where it exists")
      for mod, q in (("float8_tensor", "Float8Quantizer"), ("mxfp8_tensor", "MXFP8Quantizer"),
                     ("nvfp4_tensor", "NVFP4Quantizer"))),
    TECall(f"{TENSOR}.nvfp4_tensor.NVFP4Quantizer", "stochastic_rounding", _min_te("nvfp4"),
           why="the probe rounds to nearest: no SR bits drawn"),
    *(TECall(cls, "_fp8_dtype", since, why="statistics: the clamp limit")
      for cls, since in ((F8, TE_MIN_VERSION), (MX, TE_MIN_VERSION), (BW, _min_te("blockwise")))),
    TECall(MX, "_with_gemm_swizzled_scales", "2.12", why="swizzled scales are not read"),
    *(TECall(f"{TENSOR}.{mod}.{q}", "internal", since, why="statistics probe: a copy returns a tensor")
      for mod, q, since in (("float8_tensor", "Float8Quantizer", TE_MIN_VERSION),
                            ("float8_tensor", "Float8CurrentScalingQuantizer", TE_MIN_VERSION),
                            ("mxfp8_tensor", "MXFP8Quantizer", TE_MIN_VERSION),
                            ("float8_blockwise_tensor", "Float8BlockQuantizer", _min_te("blockwise")),
                            ("nvfp4_tensor", "NVFP4Quantizer", _min_te("nvfp4")))),
    *(TECall(f"{TENSOR}.float8_tensor.Float8Quantizer", a, TE_MIN_VERSION,
             why="statistics probe: a delayed-scaling copy gets buffers of its own") for a in ("amax", "scale")),
    # evaluation keeps delayed scaling (te_adapter.forward_amax_slots_kept)
    *(TECall(f"{PT}.{m}", "fp8_meta", TE_MIN_VERSION, why="the forward amax slot around evaluation")
      for m in ("Linear", "GroupedLinear")),
    TECall(F8, "_scale_inv", TE_MIN_VERSION),
    # the precision-aware optimizer (te_adapter.te_fused_adam): FusedAdam built as Megatron
    # builds it, its state read and written through its own API
    TECall(f"{PT}.optimizers", "FusedAdam", TE_MIN_VERSION, kind="class"),
    *(TECall(FA, kw, TE_MIN_VERSION, kind="kwarg")
      for kw in ("params", "lr", "betas", "eps", "weight_decay", "adam_w_mode", "master_weights",
                 "master_weight_dtype", "exp_avg_dtype", "exp_avg_sq_dtype", "use_decoupled_grad",
                 "store_param_remainders")),
    *(TECall(FA, m, TE_MIN_VERSION) for m in (
        "_apply_scale", "initialize_state", "get_unscaled_state", "set_scaled_state", "step",
        "name_to_dtype_map", "store_param_remainders", "master_weights", "_scales")),
    TECall(F8, "_quantizer", TE_MIN_VERSION, why="an FP8 optimizer state's quantizer scale"),
    TECall(f"{TENSOR}.float8_tensor.Float8Quantizer", "scale", TE_MIN_VERSION),
)
