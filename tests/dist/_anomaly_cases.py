"""Rank-side function of the two-rank anomaly test (module level: it is pickled)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def nan_on_rank_one(rank: int, world: int, out: str, cache: str) -> dict[str, Any]:
    """A run at DP=2 whose NaN is in a sample rank 1 reads; returns what this rank saw."""
    from lptrain.config.compose import load
    from lptrain.train import TrainingDivergedError, pretrain

    cfg = load("mxfp8_adamw_cpu.yaml", [
        "logging.progress=false", "logging.plots=false", "data.builtin_max_mb=1",
        f"data.cache_dir={cache}", "train.global_batch_size=4", "train.micro_batch_size=2",
        "model.seq_length=64", "optimizer.warmup_iters=0", "train.eval_iters=0",
        "train.train_iters=3", "logging.numerics_interval=1", "checkpoint.save=null",
        # step 2 reads samples 4-7: rank 0 holds 4-5, rank 1 holds 6-7
        "debug.nan_sample=7", "debug.nan_module=layers.0.mlp.linear_fc1"]).cfg
    try:
        pretrain(cfg, Path(out))
    except TrainingDivergedError as e:
        error = str(e)
    else:
        error = ""
    got: dict[str, Any] = {"error": error}
    if rank == 0:
        got["anomaly"] = json.loads((Path(out) / "anomalies.jsonl").read_text().splitlines()[0])
        got["step1"] = json.loads((Path(out) / "metrics.jsonl").read_text().splitlines()[0])
    return got
