"""Mixture-of-experts rules."""

from __future__ import annotations

from typing import Any

from lptrain.catalog.recipes import (
    SINGLE_GROUPED_WEIGHT_MIN_TE,
    grouped_tensor_path_refusal,
    parse_version,
)
from lptrain.config.rules import (
    INDEPENDENT_SCORE_FUNCTIONS,
    Rule,
    fp4_on,
    fp8_on,
    is_moe,
    is_mxfp8,
    quant_recipe,
    quant_spec,
    sharded_optimizer,
)
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World

S = "MoE"


def te_grouped_path_refusal(c: LPTrainConfig, w: World) -> str:
    """Why TE's native grouped-tensor path -- the only one TE (2.19+) runs a single grouped
    expert weight on -- would refuse this run in ``w`` (empty: it would run it)."""
    moe = c.model.moe
    if not (moe.num_experts > 0 and moe.single_grouped_weight and w.cuda):
        return ""
    if w.te_version is not None and parse_version(w.te_version) < parse_version(SINGLE_GROUPED_WEIGHT_MIN_TE):
        return ""  # PREC-TE-VERSION says it
    spec = quant_spec(c) if quant_recipe(c) is not None else None
    why = grouped_tensor_path_refusal(
        spec, w.sm, w.cublaslt_version, c.precision.params_dtype, c.precision.nvfp4_rht)
    return why or ""


def _te_sgw_path(c: LPTrainConfig, w: World) -> dict[str, Any]:
    if c.precision.backend != "te":
        return {}
    why = te_grouped_path_refusal(c, w)
    return {"why_not": why} if why else {}


def _sgw_recipe_bad(c: LPTrainConfig) -> bool:
    p = c.precision
    if not c.model.moe.single_grouped_weight:
        return False
    if fp8_on(c) and p.fp8_recipe != "mxfp8":
        return True
    return fp4_on(c) and (p.fp4_recipe != "nvfp4" or not p.fp4_param_gather)


