"""Every rule fires on a config made for it, and not on a near neighbour.

Each row: rule id, overrides that trigger exactly that rule, the keys it must report,
overrides of a near neighbour that triggers nothing, and the world to check in.
"""

from __future__ import annotations

import re

import pytest

from lptrain.config import World, check, compose, derive
from lptrain.config.rules import Violation, all_rules, rule_ids

PLACEHOLDER = re.compile(r"(?<!\$)\{[a-z_]+(\.[a-z_]+)*\}")
CPU = World()
# The same world, for cases whose datasets do not exist: their DATA-UNREADABLE warning is
# expected and not the point of the case.
CPU_WITH_MISSING_DATA = World(dp=1)


def violations(overrides: list[str], world: World = CPU) -> list[Violation]:
    """Violations of the schema-default config with ``overrides`` applied."""
    return check(compose(None, overrides), world)


SM90 = World(dp=1, target="sm90", te_version="2.14", cuda=True)
SM100_OLD_TE = World(dp=1, target="sm100", te_version="2.2", cuda=True)
SM100 = World(dp=1, target="sm100", te_version="2.19", cuda=True, cuda_version="12.9")
SM120 = World(dp=1, target="sm120", te_version="2.19", cuda=True, cuda_version="12.9")
SM90_CUDA128 = World(dp=1, target="sm90", te_version="2.19", cuda=True, cuda_version="12.8")
SM100_CUDA133 = World(dp=1, target="sm100", te_version="2.19", cuda=True, cuda_version="13.3")
TE = "precision.backend=te"
FP4 = "precision.fp4_format=e2m1"

E4M3 = "precision.fp8_format=e4m3"
HYBRID = "precision.fp8_format=hybrid"
MXFP8 = "precision.fp8_recipe=mxfp8"
FP8PG = "precision.fp8_param_gather=true"
DISTOPT = "ddp.use_distributed_optimizer=true"
REUSE = "ddp.reuse_grad_buf_for_mxfp8_param_ag=true"
MUON = "optimizer.name=muon"
MOE = "model.moe.num_experts=4"
GROUPED = "model.moe.grouped_gemm=true"
TENSORWISE = "precision.fp8_recipe=tensorwise"
LION = "optimizer.muon.scalar_optimizer=lion"
SGW = "model.moe.single_grouped_weight=true"
TP2 = "model.tensor_model_parallel_size=2"
SP = "model.sequence_parallel=true"
PP2 = "model.pipeline_model_parallel_size=2"
VPP2 = "model.virtual_pipeline_model_parallel_size=2"
CP2 = "model.context_parallel_size=2"
CP4 = "model.context_parallel_size=4"
HCP22 = "model.hierarchical_context_parallel_sizes=[2,2]"
PAO = "optimizer.use_precision_aware_optimizer=true"
BF16_GRADS = "optimizer.main_grads_dtype=bf16"
FP16_MASTERS = "optimizer.main_params_dtype=fp16"
FIRST1 = "model.decoder_first_pipeline_num_layers=1"
ZB = "model.pipeline_schedule=interleaved_zero_bubble"
ZBV = "model.pipeline_schedule=zbv_zero_bubble"

