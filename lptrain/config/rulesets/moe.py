"""Mixture-of-experts rules."""

from __future__ import annotations

from lptrain.config.rules import (
    INDEPENDENT_SCORE_FUNCTIONS,
    Rule,
    fp4_on,
    fp8_on,
    is_moe,
    is_mxfp8,
    sharded_optimizer,
)
from lptrain.config.schema import LPTrainConfig

S = "MoE"


def _sgw_recipe_bad(c: LPTrainConfig) -> bool:
    p = c.precision
    if not c.model.moe.single_grouped_weight:
        return False
    if fp8_on(c) and p.fp8_recipe != "mxfp8":
        return True
    return fp4_on(c) and (p.fp4_recipe != "nvfp4" or not p.fp4_param_gather)


RULES = [
    Rule(
        "MOE-SGW-NEEDS-GROUPED", "error", ("model.moe.single_grouped_weight", "model.moe.grouped_gemm"),
        lambda c, w: c.model.moe.single_grouped_weight and not c.model.moe.grouped_gemm,
        "single_grouped_weight=true stores all experts as one grouped parameter, which only the "
        "grouped GEMM path can consume",
        "set model.moe.grouped_gemm=true, or model.moe.single_grouped_weight=false",
        "single_grouped_weight -> grouped_gemm", "", S),
    Rule(
        "MOE-SGW-RECIPES", "error",
        ("model.moe.single_grouped_weight", "precision.fp8_recipe", "precision.fp4_recipe",
         "precision.fp4_param_gather"),
        lambda c, w: _sgw_recipe_bad(c),
        "single_grouped_weight with quantized GEMMs supports only MXFP8, or NVFP4 with "
        "fp4_param_gather: other quantized primary weights need grouped partial-cast support",
        "set precision.fp8_recipe=mxfp8 (FP8) or precision.fp4_param_gather=true (NVFP4), or "
        "model.moe.single_grouped_weight=false",
        "single_grouped_weight with fp8 -> fp8_recipe=mxfp8; with fp4 -> fp4_recipe=nvfp4 and "
        "fp4_param_gather", "other quantized primary weights need grouped partial-cast support", S),
    Rule(
        "MOE-SGW-MXFP8-REUSE", "error",
        ("model.moe.single_grouped_weight", "precision.fp8_param_gather",
         "ddp.reuse_grad_buf_for_mxfp8_param_ag"),
        lambda c, w: c.model.moe.single_grouped_weight and is_mxfp8(c)
        and c.precision.fp8_param_gather and sharded_optimizer(c)
        and not c.ddp.reuse_grad_buf_for_mxfp8_param_ag,
        "grouped MXFP8 expert weights with fp8_param_gather cannot be remapped into a flat "
        "buffer; the bf16 gather must ride the grad buffer",
        "set ddp.reuse_grad_buf_for_mxfp8_param_ag=true",
        "single_grouped_weight, mxfp8, fp8_param_gather, distributed optimizer -> "
        "reuse_grad_buf_for_mxfp8_param_ag",
        "grouped MXFP8 storage cannot be remapped (reported instead of PREC-MXFP8-PG-NEEDS-REUSE, "
        "with both keys)", S, supersedes=("PREC-MXFP8-PG-NEEDS-REUSE",)),
    Rule(
        "MOE-TOPK", "error", ("model.moe.router_topk", "model.moe.num_experts"),
        lambda c, w: c.model.moe.num_experts > 0
        and not 1 <= c.model.moe.router_topk <= c.model.moe.num_experts,
        "router_topk={cfg.model.moe.router_topk} must be in [1, num_experts="
        "{cfg.model.moe.num_experts}]",
        "set model.moe.router_topk between 1 and model.moe.num_experts",
        "1 <= router_topk <= num_experts (MoE models)", "", S),
    Rule(
        "MOE-EXPERT-BIAS-SCORE", "error", ("model.moe.enable_expert_bias", "model.moe.score_function"),
        lambda c, w: is_moe(c) and c.model.moe.enable_expert_bias
        and c.model.moe.score_function not in INDEPENDENT_SCORE_FUNCTIONS,
        "enable_expert_bias=true needs independent per-expert scores, but "
        "score_function={cfg.model.moe.score_function}: the aux-loss-free bias is added to "
        "each expert's own score to pick the top-k, which a softmax over experts does not have",
        "set model.moe.score_function=sigmoid (or sqrtsoftplus), or "
        "model.moe.enable_expert_bias=false",
        "enable_expert_bias (MoE) -> score_function in {" + ", ".join(INDEPENDENT_SCORE_FUNCTIONS)
        + "}",
        "Megatron-LM's TransformerConfig refuses it; the router would raise at model build", S),
    Rule(
        "MOE-TOPK1-SOFTMAX", "error", ("model.moe.router_topk", "model.moe.score_function"),
        lambda c, w: is_moe(c) and c.model.moe.router_topk == 1
        and c.model.moe.score_function == "softmax",
        "router_topk=1 with score_function=softmax: the softmax over the one chosen logit is "
        "always 1.0, so the language-model loss gives the router no gradient (only the "
        "balancing and z-losses would train it)",
        "set model.moe.score_function=sigmoid (or sqrtsoftplus: the chosen expert's own score "
        "scales its output), or model.moe.router_topk >= 2",
        "router_topk == 1 (MoE) -> score_function != softmax",
        "Megatron-LM's TransformerConfig refuses top-1 with post-top-k softmax (lptrain's "
        "softmax routing); measured here: the router weight's gradient is exactly zero", S),
    Rule(
        "MOE-EP-DIVIDES", "error", ("model.moe.num_experts", "model.moe.expert_model_parallel_size"),
        lambda c, w: c.model.moe.num_experts > 0 and (
            c.model.moe.expert_model_parallel_size < 1
            or c.model.moe.num_experts % c.model.moe.expert_model_parallel_size != 0),
        "num_experts={cfg.model.moe.num_experts} is not divisible by "
        "expert_model_parallel_size={cfg.model.moe.expert_model_parallel_size}",
        "set model.moe.expert_model_parallel_size to a divisor of model.moe.num_experts",
        "num_experts % expert_model_parallel_size == 0", "", S),
]
