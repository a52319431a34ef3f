"""Precision-aware optimizer rules: Megatron-LM's refusals of its keys, and the combinations
lptrain refuses with them (docs/optimizer-state.md).

The facts (which dtypes, who holds the masters) are :mod:`lptrain.catalog.optimizer_state`'s.
The gates refusing these keys where they would have no effect (the precision-aware optimizer
off: Megatron's "can only be fp32 when not using precision-aware optimizer"; remainders where
TE keeps none; fp32 params) are in :mod:`lptrain.config.rulesets.inert`.
"""

from __future__ import annotations

from typing import Any, Optional

from lptrain.catalog import optimizer_state as pao
from lptrain.config.rules import Rule, fp8_on, quant_recipe, sharded_optimizer
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World

S = "Precision-aware optimizer"


def masters_recipe(c: LPTrainConfig) -> Optional[str]:
    """The quantized GEMM recipe that decides who holds the masters (None: bf16 GEMMs)."""
    return quant_recipe(c)


def te_holds(c: LPTrainConfig) -> bool:
    """TE's FusedAdam holds the masters (Megatron's ``..._no_fp8_or_ds_fp8``)."""
    o = c.optimizer
    return pao.te_holds_masters(o.use_precision_aware_optimizer, o.main_params_dtype, masters_recipe(c))


def remainders_possible(c: LPTrainConfig) -> bool:
    """``store_param_remainders`` can take effect: TE holds fp32 masters of bf16 params."""
    o = c.optimizer
    return pao.remainders_apply(o.use_precision_aware_optimizer, o.main_params_dtype,
                                masters_recipe(c), c.precision.params_dtype)


def _quantized_pg(c: LPTrainConfig) -> bool:
    p = c.precision
    return bool((p.fp8_param_gather and fp8_on(c)) or (p.fp4_param_gather and p.fp4_format is not None))


def _scalar_lion(c: LPTrainConfig, w: World) -> bool:
    o = c.optimizer
    return o.use_precision_aware_optimizer and o.name == "muon" and o.muon.scalar_optimizer == "lion"


def _te_masters_quantized(c: LPTrainConfig, w: World) -> Any:
    if not (te_holds(c) and _quantized_pg(c)):
        return False
    key = "precision.fp8_param_gather" if c.precision.fp8_param_gather else "precision.fp4_param_gather"
    return {"keys": ("optimizer.main_params_dtype", key, "precision.fp8_recipe"), "pg": key,
            "recipe": quant_recipe(c)}


