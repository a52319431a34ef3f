"""Data-parallel engine rules: overlap, partial sharding, buckets."""

from __future__ import annotations

from lptrain.config.rules import Rule

S = "Data-parallel engine"

RULES = [
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
        keys=("ddp.num_distributed_optimizer_instances",),
        when=lambda c, w: c.ddp.num_distributed_optimizer_instances < 1
             or w.dp % c.ddp.num_distributed_optimizer_instances != 0,
        message="num_distributed_optimizer_instances={cfg.ddp.num_distributed_optimizer_instances} "
                "must be >= 1 and divide the data-parallel size {world.dp}",
        fix="set ddp.num_distributed_optimizer_instances to a divisor of {world.dp} (1 = full "
            "sharding)",
        condition="dp % num_distributed_optimizer_instances == 0", section=S,
    ),
    Rule(
        id="DDP-BUCKET-SIZE", severity="error", keys=("ddp.bucket_size",),
        when=lambda c, w: c.ddp.bucket_size is not None and c.ddp.bucket_size <= 0,
        message="bucket_size={cfg.ddp.bucket_size} must be a positive number of elements",
        fix="set ddp.bucket_size=null (derived: max(40M, 1M * dp)) or a positive value",
        condition="bucket_size, when set, > 0", section=S,
    ),
]
