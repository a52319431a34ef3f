"""The whole training step as the trainer runs it vs a plain PyTorch loop, at DP=1.

lptrain: ``TrainEngine.train_step`` on batches from lptrain's loader (forward, backward into
the fp32 grad buffer, NaN check, grad norm and clip, AdamW on fp32 masters, masters written
back into the bf16 params). Baseline, measured in the same run on the same model and
batches: ``loss.backward(); torch.optim.AdamW.step(); zero_grad()`` on the bf16 params.
Steps alternate between the two so machine-load drift hits both alike; medians are reported.
Target: lptrain at most 1.10x the plain loop, at tiny_cpu's shape and at 4 layers, hidden
256, seq 256.

    .venv/bin/python bench/train_step.py [--steps 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from lptrain.config import World, derive
from lptrain.config.compose import load
from lptrain.data import build_train_valid_loaders
from lptrain.model import build_model
from lptrain.train.engine import TrainEngine

TARGET = 1.10
SHAPES = {
    "tiny_cpu": [],
    "4x256, seq 256": [
        "model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4",
        "model.seq_length=256",
    ],
}
COMMON = ["data.builtin_max_mb=2", "logging.progress=false", "checkpoint.save=null",
          "train.global_batch_size=8", "train.micro_batch_size=4"]


def _bench(name: str, overrides: list[str], steps: int) -> tuple[float, float, float]:
    cfg = derive(load("tiny_cpu.yaml", [*COMMON, *overrides]).cfg, World.detect())
    engine = TrainEngine(cfg)
    plain_model = build_model(cfg)  # same layers and init (seeded by name), no engine
    opt = torch.optim.AdamW(plain_model.parameters(), lr=cfg.optimizer.lr, foreach=True)
    t = cfg.train
    train_it, _ = build_train_valid_loaders(
        cfg.data, seq_length=cfg.model.seq_length, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size, dp_rank=0, dp_size=1, vocab_size=cfg.model.vocab_size,
    )
    n = t.global_batch_size // t.micro_batch_size

    def lptrain_step(step: int) -> None:
        engine.train_step([next(train_it) for _ in range(n)], step)

    def plain_step(step: int) -> None:
        for _ in range(n):
            b = next(train_it)
            loss, _ = plain_model(b["tokens"], labels=b["labels"])
            (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ours, theirs = [], []
    for step in range(1, steps + 4):
        for fn, acc in ((lptrain_step, ours), (plain_step, theirs)):
            t0 = time.perf_counter()
            fn(step)
            if step > 3:  # warm-up
                acc.append(time.perf_counter() - t0)
    tokens = t.global_batch_size * cfg.model.seq_length
    a, b = statistics.median(ours), statistics.median(theirs)
    return tokens / a, tokens / b, a / b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    table = Table(title=f"training step vs plain PyTorch loop (DP=1, target <= {TARGET:.2f}x)")
    for col in ("shape", "lptrain tokens/s", "plain tokens/s", "ratio", "result"):
        table.add_column(col)
    ok = True
    for name, ov in SHAPES.items():
        ours, theirs, ratio = _bench(name, ov, args.steps)
        passed = ratio <= TARGET
        ok &= passed
        table.add_row(name, f"{ours:,.0f}", f"{theirs:,.0f}", f"{ratio:.2f}x", "PASS" if passed else "FAIL")
    console = Console()
    console.print(table)
    console.print(f"overall: {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