RULES = [
    Rule(
        id="MOE-SGW-NEEDS-GROUPED", severity="error",
        keys=("model.moe.single_grouped_weight", "model.moe.grouped_gemm"),
        when=lambda c, w: c.model.moe.single_grouped_weight and not c.model.moe.grouped_gemm,
        message="single_grouped_weight=true stores all experts as one grouped parameter, which "
                "only the grouped GEMM path can consume",
        fix="set model.moe.grouped_gemm=true, or model.moe.single_grouped_weight=false",
        condition="single_grouped_weight -> grouped_gemm", section=S,
    ),
    Rule(
        id="MOE-SGW-RECIPES", severity="error",
        keys=("model.moe.single_grouped_weight", "precision.fp8_recipe", "precision.fp4_recipe",
              "precision.fp4_param_gather"),
        when=lambda c, w: _sgw_recipe_bad(c),
        message="single_grouped_weight with quantized GEMMs supports only MXFP8, or NVFP4 with "
                "fp4_param_gather: other quantized primary weights need grouped partial-cast "
                "support",
        fix="set precision.fp8_recipe=mxfp8 (FP8) or precision.fp4_param_gather=true (NVFP4), or "
            "model.moe.single_grouped_weight=false",
        condition="single_grouped_weight with fp8 -> fp8_recipe=mxfp8; with fp4 -> "
                  "fp4_recipe=nvfp4 and fp4_param_gather",
        why="other quantized primary weights need grouped partial-cast support", section=S,
    ),
    Rule(
        id="MOE-SGW-MXFP8-REUSE", severity="error",
        keys=("model.moe.single_grouped_weight", "precision.fp8_param_gather",
              "ddp.reuse_grad_buf_for_mxfp8_param_ag"),
        when=lambda c, w: c.model.moe.single_grouped_weight and is_mxfp8(c)
             and c.precision.fp8_param_gather and sharded_optimizer(c)
             and not c.ddp.reuse_grad_buf_for_mxfp8_param_ag,
        message="grouped MXFP8 expert weights with fp8_param_gather cannot be remapped into a flat "
                "buffer; the bf16 gather must ride the grad buffer",
        fix="set ddp.reuse_grad_buf_for_mxfp8_param_ag=true",
        condition="single_grouped_weight, mxfp8, fp8_param_gather, distributed optimizer -> "
                  "reuse_grad_buf_for_mxfp8_param_ag",
        why="grouped MXFP8 storage cannot be remapped (reported instead of "
            "PREC-MXFP8-PG-NEEDS-REUSE, with both keys)",
        section=S, supersedes=("PREC-MXFP8-PG-NEEDS-REUSE",),
    ),
    Rule(
        id="MOE-SGW-TE-GROUPED-PATH", severity="error",
        keys=("model.moe.single_grouped_weight", "precision.backend", "precision.fp8_recipe",
              "precision.params_dtype"),
        when=_te_sgw_path,
        message="Transformer Engine {world.te_version} runs a single grouped expert weight only on "
                "its native grouped-tensor GEMM path, which {why_not} (target {world.target}, "
                "CUDA {world.cuda_version}); TE would raise at the first expert GEMM",
        fix="set model.moe.single_grouped_weight=false (per-expert weights run on every TE), or "
            "run where the path applies (cuBLASLt >= 13.3, >= 13.4 on Hopper; MXFP8/NVFP4 on "
            "Blackwell; bf16 params); check another stack with --cuda-version",
        condition="backend=te, single_grouped_weight, and TE 2.19's is_module_grouped_tensor_"
                  "path_supported false for the target, cuBLASLt, recipe and activation dtype",
        why="TE 2.19 forces use_grouped_tensor for single grouped weights: 'Single grouped "
            "parameters require the native grouped-tensor path'",
        section=S,
    ),
    Rule(
        id="MOE-TOPK", severity="error", keys=("model.moe.router_topk", "model.moe.num_experts"),
        when=lambda c, w: c.model.moe.num_experts > 0
             and not 1 <= c.model.moe.router_topk <= c.model.moe.num_experts,
        message="router_topk={cfg.model.moe.router_topk} must be in [1, "
                "num_experts={cfg.model.moe.num_experts}]",
        fix="set model.moe.router_topk between 1 and model.moe.num_experts",
        condition="1 <= router_topk <= num_experts (MoE models)", section=S,
    ),
    Rule(
        id="MOE-EXPERT-BIAS-SCORE", severity="error",
        keys=("model.moe.enable_expert_bias", "model.moe.score_function"),
        when=lambda c, w: is_moe(c) and c.model.moe.enable_expert_bias
             and c.model.moe.score_function not in INDEPENDENT_SCORE_FUNCTIONS,
        message="enable_expert_bias=true needs independent per-expert scores, but "
                "score_function={cfg.model.moe.score_function}: the aux-loss-free bias is added to "
                "each expert's own score to pick the top-k, which a softmax over experts does not "
                "have",
        fix="set model.moe.score_function=sigmoid (or sqrtsoftplus), or "
            "model.moe.enable_expert_bias=false",
        condition="enable_expert_bias (MoE) -> score_function in {" + ", ".join(INDEPENDENT_SCORE_FUNCTIONS)
                  + "}",
        why="Megatron-LM's TransformerConfig refuses it; the router would raise at model build",
        section=S,
    ),
    Rule(
        id="MOE-TOPK1-SOFTMAX", severity="error",
        keys=("model.moe.router_topk", "model.moe.score_function"),
        when=lambda c, w: is_moe(c) and c.model.moe.router_topk == 1
             and c.model.moe.score_function == "softmax",
        message="router_topk=1 with score_function=softmax: the softmax over the one chosen logit "
                "is always 1.0, so the language-model loss gives the router no gradient (only the "
                "balancing and z-losses would train it)",
        fix="set model.moe.score_function=sigmoid (or sqrtsoftplus: the chosen expert's own score "
            "scales its output), or model.moe.router_topk >= 2",
        condition="router_topk == 1 (MoE) -> score_function != softmax",
        why="Megatron-LM's TransformerConfig refuses top-1 with post-top-k softmax (lptrain's "
            "softmax routing); measured here: the router weight's gradient is exactly zero",
        section=S,
    ),
    Rule(
        id="MOE-EP-DIVIDES", severity="error",
        keys=("model.moe.num_experts", "model.moe.expert_model_parallel_size"),
        when=lambda c, w: c.model.moe.num_experts > 0 and (
                 c.model.moe.expert_model_parallel_size < 1
                 or c.model.moe.num_experts % c.model.moe.expert_model_parallel_size != 0),
        message="num_experts={cfg.model.moe.num_experts} is not divisible by "
                "expert_model_parallel_size={cfg.model.moe.expert_model_parallel_size}",
        fix="set model.moe.expert_model_parallel_size to a divisor of model.moe.num_experts",
        condition="num_experts % expert_model_parallel_size == 0", section=S,
    ),
]
