"""Rank-side functions for the data-parallel engine tests (module-level: they are pickled).

Each function runs several configurations inside ONE spawned world (process start-up costs
seconds on this machine, a tiny training step milliseconds) and returns plain results; the
parent test compares them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lptrain.testing.parity import train_steps

TINY = "tiny_cpu.yaml"
BASE = [
    "data.builtin_max_mb=1",
    "train.eval_iters=1",
    "logging.progress=false",
    "optimizer.warmup_iters=0",
    "optimizer.lr=0.01",  # large enough to amplify any mismatch
]
DISTOPT = ["ddp.use_distributed_optimizer=true"]
OVERLAP = ["ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true", "ddp.bucket_size=20000"]
NO_OVERLAP = ["ddp.bucket_size=20000"]
MOE = [
    "model.moe.num_experts=4",
    "model.moe.router_topk=2",
    "model.moe.ffn_hidden_size=64",
    "model.moe.grouped_gemm=true",
]
EMU = ["precision.backend=emulated"]
TENSORWISE = [*EMU, "precision.fp8_format=e4m3", "precision.fp8_recipe=tensorwise"]
BLOCKWISE = [*EMU, "precision.fp8_format=e4m3", "precision.fp8_recipe=blockwise"]
MXFP8 = [*EMU, "precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8"]
DELAYED = [*EMU, "precision.fp8_format=hybrid", "precision.fp8_recipe=delayed", "precision.fp8_amax_history_len=16"]
NVFP4 = [*EMU, "precision.fp4_format=e2m1", "precision.fp4_recipe=nvfp4"]
FP8_PG = ["precision.fp8_param_gather=true"]
FP4_PG = ["precision.fp4_param_gather=true"]
REUSE = ["ddp.reuse_grad_buf_for_mxfp8_param_ag=true"]


def run_cases(
    rank: int, world: int, cases: dict[str, Sequence[str]], steps: int = 3, **kw: Any
) -> dict[str, dict[str, Any]]:
    """``{case: train_steps(...)}`` for every case (overrides appended to BASE)."""
    return {
        name: train_steps(TINY, [*BASE, *ov], steps=steps, **kw) for name, ov in cases.items()
    }


def run_case_variants(
    rank: int, world: int, overrides: Sequence[str], variants: dict[str, dict[str, Any]], steps: int = 3
) -> dict[str, dict[str, Any]]:
    """Same config, different ``train_steps`` keyword arguments (eval_every, sync_after...)."""
    return {
        name: train_steps(TINY, [*BASE, *overrides], steps=steps, **kw) for name, kw in variants.items()
    }