# (rule, trigger overrides, expected keys (subset, in order), neighbour overrides, world[,
# the neighbour's world when it differs])
CASES: list[tuple] = [
    ("PREC-FP8-FP4-EXCLUSIVE", [E4M3, "precision.fp4_format=e2m1"],
     ("precision.fp8_format", "precision.fp4_format"), ["precision.fp4_format=e2m1"], CPU),
    ("PREC-FP8PG-NEEDS-FP8", [FP8PG, DISTOPT], ("precision.fp8_param_gather",),
     [FP8PG, DISTOPT, E4M3], CPU),
    ("PREC-FP4PG-NEEDS-FP4", ["precision.fp4_param_gather=true", DISTOPT],
     ("precision.fp4_param_gather",),
     ["precision.fp4_param_gather=true", DISTOPT, "precision.fp4_format=e2m1"], CPU),
    ("PREC-PG-NEEDS-DISTOPT", [E4M3, FP8PG], ("ddp.use_distributed_optimizer",),
     [E4M3, FP8PG, DISTOPT], CPU),
    ("PREC-MXFP8-PG-NEEDS-REUSE", [E4M3, MXFP8, FP8PG, DISTOPT],
     ("ddp.reuse_grad_buf_for_mxfp8_param_ag",), [E4M3, MXFP8, FP8PG, DISTOPT, REUSE], CPU),
    ("PREC-REUSE-NEEDS-MXFP8-PG", [REUSE], ("ddp.reuse_grad_buf_for_mxfp8_param_ag",),
     [REUSE, E4M3, MXFP8, FP8PG, DISTOPT], CPU),
    ("PREC-MXFP8-E4M3", [HYBRID, MXFP8], ("precision.fp8_format",), [E4M3, MXFP8], CPU),
    ("PREC-BLOCKWISE-E4M3", [HYBRID, "precision.fp8_recipe=blockwise"], ("precision.fp8_format",),
     [E4M3, "precision.fp8_recipe=blockwise"], CPU),
    ("PREC-DELAYED-FIRST-LAST", [E4M3, "precision.first_last_layers_bf16=true"],
     ("precision.first_last_layers_bf16",),
     [E4M3, "precision.fp8_recipe=tensorwise", "precision.first_last_layers_bf16=true"], CPU),
    ("PREC-BF16-LAYERS-RANGE",
     [E4M3, TENSORWISE, "precision.first_last_layers_bf16=true",
      "precision.num_layers_at_start_in_bf16=2"],
     ("precision.num_layers_at_start_in_bf16",),
     [E4M3, TENSORWISE, "precision.first_last_layers_bf16=true",
      "precision.num_layers_at_start_in_bf16=1"], CPU),
    ("PREC-GEMM-ALIGN", [E4M3, MXFP8, "model.ffn_hidden_size=112"], ("model.ffn_hidden_size",),
     [E4M3, MXFP8, "model.ffn_hidden_size=128"], CPU),
    ("PREC-TARGET-SUPPORT", ["precision.backend=te", E4M3, MXFP8], ("precision.fp8_recipe",),
     ["precision.backend=te", E4M3, "precision.fp8_recipe=blockwise"], SM90),
    ("PREC-TE-VERSION", ["precision.backend=te", E4M3, "precision.fp8_recipe=blockwise"],
     ("precision.fp8_recipe",),
     ["precision.backend=te", E4M3, "precision.fp8_recipe=tensorwise"], SM100_OLD_TE),
    ("PREC-BACKEND-AVAILABLE", ["precision.backend=te"], ("precision.backend",),
     ["precision.backend=emulated"], CPU),
    ("PREC-MXFP8-SM120", [TE, E4M3, MXFP8], ("precision.fp8_recipe",),
     [TE, E4M3, "precision.fp8_recipe=tensorwise"], SM120),
    ("PREC-BLOCKWISE-CUDA", [TE, E4M3, "precision.fp8_recipe=blockwise"],
     ("precision.fp8_recipe",), [TE, E4M3, "precision.fp8_recipe=tensorwise"], SM90_CUDA128),
    ("PREC-NVFP4-RHT-BF16", [TE, FP4, "precision.params_dtype=fp32"],
     ("precision.params_dtype",), [TE, FP4, "precision.params_dtype=fp32", "precision.nvfp4_rht=false"],
     SM100),
    ("PREC-TE-NEEDS-CUDA-DEVICE", [TE, "run.device=cpu"], ("run.device",), [TE, "run.device=auto"],
     SM90),
    ("RUN-DEVICE-CUDA", ["run.device=cuda"], ("run.device",), ["run.device=auto"], CPU),
    ("PREC-SCALED-MM-KERNEL", ["precision.backend=emulated", FP4, "precision.quantized_gemm=scaled_mm"],
     ("precision.quantized_gemm", "precision.fp4_recipe"),
     ["precision.backend=emulated", FP4, "precision.quantized_gemm=scaled_mm"], SM90, SM100),
    ("PREC-DEQUANTIZED-TE", [TE, E4M3, "precision.quantized_gemm=dequantized"],
     ("precision.quantized_gemm",), [TE, E4M3, "precision.quantized_gemm=auto"], SM90),
    ("INERT-QUANTIZED-GEMM", ["precision.quantized_gemm=scaled_mm"], ("precision.quantized_gemm",),
     [E4M3, "precision.quantized_gemm=scaled_mm"], CPU),
    ("DDP-OVERLAP-PG-NEEDS-DISTOPT",
     ["ddp.overlap_param_gather=true", "ddp.overlap_grad_reduce=true"],
     ("ddp.use_distributed_optimizer",),
     ["ddp.overlap_param_gather=true", "ddp.overlap_grad_reduce=true", DISTOPT], CPU),
    ("DDP-OVERLAP-PG-NEEDS-OVERLAP-GR", ["ddp.overlap_param_gather=true", DISTOPT],
     ("ddp.overlap_grad_reduce",),
     ["ddp.overlap_param_gather=true", DISTOPT, "ddp.overlap_grad_reduce=true"], CPU),
    ("DDP-INSTANCES-NEED-DISTOPT", ["ddp.num_distributed_optimizer_instances=2"],
     ("ddp.use_distributed_optimizer",),
     ["ddp.num_distributed_optimizer_instances=2", DISTOPT], World(dp=2)),
    ("DDP-INSTANCES-DIVIDE-DP",
     ["ddp.num_distributed_optimizer_instances=3", DISTOPT, "train.micro_batch_size=2"],
     ("ddp.num_distributed_optimizer_instances",),
     ["ddp.num_distributed_optimizer_instances=2", DISTOPT, "train.micro_batch_size=2"],
     World(dp=4)),
    ("DDP-NO-SHARD-WITH-DISTOPT", ["ddp.data_parallel_sharding_strategy=no_shard", DISTOPT],
     ("ddp.data_parallel_sharding_strategy",), ["ddp.data_parallel_sharding_strategy=optim", DISTOPT],
     CPU),
    ("DDP-SHARDED-GRADS-NO-GRAD-BUF-REUSE",
     ["ddp.data_parallel_sharding_strategy=optim_grads", E4M3, MXFP8, FP8PG, REUSE],
     ("ddp.reuse_grad_buf_for_mxfp8_param_ag",),
     ["ddp.data_parallel_sharding_strategy=optim_grads", E4M3, MXFP8, FP8PG], CPU),
    ("DDP-SHARDED-PARAMS-TE-BYTES",
     ["ddp.data_parallel_sharding_strategy=optim_grads_params", TE, E4M3, TENSORWISE, FP8PG],
     ("ddp.data_parallel_sharding_strategy",),
     ["ddp.data_parallel_sharding_strategy=optim_grads", TE, E4M3, TENSORWISE, FP8PG], SM90),
    ("DDP-SHARDED-GRADS-NOT-MUON", ["ddp.data_parallel_sharding_strategy=optim_grads", MUON],
     ("ddp.data_parallel_sharding_strategy", "optimizer.name"),
     ["ddp.data_parallel_sharding_strategy=optim_grads", MUON, "optimizer.layer_wise_param_layout=padded"],
     CPU),
    ("DDP-BUCKET-SIZE", ["ddp.bucket_size=0"], ("ddp.bucket_size",), ["ddp.bucket_size=1000"], CPU),
    ("MUON-LAYERWISE-ONE-INSTANCE", [MUON, DISTOPT, "ddp.num_distributed_optimizer_instances=2"],
     ("ddp.num_distributed_optimizer_instances",), [MUON, DISTOPT], World(dp=2)),
    ("MUON-COMPACT-NO-FP4PG",
     [MUON, DISTOPT, "precision.fp4_format=e2m1", "precision.fp4_param_gather=true"],
     ("precision.fp4_param_gather",), [MUON, DISTOPT, "precision.fp4_format=e2m1"], CPU),
    ("MUON-COMPACT-FP8PG-RECIPE", [MUON, DISTOPT, E4M3, "precision.fp8_recipe=tensorwise", FP8PG],
     ("precision.fp8_recipe",), [MUON, DISTOPT, E4M3, "precision.fp8_recipe=blockwise", FP8PG],
     CPU),
    ("MUON-PADDED-NO-PG",
     [MUON, DISTOPT, "optimizer.layer_wise_param_layout=padded", E4M3,
      "precision.fp8_recipe=blockwise", FP8PG],
     ("optimizer.layer_wise_param_layout", "precision.fp8_param_gather"),
     [MUON, DISTOPT, "optimizer.layer_wise_param_layout=padded", E4M3,
      "precision.fp8_recipe=blockwise"], CPU),
    ("MUON-COMPACT-NO-MODEL-SPACE",
     [MUON, DISTOPT, "checkpoint.sharding_type=fully_sharded_model_space"],
     ("checkpoint.sharding_type",), [MUON, DISTOPT, "checkpoint.sharding_type=fully_reshardable"],
     CPU),
    ("MUON-GROUPED-FP8PG", [MUON, DISTOPT, E4M3, MXFP8, FP8PG, REUSE, MOE, GROUPED, SGW],
     ("model.moe.single_grouped_weight",), [MUON, DISTOPT, E4M3, MXFP8, FP8PG, REUSE, MOE, GROUPED],
     CPU),
    ("CKPT-MODEL-SPACE", ["checkpoint.sharding_type=fully_sharded_model_space"],
     ("checkpoint.sharding_type",), ["checkpoint.sharding_type=fully_reshardable"], CPU),
    ("MUON-LR-SCALE", [MUON, "optimizer.lr=2e-2", "optimizer.min_lr=2e-3"], ("optimizer.lr",),
     [MUON, "optimizer.lr=2e-3", "optimizer.min_lr=2e-4"], CPU),
    # the precision-aware optimizer (lptrain/config/rulesets/optim_state.py)
    ("PAO-NEEDS-DISTOPT", [PAO], ("optimizer.use_precision_aware_optimizer", "ddp.use_distributed_optimizer"),
     [PAO, DISTOPT], CPU),
    ("PAO-ADAM-ONLY", [PAO, DISTOPT, MUON, LION],
     ("optimizer.use_precision_aware_optimizer", "optimizer.muon.scalar_optimizer"), [PAO, DISTOPT, MUON], CPU),
    ("PAO-MAIN-GRADS-FP32-REDUCE", [PAO, DISTOPT, BF16_GRADS, "ddp.grad_reduce_in_fp32=true"],
     ("optimizer.main_grads_dtype", "ddp.grad_reduce_in_fp32"), [PAO, DISTOPT, BF16_GRADS], CPU),
    ("PAO-MAIN-GRADS-MATCH-REDUCE", [PAO, DISTOPT, "ddp.grad_reduce_in_fp32=false"],
     ("optimizer.main_grads_dtype", "ddp.grad_reduce_in_fp32"),
     [PAO, DISTOPT, "ddp.grad_reduce_in_fp32=false", BF16_GRADS], CPU),
    ("PAO-TE-MASTERS-QUANTIZED-PG", [PAO, DISTOPT, E4M3, MXFP8, FP8PG, REUSE, FP16_MASTERS],
     ("optimizer.main_params_dtype", "precision.fp8_param_gather"), [PAO, DISTOPT, E4M3, MXFP8, FP8PG, REUSE], CPU),
    ("PAO-MUON-FP16-MASTERS", [PAO, DISTOPT, MUON, FP16_MASTERS], ("optimizer.main_params_dtype", "optimizer.name"),
     [PAO, DISTOPT, MUON], CPU),
    ("PAO-DTYPES-NEED-PAO", ["optimizer.exp_avg_dtype=bf16"], ("optimizer.exp_avg_dtype",),
     [PAO, DISTOPT, "optimizer.exp_avg_dtype=bf16"], CPU),
    ("INERT-PAO-REMAINDERS", [PAO, DISTOPT, FP16_MASTERS, "optimizer.store_param_remainders=true"],
     ("optimizer.store_param_remainders",), [PAO, DISTOPT, "optimizer.store_param_remainders=true"], CPU),
    ("INERT-PAO-FP32-PARAMS", [PAO, DISTOPT, "precision.params_dtype=fp32", FP16_MASTERS],
     ("optimizer.main_params_dtype",), [PAO, DISTOPT, "precision.params_dtype=fp32"], CPU),
    ("MUON-HPARAMS", [MUON, "optimizer.muon.momentum=1.0"], ("optimizer.muon.momentum",),
     [MUON, "optimizer.muon.momentum=0.9"], CPU),
    ("MOE-SGW-NEEDS-GROUPED", [MOE, SGW], ("model.moe.grouped_gemm",), [MOE, SGW, GROUPED], CPU),
    ("MOE-SGW-RECIPES", [MOE, GROUPED, SGW, E4M3, "precision.fp8_recipe=blockwise"],
     ("model.moe.single_grouped_weight", "precision.fp8_recipe"), [MOE, GROUPED, SGW, E4M3, MXFP8],
     CPU),
    ("MOE-SGW-MXFP8-REUSE", [MOE, GROUPED, SGW, E4M3, MXFP8, FP8PG, DISTOPT],
     ("model.moe.single_grouped_weight", "ddp.reuse_grad_buf_for_mxfp8_param_ag",
      "precision.fp8_recipe"),
     [MOE, GROUPED, SGW, E4M3, MXFP8, FP8PG, DISTOPT, REUSE], CPU),
    ("MOE-SGW-TE-GROUPED-PATH", [TE, MOE, GROUPED, SGW, E4M3, MXFP8, "precision.params_dtype=fp32"],
     ("model.moe.single_grouped_weight", "precision.backend"),
     [TE, MOE, GROUPED, SGW, E4M3, MXFP8, "precision.params_dtype=bf16"], SM100_CUDA133),
    ("MOE-TOPK", [MOE, "model.moe.router_topk=5"], ("model.moe.router_topk",),
     [MOE, "model.moe.router_topk=4"], CPU),
    ("LAUNCH-EP-DIVIDES-WORLD", [MOE, "model.moe.expert_model_parallel_size=4"],
     ("model.moe.expert_model_parallel_size",), [MOE, "model.moe.expert_model_parallel_size=2"],
     World(dp=2)),
    ("EP-INSTANCES-DIVIDE-WORLD", [MOE, "model.moe.expert_model_parallel_size=2", DISTOPT,
                                   "ddp.num_distributed_optimizer_instances=2"],
     ("model.moe.expert_model_parallel_size", "ddp.num_distributed_optimizer_instances"),
     [MOE, "model.moe.expert_model_parallel_size=2", DISTOPT], World(dp=2)),
    ("MOE-EP-DIVIDES", [MOE, "model.moe.expert_model_parallel_size=3", "train.global_batch_size=24"],
     ("model.moe.expert_model_parallel_size",),
     [MOE, "model.moe.expert_model_parallel_size=2", "train.global_batch_size=24"], World(dp=6)),
    ("LAUNCH-TP-DIVIDES-WORLD", [TP2], ("model.tensor_model_parallel_size",), [TP2],
     World(ranks=3), World(ranks=4)),
    ("LAUNCH-PP-DIVIDES-WORLD", [PP2, "train.micro_batch_size=2"], ("model.pipeline_model_parallel_size",),
     [PP2, "train.micro_batch_size=2"], World(ranks=3), World(ranks=4)),
    ("PP-LAYERS-DIVIDE", [PP2, "model.num_layers=3"], ("model.num_layers",), [PP2, "model.num_layers=4"], CPU),
    ("PP-VIRTUAL-NEEDS-PP", [VPP2], ("model.virtual_pipeline_model_parallel_size",),
     [PP2, VPP2, "model.num_layers=4"], CPU),
    ("PP-SCHEDULE-VIRTUAL", [PP2, "model.pipeline_schedule=interleaved_1f1b"], ("model.pipeline_schedule",),
     [PP2, "model.pipeline_schedule=interleaved_1f1b", VPP2, "model.num_layers=4"], CPU),
    ("PP-MICRO-BATCHES", [PP2, VPP2, "model.num_layers=4", "train.global_batch_size=4"], ("train.global_batch_size",),
     [PP2, VPP2, "model.num_layers=4", "train.global_batch_size=8"], CPU),
    ("PP-FEW-MICRO-BATCHES", [PP2, "train.global_batch_size=4"], ("train.global_batch_size",),
     [PP2, "train.global_batch_size=8"], CPU),
    ("PP-INTERLEAVED-MICRO-BATCHES", [PP2, VPP2, "model.num_layers=4", "train.micro_batch_size=1",
                                      "train.global_batch_size=3"], ("train.global_batch_size",),
     [PP2, VPP2, "model.num_layers=4", "train.micro_batch_size=1", "train.global_batch_size=4"], CPU),
    ("PP-SPLIT-NEEDS-PP", [FIRST1], ("model.decoder_first_pipeline_num_layers",),
     [PP2, "model.num_layers=3", FIRST1], CPU),
    ("PP-UNEVEN-EXCLUSIVE", [PP2, "model.num_layers=3", FIRST1, "model.account_for_embedding_in_pipeline_split=true"],
     ("model.decoder_first_pipeline_num_layers", "model.account_for_embedding_in_pipeline_split"),
     [PP2, "model.num_layers=3", FIRST1], CPU),
    ("PP-UNEVEN-POSITIVE", [PP2, "model.decoder_first_pipeline_num_layers=0"],
     ("model.decoder_first_pipeline_num_layers",), [PP2, "model.num_layers=3", FIRST1], CPU),
    ("PP-UNEVEN-VIRTUAL", [PP2, VPP2, "model.num_layers=6", "model.decoder_first_pipeline_num_layers=3"],
     ("model.decoder_first_pipeline_num_layers",),
     [PP2, VPP2, "model.num_layers=6", "model.decoder_first_pipeline_num_layers=2"], CPU),
    ("PP-UNEVEN-MIDDLE", [PP2, "model.num_layers=3", FIRST1, "model.decoder_last_pipeline_num_layers=1"],
     ("model.decoder_first_pipeline_num_layers",),
     [PP2, "model.num_layers=2", FIRST1, "model.decoder_last_pipeline_num_layers=1"], CPU),
    ("PP-UNEVEN-V-SHAPE", [PP2, "model.num_layers=4", FIRST1, ZBV], ("model.decoder_first_pipeline_num_layers",),
     [PP2, "model.num_layers=4", ZBV], CPU),
    ("PP-ACCOUNT-DIVIDES", [PP2, "model.account_for_embedding_in_pipeline_split=true"],
     ("model.num_layers", "model.account_for_embedding_in_pipeline_split"),
     [PP2, "model.num_layers=3", "model.account_for_embedding_in_pipeline_split=true"], CPU),
    ("PP-LAYOUT-EXCLUSIVE", [PP2, "model.pipeline_model_parallel_layout=Et|tL",
                             "model.account_for_loss_in_pipeline_split=true"],
     ("model.pipeline_model_parallel_layout",), [PP2, "model.pipeline_model_parallel_layout=Et|tL"], CPU),
    ("PP-LAYOUT-GRAMMAR", [PP2, "model.pipeline_model_parallel_layout=Et|tmL"],
     ("model.pipeline_model_parallel_layout",), [PP2, "model.pipeline_model_parallel_layout=Et|tL"], CPU),
    ("PP-LAYOUT-STAGES", [PP2, "model.pipeline_model_parallel_layout=Et|t|L"],
     ("model.pipeline_model_parallel_layout",), [PP2, "model.pipeline_model_parallel_layout=(t)*0Et|tL"], CPU),
    ("PP-LAYOUT-CONTENTS", [PP2, "model.pipeline_model_parallel_layout=tE|tL"],
     ("model.pipeline_model_parallel_layout",), [PP2, "model.pipeline_model_parallel_layout=E,t*1|tL"], CPU),
    ("PP-SCHEDULE-NEEDS-PP", [ZB], ("model.pipeline_schedule",), [PP2, ZB], CPU),
    ("PP-SPLIT-BACKWARD-TE", [PP2, ZB, TE, E4M3], ("model.pipeline_schedule", "precision.backend"),
     [PP2, TE, E4M3], SM90),
    ("PP-DUALPIPEV-MICRO-BATCHES", [PP2, "model.num_layers=4", "model.pipeline_schedule=dualpipev"],
     ("train.global_batch_size",),
     [PP2, "model.num_layers=4", "model.pipeline_schedule=dualpipev", "train.micro_batch_size=2"], CPU),
    ("PP-MUON-EVERY-STAGE", [PP2, MUON, "model.pipeline_model_parallel_layout=Ett|L"], ("optimizer.name",),
     [PP2, MUON, "model.pipeline_model_parallel_layout=Et|tL"], CPU),
    ("PP-MOE-EVERY-STAGE", [MOE, PP2, "model.num_layers=4", "model.moe.moe_layer_freq=4"],
     ("model.moe.moe_layer_freq",), [MOE, PP2, "model.num_layers=4", "model.moe.moe_layer_freq=2"], CPU),
    ("LAUNCH-CP-DIVIDES-WORLD", [CP2, "train.micro_batch_size=2"], ("model.context_parallel_size",),
     [CP2, "train.micro_batch_size=2"], World(ranks=3), World(ranks=4)),
    ("CP-SEQ-DIVIDES", [CP2, "model.seq_length=126"], ("model.seq_length", "model.context_parallel_size"),
     [CP2, "model.seq_length=124"], CPU),
    ("CP-SP-SEQ-DIVIDES", ["model.tensor_model_parallel_size=4", SP, CP2, "model.seq_length=132"],
     ("model.seq_length",), ["model.tensor_model_parallel_size=4", SP, CP2, "model.seq_length=136"], CPU),
    ("CP-A2A-HEADS", [CP2, "model.cp_comm_type=a2a", "model.num_query_groups=1"],
     ("model.num_query_groups", "model.cp_comm_type"),
     [CP2, "model.cp_comm_type=a2a", "model.num_query_groups=2"], CPU),
    ("CP-HIERARCHICAL-NEEDS-SIZES", [CP4, "model.cp_comm_type=a2a+p2p"],
     ("model.hierarchical_context_parallel_sizes",), [CP4, "model.cp_comm_type=a2a+p2p", HCP22], CPU),
    ("CP-HIERARCHICAL-PRODUCT", [CP4, "model.cp_comm_type=a2a+p2p", "model.hierarchical_context_parallel_sizes=[2,3]"],
     ("model.hierarchical_context_parallel_sizes",), [CP4, "model.cp_comm_type=a2a+p2p", HCP22], CPU),
    ("CP-BLOCK-BOUNDARY", [E4M3, MXFP8, CP2, "model.seq_length=64"], ("model.seq_length", "precision.fp8_recipe"),
     [E4M3, MXFP8, CP2], CPU),
    ("INERT-CP-KEYS", ["model.cp_comm_type=a2a"], ("model.cp_comm_type",), [CP2, "model.cp_comm_type=a2a"], CPU),
    ("INERT-CP-HIERARCHICAL", [CP4, HCP22], ("model.hierarchical_context_parallel_sizes",),
     [CP4, HCP22, "model.cp_comm_type=a2a+p2p"], CPU),
    ("TP-HEADS", ["model.tensor_model_parallel_size=8"], ("model.num_attention_heads",),
     ["model.tensor_model_parallel_size=4"], CPU),
    ("TP-KV-HEADS", [TP2, "model.num_query_groups=1"], ("model.num_query_groups",),
     [TP2, "model.num_query_groups=2"], CPU),
    ("TP-FFN", [TP2, "model.ffn_hidden_size=255"], ("model.ffn_hidden_size",),
     [TP2, "model.ffn_hidden_size=254"], CPU),
    ("SP-NEEDS-TP", [SP], ("model.sequence_parallel",), [SP, TP2], CPU),
    ("SP-SEQ-DIVIDES", [TP2, SP, "model.seq_length=127"], ("model.seq_length",),
     [TP2, SP, "model.seq_length=126"], CPU),
    ("TP-MOE-NEEDS-SP", [MOE, TP2], ("model.sequence_parallel",), [MOE, TP2, SP], CPU),
    ("MOE-ETP-ONE", ["model.moe.expert_tensor_parallel_size=2"],
     ("model.moe.expert_tensor_parallel_size",), [], CPU),
    # Blockwise (128-blocks, 16-aligned GEMMs): a split off the block boundary that PREC-GEMM-ALIGN
    # alone would accept (MXFP8's block equals its alignment, so that rule fires with it).
    ("TP-BLOCK-BOUNDARY", [E4M3, "precision.fp8_recipe=blockwise", TP2],
     ("model.hidden_size", "precision.fp8_recipe", "model.tensor_model_parallel_size"),
     [E4M3, "precision.fp8_recipe=blockwise"], CPU),
    ("INERT-MUON-TP-MODE", [MUON, "optimizer.muon.tp_mode=distributed"],
     ("optimizer.muon.tp_mode",), [MUON, "optimizer.muon.tp_mode=distributed", TP2], CPU),
    ("MOE-EXPERT-BIAS-SCORE", [MOE, "model.moe.enable_expert_bias=true"],
     ("model.moe.enable_expert_bias", "model.moe.score_function"),
     [MOE, "model.moe.enable_expert_bias=true", "model.moe.score_function=sqrtsoftplus"], CPU),
    ("MOE-TOPK1-SOFTMAX", [MOE, "model.moe.router_topk=1"],
     ("model.moe.router_topk", "model.moe.score_function"),
     [MOE, "model.moe.router_topk=1", "model.moe.score_function=sigmoid"], CPU),
    ("MODEL-HEADS", ["model.num_attention_heads=3"], ("model.num_attention_heads",),
     ["model.num_attention_heads=8"], CPU),
    ("BATCH-DIVISIBLE", ["train.global_batch_size=6"], ("train.global_batch_size",),
     ["train.global_batch_size=12"], CPU),
    ("TRAIN-INTERVALS", ["train.eval_interval=0"], ("train.eval_interval",),
     ["train.eval_interval=5"], CPU),
    ("TRAIN-SAVE-NEEDS-DIR", ["checkpoint.save_interval=10"], ("checkpoint.save",),
     ["checkpoint.save_interval=10", "checkpoint.save=/tmp/ckpt"], CPU),
    ("SCHED-WARMUP", ["optimizer.decay_iters=1000", "optimizer.warmup_iters=200"],
     ("optimizer.warmup_iters",), ["optimizer.decay_iters=1000", "optimizer.warmup_iters=100"],
     CPU),
    ("SCHED-OVERRIDE-OR-CHECKPOINT", ["optimizer.override_opt_param_scheduler=true", "checkpoint.save=/tmp/ckpt",
                                      "optimizer.use_checkpoint_opt_param_scheduler=true"],
     ("optimizer.override_opt_param_scheduler",),
     ["optimizer.override_opt_param_scheduler=true", "checkpoint.save=/tmp/ckpt"], CPU),
    ("SCHED-WARMUP-DECAY", ["optimizer.decay_iters=20", "optimizer.warmup_iters=30"],
     ("optimizer.warmup_iters", "optimizer.decay_iters"),
     ["optimizer.decay_iters=20", "optimizer.warmup_iters=19"], CPU),
    ("CKPT-SHARDING-TYPE", ["checkpoint.sharding_type=dp"], ("checkpoint.sharding_type",),
     ["checkpoint.sharding_type=fully_reshardable"], CPU),
    ("TRAIN-ON-NONFINITE", ["train.on_nonfinite=ignore"], ("train.on_nonfinite",),
     ["train.on_nonfinite=skip"], CPU),
    ("TRAIN-ANOMALY-VS-NONFINITE", ["train.on_nonfinite=skip", "train.on_anomaly=stop"],
     ("train.on_anomaly", "train.on_nonfinite"), ["train.on_nonfinite=skip", "train.on_anomaly=skip_batch"],
     CPU),
    ("TRAIN-ROLLBACK-NEEDS-CHECKPOINTS", ["train.on_anomaly=rollback"], ("train.on_anomaly",),
     ["train.on_anomaly=rollback", "checkpoint.save=/tmp/ckpt", "checkpoint.save_interval=5"], CPU),
    ("DEBUG-NAN-MODULE", ["debug.nan_sample=3"], ("debug.nan_sample", "debug.nan_module"),
     ["debug.nan_sample=3", "debug.nan_module=layers.0.mlp.linear_fc2"], CPU),
    ("TRAIN-CHOICES", ["train.on_anomaly=retry"], ("train.on_anomaly",),
     ["train.on_anomaly=skip_batch"], CPU),
    ("TRAIN-EXIT-DURATION", ["train.exit_duration_mins=0"], ("train.exit_duration_mins",),
     ["train.exit_duration_mins=0.5"], CPU),
    ("CKPT-ASYNC-SAVE", ["checkpoint.async_save=true"], ("checkpoint.async_save",),
     ["checkpoint.async_save=false"], CPU),
    ("CKPT-INIT-FROM-HF-LOAD", ["checkpoint.init_from_hf=hf", "checkpoint.load=ckpt"],
     ("checkpoint.init_from_hf",), ["checkpoint.init_from_hf=hf"], CPU),
    ("PREC-CHOICES", [E4M3, "precision.fp8_recipe=mxfp88"], ("precision.fp8_recipe",),
     [E4M3, MXFP8], CPU),
    ("OPT-CHOICES", ["optimizer.name=adam"], ("optimizer.name",), [MUON], CPU),
    ("MOE-CHOICES", [MOE, "model.moe.score_function=sparsemax"], ("model.moe.score_function",),
     [MOE, "model.moe.score_function=sqrtsoftplus"], CPU),
    ("RUN-CHOICES", ["run.device=gpu"], ("run.device",), ["run.device=cpu"], CPU),
    ("MODEL-CHOICES", ["model.recompute_granularity=full", "model.recompute_method=blocks"],
     ("model.recompute_method",), ["model.recompute_granularity=full", "model.recompute_method=block"],
     CPU),
    ("DDP-CHOICES", ["ddp.data_parallel_sharding_strategy=zero3"],
     ("ddp.data_parallel_sharding_strategy",), ["ddp.data_parallel_sharding_strategy=optim_grads"],
     CPU),
    ("OPT-VALUES", ["optimizer.adam_beta2=1.0"], ("optimizer.adam_beta2",),
     ["optimizer.adam_beta2=0.999"], CPU),
    ("OPT-LAYERWISE-NEEDS-MUON", ["optimizer.use_layer_wise_optimizer=true"],
     ("optimizer.use_layer_wise_optimizer",),
     ["optimizer.use_layer_wise_optimizer=true", MUON, DISTOPT], CPU),
    ("RANGE-FINITE", ["optimizer.lr=inf", "optimizer.weight_decay=1e400"],
     ("optimizer.lr", "optimizer.weight_decay"), ["optimizer.lr=0.001"], CPU),
    ("RANGE-MODEL", ["model.seq_length=0"], ("model.seq_length",), ["model.seq_length=1"], CPU),
    ("RANGE-TRAIN", ["train.micro_batch_size=0"], ("train.micro_batch_size",),
     ["train.micro_batch_size=2"], CPU),
    ("RANGE-DATA", ["data.split_valid_fraction=1.5"], ("data.split_valid_fraction",),
     ["data.split_valid_fraction=0.5"], CPU),
    ("RANGE-PRECISION", [E4M3, "precision.fp8_amax_history_len=0"],
     ("precision.fp8_amax_history_len",), [E4M3, "precision.fp8_amax_history_len=16"], CPU),
    ("DATA-UNREADABLE", ["data.source=/nonexistent/lptrain-ds"], ("data.source",),
     ["data.source=builtin:python-stdlib"], CPU),
    ("DATA-FITS-MODEL", ["model.vocab_size=257"], ("model.vocab_size",),
     ["model.vocab_size=258"], CPU),
    # Keys that would have no effect (rulesets/inert.py): the setting alone, then its context.
    ("MOE-EP-NEEDS-EXPERTS", ["model.moe.expert_model_parallel_size=2"],
     ("model.moe.expert_model_parallel_size",),
     [MOE, "model.moe.expert_model_parallel_size=2"], World(dp=2)),
    ("MOE-FFN-NEEDS-EXPERTS", ["model.moe.ffn_hidden_size=128"], ("model.moe.ffn_hidden_size",),
     [MOE, "model.moe.ffn_hidden_size=128"], CPU),
    ("INERT-MOE-DENSE", ["model.moe.z_loss_coeff=0.001"], ("model.moe.z_loss_coeff",),
     [MOE, "model.moe.z_loss_coeff=0.001"], CPU),
    ("INERT-MOE-LB-TYPE", [MOE, "model.moe.load_balancing_type=seq_aux_loss"],
     ("model.moe.load_balancing_type",),
     [MOE, "model.moe.load_balancing_type=seq_aux_loss", "model.moe.aux_loss_coeff=0.01"], CPU),
    ("INERT-MOE-AUX-COEFF", [MOE, "model.moe.load_balancing_type=none", "model.moe.aux_loss_coeff=0.01"],
     ("model.moe.aux_loss_coeff",), [MOE, "model.moe.aux_loss_coeff=0.01"], CPU),
    ("INERT-MOE-BIAS-RATE", [MOE, "model.moe.bias_update_rate=0.01"],
     ("model.moe.bias_update_rate",),
     [MOE, "model.moe.bias_update_rate=0.01", "model.moe.enable_expert_bias=true",
      "model.moe.score_function=sigmoid"], CPU),
    ("INERT-DENSE-FFN", [MOE, "model.moe.ffn_hidden_size=64", "model.ffn_hidden_size=512"],
     ("model.ffn_hidden_size",),
     [MOE, "model.moe.ffn_hidden_size=64", "model.ffn_hidden_size=512",
      "model.moe.moe_layer_freq=2"], CPU),
    ("INERT-FP8-RECIPE", [MXFP8], ("precision.fp8_recipe",), [MXFP8, E4M3], CPU),
    ("INERT-DELAYED-SCALING", [E4M3, TENSORWISE, "precision.fp8_margin=1"],
     ("precision.fp8_margin",), [E4M3, "precision.fp8_margin=1"], CPU),
    ("INERT-AMAX-EPSILON", [E4M3, "precision.amax_epsilon=1e-12"], ("precision.amax_epsilon",),
     [E4M3, TENSORWISE, "precision.amax_epsilon=1e-12"], CPU),
    ("INERT-NVFP4-KEYS", ["precision.nvfp4_rht=false"], ("precision.nvfp4_rht",),
     [FP4, "precision.nvfp4_rht=false"], CPU),
    ("INERT-BF16-LAYERS", ["precision.first_last_layers_bf16=true"],
     ("precision.first_last_layers_bf16",),
     [E4M3, TENSORWISE, "precision.first_last_layers_bf16=true"], CPU),
    ("INERT-BF16-LAYER-COUNTS", [E4M3, TENSORWISE, "precision.num_layers_at_start_in_bf16=0"],
     ("precision.num_layers_at_start_in_bf16",),
     [E4M3, TENSORWISE, "precision.num_layers_at_start_in_bf16=0",
      "precision.first_last_layers_bf16=true"], CPU),
    ("INERT-LAYERWISE-LAYOUT", [MUON, "optimizer.layer_wise_param_layout=padded"],
     ("optimizer.layer_wise_param_layout",),
     [MUON, DISTOPT, "optimizer.layer_wise_param_layout=padded"], CPU),
    ("INERT-MUON-KEYS", ["optimizer.muon.momentum=0.9"], ("optimizer.muon.momentum",),
     [MUON, "optimizer.muon.momentum=0.9"], CPU),
    ("INERT-ADAMW-KEYS", [MUON, LION, "optimizer.adam_beta2=0.99"], ("optimizer.adam_beta2",),
     [MUON, "optimizer.adam_beta2=0.99"], CPU),
    ("INERT-LION-KEYS", [MUON, "optimizer.lion_beta1=0.9"], ("optimizer.lion_beta1",),
     [MUON, LION, "optimizer.lion_beta1=0.9"], CPU),
    ("INERT-CONSTANT-LR", ["optimizer.lr_schedule=constant", "optimizer.decay_iters=50"],
     ("optimizer.decay_iters",), ["optimizer.lr_schedule=wsd", "optimizer.decay_iters=50"], CPU),
    ("INERT-BUILTIN-DATA", ["data.source=/nonexistent/lptrain-ds", "data.builtin_max_mb=8"],
     ("data.builtin_max_mb",), ["data.builtin_max_mb=8"], CPU_WITH_MISSING_DATA),
    ("INERT-DATA-SOURCE", ["data.paths=[/nonexistent/a]", "data.source=/nonexistent/b"],
     ("data.source",), ["data.paths=[/nonexistent/a]"], CPU_WITH_MISSING_DATA),
    ("INERT-DATA-WEIGHTS", ["data.weights=[2.0]"], ("data.weights",),
     ["data.paths=[/nonexistent/a,/nonexistent/b]", "data.weights=[2.0,1.0]"],
     CPU_WITH_MISSING_DATA),
    ("INERT-CKPT-NO-SAVE", ["checkpoint.keep_latest=3"], ("checkpoint.keep_latest",),
     ["checkpoint.keep_latest=3", "checkpoint.save=/tmp/ckpt"], CPU),
    ("INERT-CKPT-NO-RESUME", ["checkpoint.load_optimizer=false"], ("checkpoint.load_optimizer",),
     ["checkpoint.load_optimizer=false", "checkpoint.load=/tmp/ckpt"], CPU),
    ("INERT-RECOMPUTE-FULL", ["model.recompute_method=block"], ("model.recompute_method",),
     ["model.recompute_method=block", "model.recompute_granularity=full"], CPU),
    ("INERT-RECOMPUTE-SELECTIVE", ["model.recompute_modules=[mlp]"], ("model.recompute_modules",),
     ["model.recompute_modules=[mlp]", "model.recompute_granularity=selective"], CPU),
    ("RECOMPUTE-NUM-LAYERS", ["model.recompute_granularity=full", "model.recompute_num_layers=3"],
     ("model.recompute_num_layers",),
     ["model.recompute_granularity=full", "model.recompute_num_layers=2"], CPU),
    ("RECOMPUTE-MODULES", ["model.recompute_granularity=selective", "model.recompute_modules=[attn]"],
     ("model.recompute_modules",),
     ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn]"], CPU),
    ("INERT-WANDB-KEYS", ["logging.wandb_mode=online"], ("logging.wandb_mode",),
     ["logging.wandb_mode=online", "logging.wandb=true"], CPU),
    ("INERT-SPIKE-WINDOW", ["train.spike_window=50", "train.check_for_spiky_loss=false"],
     ("train.spike_window",),
     ["train.spike_window=50", "train.check_for_spiky_loss=false", "train.spike_zscore=6"], CPU),
    ("INERT-MAX-ROLLBACKS", ["train.max_rollbacks=5"], ("train.max_rollbacks",),
     ["train.max_rollbacks=5", "train.on_anomaly=rollback", "checkpoint.save=/tmp/ckpt",
      "checkpoint.save_interval=5"], CPU),
    ("INERT-DEBUG-NAN", ["debug.nan_tensor=output"], ("debug.nan_tensor",),
     ["debug.nan_tensor=output", "debug.nan_sample=3", "debug.nan_module=layers.0.mlp.linear_fc2"],
     CPU),
]


