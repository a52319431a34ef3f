"""The cost of the per-layer quantization statistics (``logging.numerics_interval``).

Per quantized ``*_cpu`` recipe, the engine's whole training step is timed with the statistics
collected (what every ``numerics_interval``-th step does: every GEMM operand's statistics on
the device, one read at the end, the merge) and without them (every other step), alternating
in each round on the same engine and the same kind of batches. From the per-round ratio
``R = step with statistics / step without``:

* ``interval 1``: ``R`` (every step collects);
* ``interval 100``: ``(R + 99) / 100``, the mean step time over 100 steps, one of which
  collects. Target: at most 1.05 (5% overhead).

Steps between intervals pay one ``active()`` check per GEMM and no host sync (counted in
``tests/unit/train/test_numerics_collection.py`` on the virtual GPU, not timed here).

    .venv/bin/python bench/numerics.py [--cap 40] [--recipes fp8_delayed_cpu,nvfp4_adamw_cpu] [--save-baseline]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from harness import Figure, Ratio, add_args, report, rounds
from rich.console import Console
from workload import train_batches

from lptrain.config import World, derive
from lptrain.config.compose import load
from lptrain.train.engine import TrainEngine

TARGET_100 = 1.05
RECIPES = ("fp8_delayed_cpu", "mxfp8_adamw_cpu", "nvfp4_adamw_cpu")
COMMON = ["data.builtin_max_mb=2", "logging.progress=false", "checkpoint.save=null"]


def _bench(recipe: str, args: Any) -> list[Figure]:
    cfg = derive(load(f"{recipe}.yaml", COMMON).cfg, World.detect())
    engine = TrainEngine(cfg)
    it, n = train_batches(cfg)
    step = [0]

    def run(numerics: bool) -> None:
        step[0] += 1
        engine.train_step([next(it) for _ in range(n)], step[0], numerics=numerics)

    r = rounds(args, [Ratio(f"{recipe}: interval 1 vs off", "stats", "plain")])
    r.run({"plain": lambda: run(False), "stats": lambda: run(True)}, warmup=2)
    (f1,) = r.figures()
    per_100 = [(x + 99.0) / 100.0 for x in f1.samples]
    return [f1, Figure(f"{recipe}: interval 100 vs off", per_100, TARGET_100,
                       minmin=(f1.minmin + 99.0) / 100.0 if f1.minmin is not None else None)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(ap, cap_s=40.0)
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated *_cpu recipes")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    figures: list[Figure] = []
    for recipe in args.recipes.split(","):
        figures += _bench(recipe, args)
    ok = report(Console(), "numerics", "quantization statistics: step time with vs without",
                figures, args)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