RULES = [
    Rule(
        id="PAO-MAIN-GRADS-DERIVE", severity="derived",
        keys=("optimizer.main_grads_dtype", "ddp.grad_reduce_in_fp32"), when=lambda c, w: False,
        message="bf16 main grads are a bf16 grad buffer",
        fix="nothing to do: derive() sets ddp.grad_reduce_in_fp32",
        condition="ddp.grad_reduce_in_fp32=null -> true when params_dtype=bf16 and "
                  "main_grads_dtype=fp32, else false",
        why="Megatron sets accumulate_allreduce_grads_in_fp32 for bf16 only with fp32 main grads: "
            "bf16 main grads are accumulated, reduced and read in bf16",
        section=S,
    ),
    Rule(
        id="PAO-REMAINDERS-DERIVE", severity="derived",
        keys=("optimizer.store_param_remainders",), when=lambda c, w: False,
        message="TE keeps fp32 masters of bf16 params as int16 remainders",
        fix="nothing to do: derive() sets optimizer.store_param_remainders",
        condition="store_param_remainders=null -> true when use_precision_aware_optimizer, "
                  "main_params_dtype=fp32, params_dtype=bf16 and TE holds the masters (no FP8 "
                  f"recipe among {', '.join(pao.LPTRAIN_HELD_RECIPES)} and no NVFP4); else false",
        why="Megatron's default store_param_remainders=True, which TE honours only for fp32 "
            "masters it holds of bf16 params (the bf16 param is the master's high half)",
        section=S,
    ),
    Rule(
        id="PAO-NEEDS-DISTOPT", severity="error",
        keys=("optimizer.use_precision_aware_optimizer", "ddp.use_distributed_optimizer"),
        when=lambda c, w: c.optimizer.use_precision_aware_optimizer and not sharded_optimizer(c),
        message="use_precision_aware_optimizer=true without a distributed optimizer: the "
                "optimizer keeps its lower-precision state per shard of the param buffers "
                "(Megatron: '--use-precision-aware-optimizer only supported with distributed "
                "optimizer')",
        fix="set ddp.use_distributed_optimizer=true (it works at one rank too), or "
            "optimizer.use_precision_aware_optimizer=false",
        condition="use_precision_aware_optimizer -> a distributed optimizer (Muon's layer-wise one "
                  "counts)",
        why="Megatron's get_megatron_optimizer refuses it: the optimizer's params are the shards "
            "of the distributed optimizer's buffers",
        section=S,
    ),
    Rule(
        id="PAO-ADAM-ONLY", severity="error",
        keys=("optimizer.use_precision_aware_optimizer", "optimizer.muon.scalar_optimizer"),
        when=_scalar_lion,
        message="use_precision_aware_optimizer=true with optimizer.muon.scalar_optimizer=lion: "
                "only Adam has a precision-aware form (Transformer Engine's FusedAdam; "
                "Megatron: '--use-precision-aware-optimizer only supported with adam')",
        fix="set optimizer.muon.scalar_optimizer=adamw, or "
            "optimizer.use_precision_aware_optimizer=false",
        condition="use_precision_aware_optimizer -> the params Muon does not take use AdamW",
        why="FusedAdam is the precision-aware kernel. Muon itself is allowed, unlike in "
            "Megatron: its momentum is a gradient average stored like Adam's exp_avg "
            "(exp_avg_dtype, TE's per-tensor scaling) and its masters stay fp32 "
            "(docs/optimizer-state.md)",
        section=S,
    ),
    Rule(
        id="PAO-MAIN-GRADS-FP32-REDUCE", severity="error",
        keys=("optimizer.main_grads_dtype", "ddp.grad_reduce_in_fp32"),
        when=lambda c, w: c.optimizer.main_grads_dtype == "bf16" and bool(c.ddp.grad_reduce_in_fp32),
        message="main_grads_dtype=bf16 with ddp.grad_reduce_in_fp32=true: fp32 grad buffers hold "
                "fp32 main grads (Megatron: '--main-grads-dtype can only be fp32 when "
                "--accumulate-allreduce-grads-in-fp32 is set')",
        fix="remove ddp.grad_reduce_in_fp32 (bf16 main grads derive it to false), or set "
            "optimizer.main_grads_dtype=fp32",
        condition="main_grads_dtype=bf16 -> not grad_reduce_in_fp32",
        why="the main grads are the grad buffer: bf16 main grads are reduced in bf16",
        section=S,
    ),
    Rule(
        id="PAO-MAIN-GRADS-MATCH-REDUCE", severity="error",
        keys=("optimizer.main_grads_dtype", "ddp.grad_reduce_in_fp32"),
        when=lambda c, w: (c.optimizer.use_precision_aware_optimizer
                           and c.precision.params_dtype == "bf16"
                           and c.optimizer.main_grads_dtype == "fp32"
                           and c.ddp.grad_reduce_in_fp32 is False),
        message="main_grads_dtype=fp32 with ddp.grad_reduce_in_fp32=false: the grads are "
                "accumulated and reduced in bf16, so the precision-aware optimizer's main grads "
                "are bf16",
        fix="set optimizer.main_grads_dtype=bf16 (and drop ddp.grad_reduce_in_fp32), or "
            "ddp.grad_reduce_in_fp32=true",
        condition="use_precision_aware_optimizer and params_dtype=bf16 -> main_grads_dtype is "
                  "the grad buffer's dtype",
        why="one setting, two spellings: lptrain keeps them from disagreeing (Megatron reads the "
            "bf16 buffer and ignores main_grads_dtype=fp32 there)",
        section=S,
    ),
    Rule(
        id="PAO-TE-MASTERS-QUANTIZED-PG", severity="error",
        keys=("optimizer.main_params_dtype", "precision.fp8_param_gather", "precision.fp4_param_gather",
              "precision.fp8_recipe"),
        when=_te_masters_quantized,
        message="the precision-aware optimizer with {pg}=true and {recipe} primary weights: TE "
                "would hold the masters here (main_params_dtype={cfg.optimizer.main_params_dtype}), "
                "but Megatron hands TE no shard of a quantized primary weight to step (and TE's "
                "fused delayed-scaling FP8 Adam kernel needs fp32 masters)",
        fix="set optimizer.main_params_dtype=fp32 with an fp8_recipe other than delayed (lptrain "
            "then keeps fp32 masters and requantizes the primary weights from them), or {pg}=false",
        condition="TE holds the masters (main_params_dtype=fp16, or no FP8 recipe other than "
                  "delayed) -> no fp8_param_gather / fp4_param_gather",
        why="DistributedOptimizer._build_model_and_main_param_groups passes no shard of MXFP8, "
            "blockwise or NVFP4 params to FusedAdam; FusedAdam's multi_tensor_adam_fp8 checks "
            "for fp32 masters",
        section=S,
    ),
    Rule(
        id="PAO-MUON-FP16-MASTERS", severity="error",
        keys=("optimizer.main_params_dtype", "optimizer.name"),
        when=lambda c, w: (c.optimizer.use_precision_aware_optimizer and c.optimizer.name == "muon"
                           and c.optimizer.main_params_dtype == "fp16"),
        message="main_params_dtype=fp16 with Muon: fp16 masters are FusedAdam's (TE holds them "
                "for the params it steps); Muon's matrices keep fp32 masters",
        fix="set optimizer.main_params_dtype=fp32 (bf16 or fp8 moments still apply to Muon's "
            "momentum), or optimizer.name=adamw",
        condition="use_precision_aware_optimizer and optimizer.name=muon -> main_params_dtype=fp32",
        why="half the masters in fp16 and half in fp32 would be a setting honoured for some "
            "params only",
        section=S,
    ),
]