@pytest.mark.parametrize(("rule", "trigger", "keys", "neighbour", "world", "neighbour_world"),
                         [(*c, c[4]) if len(c) == 5 else c for c in CASES], ids=[c[0] for c in CASES])
def test_rule_fires_alone_and_neighbour_is_clean(
    rule: str, trigger: list[str], keys: tuple[str, ...], neighbour: list[str], world: World,
    neighbour_world: World,
) -> None:
    ignored = {"DATA-UNREADABLE"} if world is CPU_WITH_MISSING_DATA else set()
    found = [v for v in violations(trigger, world) if v.rule not in ignored]
    assert [v.rule for v in found] == [rule], [v.to_dict() for v in found]
    (v,) = found
    assert set(keys) <= set(v.keys), v.keys
    assert v.message and v.fix
    assert not PLACEHOLDER.search(v.message + v.fix), "unformatted placeholder"
    assert [v for v in violations(neighbour, neighbour_world) if v.rule not in ignored] == []


def test_every_rule_has_a_case() -> None:
    covered = {c[0] for c in CASES}
    derived = {r.id for r in all_rules() if r.severity == "derived"}
    assert covered | derived == set(rule_ids())
    assert len(rule_ids()) == len(set(rule_ids())), "duplicate rule id"
    assert not covered & derived


