"""Data-parallel engine rules: overlap, partial sharding, buckets."""

from __future__ import annotations

from lptrain.config.rules import Rule

S = "Data-parallel engine"

RULES = [
    Rule(
        "DDP-OVERLAP-PG-NEEDS-DISTOPT", "error",
        ("ddp.overlap_param_gather", "ddp.use_distributed_optimizer"),
        lambda c, w: c.ddp.overlap_param_gather and not c.ddp.use_distributed_optimizer,
        "overlap_param_gather=true without a distributed optimizer: only a sharded optimizer has "
        "a parameter all-gather to overlap",
        "set ddp.use_distributed_optimizer=true, or ddp.overlap_param_gather=false",
        "overlap_param_gather -> use_distributed_optimizer",
        "only a sharded optimizer has a parameter all-gather to overlap", S),
    Rule(
        "DDP-OVERLAP-PG-NEEDS-OVERLAP-GR", "error",
        ("ddp.overlap_param_gather", "ddp.overlap_grad_reduce"),
        lambda c, w: c.ddp.overlap_param_gather and not c.ddp.overlap_grad_reduce,
        "overlap_param_gather=true needs overlap_grad_reduce=true: without it there is a single "
        "bucket and nothing to pipeline",
        "set ddp.overlap_grad_reduce=true, or ddp.overlap_param_gather=false",
        "overlap_param_gather -> overlap_grad_reduce",
        "without it there is one bucket and nothing to pipeline", S),
    Rule(
        "DDP-INSTANCES-NEED-DISTOPT", "error",
        ("ddp.num_distributed_optimizer_instances", "ddp.use_distributed_optimizer"),
        lambda c, w: c.ddp.num_distributed_optimizer_instances > 1
        and not c.ddp.use_distributed_optimizer,
        "num_distributed_optimizer_instances={cfg.ddp.num_distributed_optimizer_instances} "
        "without a distributed optimizer: partial sharding without sharding is meaningless",
        "set ddp.use_distributed_optimizer=true, or ddp.num_distributed_optimizer_instances=1",
        "num_distributed_optimizer_instances > 1 -> use_distributed_optimizer",
        "partial sharding without sharding is meaningless", S),
    Rule(
        "DDP-INSTANCES-DIVIDE-DP", "error", ("ddp.num_distributed_optimizer_instances",),
        lambda c, w: c.ddp.num_distributed_optimizer_instances < 1
        or w.dp % c.ddp.num_distributed_optimizer_instances != 0,
        "num_distributed_optimizer_instances={cfg.ddp.num_distributed_optimizer_instances} must "
        "be >= 1 and divide the data-parallel size {world.dp}",
        "set ddp.num_distributed_optimizer_instances to a divisor of {world.dp} (1 = full sharding)",
        "dp % num_distributed_optimizer_instances == 0", "", S),
    Rule(
        "DDP-BUCKET-SIZE", "error", ("ddp.bucket_size",),
        lambda c, w: c.ddp.bucket_size is not None and c.ddp.bucket_size <= 0,
        "bucket_size={cfg.ddp.bucket_size} must be a positive number of elements",
        "set ddp.bucket_size=null (derived: max(40M, 1M * dp)) or a positive value",
        "bucket_size, when set, > 0", "", S),
]
