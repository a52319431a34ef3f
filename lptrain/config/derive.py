"""The one place where values that other settings determine are filled in.

``derive(cfg, world)`` returns a copy with every ``null``-means-derived field set, so the
rest of the code reads plain values and ``show-config`` shows what will actually run.
It is idempotent (a derived config derives to itself) and never raises on a nonsensical
config: the rule checker reports those, and it runs on the derived config.
"""

from __future__ import annotations

import copy

from lptrain.catalog.pipeline import V_SCHEDULES
from lptrain.catalog.pipeline_split import layout_vpp
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World

# DDP bucket size floor in elements (Megatron: max(40M, 1M * dp)).
MIN_BUCKET_SIZE = 40_000_000
BUCKET_SIZE_PER_RANK = 1_000_000


def default_bucket_size(dp: int) -> int:
    return max(MIN_BUCKET_SIZE, BUCKET_SIZE_PER_RANK * max(dp, 1))


def derive(cfg: LPTrainConfig, world: World) -> LPTrainConfig:
    """A copy of ``cfg`` with derived values filled in (explicit values are kept)."""
    out = copy.deepcopy(cfg)
    world = world.for_config(out)  # the data-parallel size at this tensor-parallel size
    prec, ddp, opt, model = out.precision, out.ddp, out.optimizer, out.model

    # precision.backend=auto: Transformer Engine only for a quantized recipe that TE supports
    # in this world, else emulated (plain PyTorch GEMMs when unquantized).
    if prec.backend == "auto":
        from lptrain.config.rulesets.te_backend import auto_backend

        prec.backend = auto_backend(out, world)
    # precision.quantized_gemm=auto: torch's scaled GEMM where it has the recipe's kernel on
    # this GPU (lptrain.catalog.scaled_gemm), Transformer Engine's own; dequantized on the CPU.
    if prec.quantized_gemm == "auto":
        from lptrain.catalog.scaled_gemm import resolve
        from lptrain.config.rules import quant_recipe
        from lptrain.config.rulesets.scaled_gemm import gemm_sm

        sm = gemm_sm(out, world)
        prec.quantized_gemm = resolve("auto", quant_recipe(out), sm,
                                      world.cublaslt_version if sm else None, prec.backend)

    # Gradients of bf16 params are reduced in fp32 unless the recipe says otherwise, or the
    # precision-aware optimizer's main grads are bf16 (Megatron: accumulate_allreduce_grads_in_
    # fp32 follows main_grads_dtype; PAO-MAIN-GRADS-DERIVE).
    if ddp.grad_reduce_in_fp32 is None:
        ddp.grad_reduce_in_fp32 = prec.params_dtype == "bf16" and opt.main_grads_dtype == "fp32"

    # PAO-REMAINDERS-DERIVE: TE keeps fp32 masters of bf16 params as remainders wherever it
    # holds them (Megatron's default store_param_remainders=True, which TE ignores elsewhere).
    if opt.store_param_remainders is None:
        from lptrain.config.rulesets.optim_state import remainders_possible

        opt.store_param_remainders = remainders_possible(out)

    # One bucket without overlap (nothing to pipeline); Megatron's size with it.
    if ddp.bucket_size is None and ddp.overlap_grad_reduce:
        ddp.bucket_size = default_bucket_size(world.dp)

    # The sharding strategy and the older boolean name one setting: null follows
    # use_distributed_optimizer; any optim* strategy is a distributed optimizer.
    if ddp.data_parallel_sharding_strategy is None:
        ddp.data_parallel_sharding_strategy = "optim" if ddp.use_distributed_optimizer else "no_shard"
    elif ddp.data_parallel_sharding_strategy != "no_shard":
        ddp.use_distributed_optimizer = True

    # MUON-LAYERWISE: Newton-Schulz needs whole matrices, so Muon with a distributed
    # optimizer shards by parameter (the layer-wise optimizer), not by byte range.
    if opt.use_layer_wise_optimizer is None:
        opt.use_layer_wise_optimizer = opt.name == "muon" and ddp.use_distributed_optimizer

    # train.on_anomaly=null follows the older train.on_nonfinite (stop, or skip the batch).
    if out.train.on_anomaly is None:
        out.train.on_anomaly = "skip_batch" if out.train.on_nonfinite == "skip" else "stop"
    # A layout string sets the virtual size (its chunks over the pipeline size), as in
    # Megatron-LM; the V schedules run exactly two chunks per rank.
    if model.pipeline_model_parallel_layout is not None and model.virtual_pipeline_model_parallel_size is None:
        vpp = layout_vpp(model.pipeline_model_parallel_layout, max(1, model.pipeline_model_parallel_size))
        if vpp is not None and vpp > 1:
            model.virtual_pipeline_model_parallel_size = vpp
    if model.pipeline_schedule in V_SCHEDULES and model.virtual_pipeline_model_parallel_size is None:
        model.virtual_pipeline_model_parallel_size = 2
    # The pipeline schedule follows the virtual chunks (Megatron picks the interleaved
    # schedule exactly when virtual_pipeline_model_parallel_size is set).
    if model.pipeline_schedule is None:
        vpp = model.virtual_pipeline_model_parallel_size
        model.pipeline_schedule = "interleaved_1f1b" if vpp is not None and vpp > 1 else "1f1b"

    if model.ffn_hidden_size is None:
        model.ffn_hidden_size = 4 * model.hidden_size
    if model.num_query_groups is None:
        model.num_query_groups = model.num_attention_heads
    # Experts default to the dense width; a dense model keeps null (MOE-FFN-NEEDS-EXPERTS
    # refuses an expert width on a model without experts).
    if model.moe.ffn_hidden_size is None and model.moe.num_experts > 0:
        model.moe.ffn_hidden_size = model.ffn_hidden_size
    return out