def test_derived_rule_is_applied_not_reported() -> None:
    cfg = compose(None, [MUON, DISTOPT])
    assert derive(cfg, CPU).optimizer.use_layer_wise_optimizer is True
    assert all(v.severity != "derived" for v in check(cfg, CPU))


def test_severities_and_keys_are_canonical() -> None:
    from lptrain.config.compose import all_keys

    valid = set(all_keys())
    for r in all_rules():
        assert r.severity in ("error", "warning", "derived")
        assert r.keys and set(r.keys) <= valid, (r.id, set(r.keys) - valid)
        assert r.condition and r.section


def test_many_violations_reported_together() -> None:
    found = violations([
        "precision.fp8_format=e4m3", "precision.fp4_format=e2m1",
        "ddp.overlap_param_gather=true", "model.num_attention_heads=3",
        "train.global_batch_size=6", "optimizer.warmup_iters=1000",
    ])
    ids = {v.rule for v in found}
    assert {"PREC-FP8-FP4-EXCLUSIVE", "DDP-OVERLAP-PG-NEEDS-DISTOPT",
            "DDP-OVERLAP-PG-NEEDS-OVERLAP-GR", "MODEL-HEADS", "BATCH-DIVISIBLE",
            "SCHED-WARMUP-DECAY"} <= ids
    # The warning for the same fault is folded into the error (it supersedes it).
    (warm,) = [v for v in found if v.rule == "SCHED-WARMUP-DECAY"]
    assert warm.severity == "error" and "SCHED-WARMUP" not in ids


