"""Data-parallel engine rules: overlap, partial sharding, buckets."""

from __future__ import annotations

from typing import Any

from lptrain.config.rules import Rule, padded_layout
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World

S = "Data-parallel engine"

SHARDS_GRADS = ("optim_grads", "optim_grads_params")


def shards_grads(c) -> bool:  # type: ignore[no-untyped-def]
    return c.ddp.data_parallel_sharding_strategy in SHARDS_GRADS


def _instances_bad(c: LPTrainConfig, w: World) -> Any:
    """An instance count that does not split the data x context parallel ranks."""
    cp = max(1, c.model.context_parallel_size)
    n, k = w.dp * cp, c.ddp.num_distributed_optimizer_instances
    if k >= 1 and n % k == 0:
        return False
    return {"n": n, "what": "data x context parallel" if cp > 1 else "data-parallel"}


RULES = [
    Rule(
        id="DDP-SHARDING-STRATEGY", severity="derived",
        keys=("ddp.data_parallel_sharding_strategy", "ddp.use_distributed_optimizer"),
        when=lambda c, w: False,
        message="the sharding strategy and use_distributed_optimizer are one setting",
        fix="nothing to do: derive() fills in the one that is not set",
        condition="data_parallel_sharding_strategy=null -> optim if use_distributed_optimizer "
                  "else no_shard; optim, optim_grads or optim_grads_params -> "
                  "use_distributed_optimizer=true",
        why="every optim* strategy is a distributed optimizer that shards more", section=S,
    ),
    Rule(
        id="DDP-NO-SHARD-WITH-DISTOPT", severity="error",
        keys=("ddp.data_parallel_sharding_strategy", "ddp.use_distributed_optimizer"),
        when=lambda c, w: c.ddp.data_parallel_sharding_strategy == "no_shard"
             and c.ddp.use_distributed_optimizer,
        message="data_parallel_sharding_strategy=no_shard contradicts "
                "use_distributed_optimizer=true (which shards the optimizer state)",
        fix="set ddp.data_parallel_sharding_strategy=optim (or null), or "
            "ddp.use_distributed_optimizer=false",
        condition="strategy no_shard -> not use_distributed_optimizer", section=S,
    ),
    Rule(
        id="DDP-SHARDED-GRADS-NO-GRAD-BUF-REUSE", severity="error",
        keys=("ddp.data_parallel_sharding_strategy", "ddp.reuse_grad_buf_for_mxfp8_param_ag"),
        when=lambda c, w: shards_grads(c) and c.ddp.reuse_grad_buf_for_mxfp8_param_ag,
        message="reuse_grad_buf_for_mxfp8_param_ag stages the param gather in the whole grad "
                "buffer, which data_parallel_sharding_strategy="
                "{cfg.ddp.data_parallel_sharding_strategy} releases after each bucket's "
                "reduce-scatter",
        fix="set ddp.reuse_grad_buf_for_mxfp8_param_ag=false (sharded grads already free the "
            "memory it saves), or ddp.data_parallel_sharding_strategy=optim",
        condition="strategy optim_grads* -> not reuse_grad_buf_for_mxfp8_param_ag",
        why="the reused buffer no longer exists between buckets", section=S,
    ),
    Rule(
        id="DDP-SHARDED-PARAMS-TE-BYTES", severity="error",
        keys=("ddp.data_parallel_sharding_strategy", "precision.backend", "precision.fp8_recipe",
              "precision.fp8_param_gather"),
        when=lambda c, w: c.ddp.data_parallel_sharding_strategy == "optim_grads_params"
             and c.precision.backend == "te" and c.precision.fp8_param_gather
             and c.precision.fp8_format is not None
             and c.precision.fp8_recipe in ("tensorwise", "blockwise"),
        message="data_parallel_sharding_strategy=optim_grads_params with Transformer Engine "
                "{cfg.precision.fp8_recipe} FP8 primary weights: TE casts the masters into each "
                "weight's whole byte buffer, which sharded params free between uses",
        fix="set precision.backend=emulated, ddp.data_parallel_sharding_strategy=optim_grads, or "
            "precision.fp8_param_gather=false (bf16 primaries, quantized in the forward)",
        condition="strategy optim_grads_params and backend te and fp8_param_gather -> recipe not "
                  "tensorwise/blockwise",
        why="TE's cast_master_weights_to_fp8 writes into the full weight", section=S,
    ),
    Rule(
        id="DDP-SHARDED-GRADS-NOT-MUON", severity="error",
        keys=("ddp.data_parallel_sharding_strategy", "optimizer.name",
              "optimizer.layer_wise_param_layout"),
        when=lambda c, w: shards_grads(c) and c.optimizer.name == "muon" and not padded_layout(c),
        message="data_parallel_sharding_strategy={cfg.ddp.data_parallel_sharding_strategy} with "
                "Muon needs the padded layer-wise layout (layer_wise_param_layout="
                "{cfg.optimizer.layer_wise_param_layout}): the compact layout all-reduces every "
                "Muon gradient whole and gathers the owners' updates unevenly, so there is no "
                "equal per-rank shard to keep",
        fix="set optimizer.layer_wise_param_layout=padded (each matrix inside its owner's "
            "shard), or ddp.data_parallel_sharding_strategy=optim",
        condition="strategy optim_grads* and optimizer.name=muon -> padded layer-wise layout",
        why="Newton-Schulz needs each matrix's whole gradient and value on its owner; only the "
            "padded layout puts whole matrices inside the equal DP shards",
        section=S,
    ),
    Rule(
        id="DDP-OVERLAP-PG-NEEDS-DISTOPT", severity="error",
        keys=("ddp.overlap_param_gather", "ddp.use_distributed_optimizer"),
        when=lambda c, w: c.ddp.overlap_param_gather and not c.ddp.use_distributed_optimizer,
        message="overlap_param_gather=true without a distributed optimizer: only a sharded "
                "optimizer has a parameter all-gather to overlap",
        fix="set ddp.use_distributed_optimizer=true, or ddp.overlap_param_gather=false",
        condition="overlap_param_gather -> use_distributed_optimizer",
        why="only a sharded optimizer has a parameter all-gather to overlap", section=S,
    ),
    Rule(
        id="DDP-OVERLAP-PG-NEEDS-OVERLAP-GR", severity="error",
        keys=("ddp.overlap_param_gather", "ddp.overlap_grad_reduce"),
        when=lambda c, w: c.ddp.overlap_param_gather and not c.ddp.overlap_grad_reduce,
        message="overlap_param_gather=true needs overlap_grad_reduce=true: without it there is a "
                "single bucket and nothing to pipeline",
        fix="set ddp.overlap_grad_reduce=true, or ddp.overlap_param_gather=false",
        condition="overlap_param_gather -> overlap_grad_reduce",
        why="without it there is one bucket and nothing to pipeline", section=S,
    ),
    Rule(
        id="DDP-INSTANCES-NEED-DISTOPT", severity="error",
        keys=("ddp.num_distributed_optimizer_instances", "ddp.use_distributed_optimizer"),
        when=lambda c, w: c.ddp.num_distributed_optimizer_instances > 1
             and not c.ddp.use_distributed_optimizer,
        message="num_distributed_optimizer_instances={cfg.ddp.num_distributed_optimizer_instances} "
                "without a distributed optimizer: partial sharding without sharding is meaningless",
        fix="set ddp.use_distributed_optimizer=true, or ddp.num_distributed_optimizer_instances=1",
        condition="num_distributed_optimizer_instances > 1 -> use_distributed_optimizer",
        why="partial sharding without sharding is meaningless", section=S,
    ),
    Rule(
        id="DDP-INSTANCES-DIVIDE-DP", severity="error",
        keys=("ddp.num_distributed_optimizer_instances", "model.context_parallel_size"),
        when=_instances_bad,
        message="num_distributed_optimizer_instances={cfg.ddp.num_distributed_optimizer_instances} "
                "must be >= 1 and divide the {what} size {n} (Megatron-LM: 'Data parallel size "
                "should be divisible by partial DistOpt shard factor')",
        fix="set ddp.num_distributed_optimizer_instances to a divisor of {n} (1 = full "
            "sharding)",
        condition="(dp x context_parallel_size) % num_distributed_optimizer_instances == 0 (the "
                  "distributed optimizer shards over data x context parallel)",
        why="an instance is a block of the data x context parallel ranks, as Megatron-LM's "
            "intra-instance groups", section=S,
    ),
    Rule(
        id="DDP-BUCKET-SIZE", severity="error", keys=("ddp.bucket_size",),
        when=lambda c, w: c.ddp.bucket_size is not None and c.ddp.bucket_size <= 0,
        message="bucket_size={cfg.ddp.bucket_size} must be a positive number of elements",
        fix="set ddp.bucket_size=null (derived: max(40M, 1M * dp)) or a positive value",
        condition="bucket_size, when set, > 0", section=S,
    ),
]
