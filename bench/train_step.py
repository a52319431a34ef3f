"""The whole training step as the trainer runs it vs a plain PyTorch loop, at DP=1.

lptrain: ``TrainEngine.train_step`` on batches from lptrain's loader (forward, backward into
the fp32 grad buffer, NaN check, grad norm and clip, AdamW on fp32 masters, masters written
back into the bf16 params). Baseline, measured in the same run on the same model and
batches: ``loss.backward(); torch.optim.AdamW.step(); zero_grad()`` on the bf16 params.
Steps alternate between the two so machine-load drift hits both alike; the rounds repeat
until each ratio's median is known within ``--spread`` or ``--cap`` seconds pass per shape
(``bench/harness.py``; REGRESSED against ``bench/baseline.json``).
Target: lptrain at most 1.10x the plain loop, at tiny_cpu's shape and at 4 layers, hidden
256, seq 256.

    .venv/bin/python bench/train_step.py [--cap 40] [--threads 1] [--save-baseline]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
from harness import Figure, Ratio, add_args, report, rounds
from rich.console import Console

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


def _bench(name: str, overrides: list[str], args: Any) -> tuple[Figure, float, float]:
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
    step = [0]

    def lptrain_step() -> None:
        step[0] += 1
        engine.train_step([next(train_it) for _ in range(n)], step[0])

    def plain_step() -> None:
        for _ in range(n):
            b = next(train_it)
            loss, _ = plain_model(b["tokens"], labels=b["labels"])
            (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    r = rounds(args, [Ratio(name, "lptrain", "plain", TARGET)])
    r.run({"lptrain": lptrain_step, "plain": plain_step}, warmup=3)
    tokens = t.global_batch_size * cfg.model.seq_length
    return (r.figures()[0], tokens / statistics.median(r.series["lptrain"]),
            tokens / statistics.median(r.series["plain"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    add_args(ap, cap_s=40.0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    figures, lines = [], []
    for name, ov in SHAPES.items():
        fig, ours, theirs = _bench(name, ov, args)
        figures.append(fig)
        lines.append(f"{name}: lptrain {ours:,.0f} tokens/s, plain {theirs:,.0f} tokens/s, {len(fig.samples)} rounds")
    report(Console(width=120), "train_step", f"training step vs plain PyTorch loop (DP=1, {args.threads} thread(s))",
           figures, args, "\n".join(lines))


if __name__ == "__main__":
    main()