@pytest.mark.parametrize(
    ("overrides", "layer", "keys"),
    [
        (["model.hidden_size=80", "model.num_attention_heads=5"], "hidden",
         {"model.hidden_size"}),
        (["model.num_query_groups=1", "model.num_attention_heads=8", "model.hidden_size=64"],
         "attention qkv output", {"model.num_query_groups"}),
        (["train.micro_batch_size=1", "model.seq_length=48", "train.global_batch_size=8"],
         "tokens per micro-batch", {"train.micro_batch_size", "model.seq_length"}),
        ([MOE, "model.moe.ffn_hidden_size=48"], "expert fc1", {"model.moe.ffn_hidden_size"}),
    ],
)
def test_gemm_align_names_layer_and_dim(overrides: list[str], layer: str, keys: set[str]) -> None:
    found = violations([E4M3, MXFP8, *overrides])
    (v,) = [v for v in found if v.rule == "PREC-GEMM-ALIGN"]
    assert layer in v.message and "multiple of 32" in v.message
    assert keys <= set(v.keys)
    # The same shapes are 16-aligned: tensorwise accepts them.
    assert not [v for v in violations([E4M3, "precision.fp8_recipe=tensorwise", *overrides])
                if v.rule == "PREC-GEMM-ALIGN"]


@pytest.mark.parametrize(
    ("overrides", "layer", "value"),
    [  # issue 48: TE's runtime shape checks, which Megatron+TE refuse at the first step
        (["model.hidden_size=4096", "model.num_attention_heads=32", "model.ffn_hidden_size=28736",
          "model.tensor_model_parallel_size=8", "model.seq_length=64"],
         "mlp fc1 output / fc2 input: model.ffn_hidden_size / tensor_model_parallel_size 8", 3592),
        (["model.hidden_size=4096", "model.num_attention_heads=32", "model.ffn_hidden_size=14336",
          "model.tensor_model_parallel_size=8", SP, "model.seq_length=8208"],
         "sequence-parallel local rows: seq_length / tensor_model_parallel_size 8", 1026),
    ],
    ids=["per-shard-ffn", "sp-local-rows"],
)
def test_gemm_align_judges_each_tensor_parallel_shard(overrides: list[str], layer: str, value: int) -> None:
    """Per-tensor FP8 (16-aligned): ffn 28736 is aligned as a whole tensor but its TP 8 shard
    (3592) is not; seq 8208 is aligned as tokens but each SP rank holds 1026 rows (TE wants a
    multiple of 8). The whole tensor, which is all the rule judged before, passes: the same
    shapes at TP 1 are accepted."""
    tensorwise = ["precision.fp8_format=hybrid", "precision.fp8_recipe=delayed"]
    (v,) = [v for v in violations([*tensorwise, *overrides]) if v.rule == "PREC-GEMM-ALIGN"]
    assert f"{layer} = {value}" in v.message, v.message
    assert "model.tensor_model_parallel_size" in v.keys
    whole = [o for o in overrides if not o.startswith(("model.tensor_model_parallel_size", SP))]
    assert not [v for v in violations([*tensorwise, *whole]) if v.rule == "PREC-GEMM-ALIGN"]


