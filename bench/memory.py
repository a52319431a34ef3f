"""The largest dense model that fits one 80 GB GPU at 64 GPUs, per sharding strategy and
recompute setting (the table in docs/memory.md).

For Llama-shaped dense models from 8B to 405B parameters (bf16 params, fp32 grads and AdamW
state, sequence 4096, one micro-batch of one sequence, the ``bf16_adamw.yaml`` recipe on
sm90), the memory planner (:func:`lptrain.memory.plan.estimate_memory`, the engine's own
layout on a meta-device model) gives the most loaded rank's bytes at data-parallel size 64
for each ``ddp.data_parallel_sharding_strategy`` x ``model.recompute_granularity``. Sizes are
tried smallest first; the first that does not fit ends that row. An analytic table, not a
timing: nothing here depends on the machine.

    .venv/bin/python bench/memory.py [--dp 64] [--gpu-memory 80]
"""

from __future__ import annotations

import argparse
from typing import Any

GIB = 1024**3
# name: (layers, hidden, heads, KV groups, SwiGLU width)
SHAPES = {
    "8B": (32, 4096, 32, 8, 14336),
    "13B": (40, 5120, 40, 8, 13824),
    "34B": (48, 8192, 64, 8, 22016),
    "70B": (80, 8192, 64, 8, 28672),
    "123B": (88, 12288, 96, 8, 28672),
    "175B": (96, 12288, 96, 8, 49152),
    "405B": (126, 16384, 128, 8, 53248),
}
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
RECOMPUTE = {
    "none": [],
    "selective": ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn,mlp_act]"],
    "full": ["model.recompute_granularity=full"],
}


def overrides(shape: tuple[int, ...], strategy: str, recompute: list[str]) -> list[str]:
    layers, hidden, heads, groups, ffn = shape
    return [f"model.num_layers={layers}", f"model.hidden_size={hidden}",
            f"model.num_attention_heads={heads}", f"model.num_query_groups={groups}",
            f"model.ffn_hidden_size={ffn}", "model.vocab_size=128256", "model.seq_length=4096",
            "train.micro_batch_size=1", f"ddp.data_parallel_sharding_strategy={strategy}", *recompute]


def estimate(shape: tuple[int, ...], strategy: str, recompute: list[str], dp: int) -> tuple[int, int]:
    """(params, the most loaded rank's bytes)."""
    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.memory.plan import estimate_memory

    cfg = derive(load("bf16_adamw.yaml", overrides(shape, strategy, recompute)).cfg,
                 World.detect(dp=dp, target="sm90"))
    est = estimate_memory(cfg, dp, "sm90")
    return est.params, est.worst.total


def main() -> None:
    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=64)
    ap.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU")
    args = ap.parse_args()
    budget = args.gpu_memory * GIB
    rows: dict[tuple[str, str], Any] = {}
    combos = [(s, r) for s in STRATEGIES for r in RECOMPUTE]
    for strategy, rc in track(combos, description="planning"):
        best, first_miss = None, None
        for name, shape in SHAPES.items():
            params, total = estimate(shape, strategy, RECOMPUTE[rc], args.dp)
            if total > budget:
                first_miss = (name, params, total)
                break
            best = (name, params, total)
        rows[(strategy, rc)] = (best, first_miss)
    table = Table(title=f"Largest dense model per {args.gpu_memory:.0f} GiB GPU at DP={args.dp} "
                        "(bf16 AdamW, seq 4096, micro-batch 1)")
    for col in ("strategy", "recompute", "largest that fits", "GiB/rank", "next size", "GiB/rank "):
        table.add_column(col)
    for (strategy, rc), (best, miss) in rows.items():
        b = (f"{best[0]} ({best[1] / 1e9:.1f}B)", f"{best[2] / GIB:.1f}") if best else ("none", "")
        m = (f"{miss[0]} ({miss[1] / 1e9:.1f}B)", f"{miss[2] / GIB:.1f}") if miss else ("(all fit)", "")
        table.add_row(strategy, rc, *b, *m)
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