def test_gemm_align_ignored_without_quantization() -> None:
    assert violations(["model.ffn_hidden_size=100"]) == []


@pytest.mark.parametrize(
    ("override", "key"),
    [("optimizer.muon.ns_steps=0", "optimizer.muon.ns_steps"),
     ("optimizer.muon.coefficients=cubic", "optimizer.muon.coefficients"),
     ("optimizer.muon.scale_mode=rms", "optimizer.muon.scale_mode"),
     ("optimizer.lr=0", "optimizer.lr")],
)
def test_muon_hparams_each_key(override: str, key: str) -> None:
    found = violations([MUON, override, "optimizer.min_lr=0"])
    assert [(v.rule, v.keys) for v in found] == [("MUON-HPARAMS", (key,))]


def test_te_version_for_single_grouped_weight() -> None:
    world = World(dp=1, target="sm100", te_version="2.18", cuda=True, cuda_version="13.3")
    found = violations(["precision.backend=te", MOE, GROUPED, SGW], world)
    assert [v.rule for v in found] == ["PREC-TE-VERSION"]
    assert "model.moe.single_grouped_weight" in found[0].keys and "2.19" in found[0].fix
    assert "single_grouped_weight=false" in found[0].message


@pytest.mark.parametrize(("target", "cuda", "extra", "refused"), [
    ("sm100", "13.3", [], False),
    ("sm100", "13.2", [], True),  # cuBLASLt 13.3+
    ("sm90", "13.3", ["precision.fp8_format=null"], True),  # bf16 on Hopper: 13.4+
    ("sm90", "13.4", ["precision.fp8_format=null"], False),
    ("sm100", "13.3", ["precision.fp8_format=null", FP4, "precision.fp4_param_gather=true",
                       DISTOPT, "precision.nvfp4_rht=false"], True),  # NVFP4 only with RHT
    ("sm100", "13.3", ["precision.fp8_format=null", FP4, "precision.fp4_param_gather=true",
                       DISTOPT], False),
])
def test_single_grouped_weight_needs_tes_grouped_tensor_path(target: str, cuda: str, extra: list[str],
                                                             refused: bool) -> None:
    """Finding 4: TE 2.19 runs a single grouped weight only on its grouped-tensor path (and
    raises otherwise); the rule refuses exactly where TE's is_module_grouped_tensor_path_
    supported would say no, naming the TE and CUDA versions."""
    world = World(dp=1, target=target, te_version="2.19", cuda=True, cuda_version=cuda)
    found = [v for v in violations([TE, MOE, GROUPED, SGW, E4M3, MXFP8, "precision.params_dtype=bf16",
                                    *extra], world) if v.severity == "error"]
    rules = [v.rule for v in found]
    assert ("MOE-SGW-TE-GROUPED-PATH" in rules) == refused, rules
    if refused:
        v = next(v for v in found if v.rule == "MOE-SGW-TE-GROUPED-PATH")
        assert "2.19" in v.message and cuda in v.message and "single_grouped_weight=false" in v.fix


def test_backend_available_names_missing_te() -> None:
    world = World(dp=1, target="sm90", te_version=None, cuda=True)
    (v,) = violations(["precision.backend=te"], world)
    assert v.rule == "PREC-BACKEND-AVAILABLE" and "Transformer Engine" in v.message
    assert "pip install -e .[te]" in v.fix
