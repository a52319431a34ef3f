"""The shipped Muon recipe against the shipped AdamW recipe: final validation loss and steps to
reach AdamW's final loss.

Not a test: trains ``mxfp8_muon_cpu.yaml`` (MXFP8 emulated, Muon + AdamW, spectral scaling)
and ``tiny_cpu.yaml`` (bf16, AdamW) for the same number of steps on the same data (same
model shape, batch, seed and corpus; checked before training) through
``lptrain.train.pretrain``, reading the per-step ``val_loss`` from each run's
``metrics.jsonl``. Reports each final validation loss, their ratio, and the first evaluation
step at which Muon's validation loss is at or below AdamW's final one, as a fraction of the
steps. Targets (issue "Muon at scale"): Muon's final loss lower, and AdamW's final loss
reached in at most 70% of the steps. Validation batches differ from one evaluation to the
next (the trainer keeps drawing from its validation stream), but both runs draw the same
sequence, so the k-th evaluations of the two runs see the same tokens.

The figures are losses and step counts of seeded runs, deterministic on one machine, so one
run is the measurement (no repeats, no spread); they go through ``bench/harness.py`` like
every other bench, so a move of more than 25% against ``bench/baseline.json`` reads
REGRESSED. The two wall times are printed for information only (one sample each).

    .venv/bin/python bench/muon_vs_adamw.py [--steps 240] [--eval-interval 20] [--eval-iters 8]
        [--save-baseline]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
from harness import Figure, add_args, report
from rich.console import Console
from rich.table import Table

from lptrain.config.compose import load
from lptrain.config.schema import LPTrainConfig
from lptrain.train import pretrain

MUON_RECIPE = "mxfp8_muon_cpu.yaml"
ADAMW_RECIPE = "tiny_cpu.yaml"
REACH_TARGET = 0.70  # Muon reaches AdamW's final loss within this fraction of the steps


def _same_data(a: LPTrainConfig, b: LPTrainConfig) -> list[str]:
    """Settings that must agree for "same steps and data"; returns the ones that differ."""
    pairs = {
        "data": (a.data, b.data),
        "train.seed": (a.train.seed, b.train.seed),
        "train.train_iters": (a.train.train_iters, b.train.train_iters),
        "train.micro_batch_size": (a.train.micro_batch_size, b.train.micro_batch_size),
        "train.global_batch_size": (a.train.global_batch_size, b.train.global_batch_size),
        "train.eval_interval": (a.train.eval_interval, b.train.eval_interval),
        "train.eval_iters": (a.train.eval_iters, b.train.eval_iters),
        "model": (a.model, b.model),
    }
    return [k for k, (x, y) in pairs.items() if x != y]


def _run(cfg: LPTrainConfig, out: Path) -> tuple[list[dict[str, Any]], float]:
    t0 = time.perf_counter()
    pretrain(cfg, out)
    seconds = time.perf_counter() - t0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()], seconds


def _evals(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r["val_loss"])) for r in records if "val_loss" in r]


def first_reach(evals: list[tuple[int, float]], target: float) -> Optional[int]:
    """First evaluated step whose validation loss is <= ``target`` (None if never)."""
    return next((step for step, loss in evals if loss <= target), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--eval-interval", type=int, default=20)
    ap.add_argument("--eval-iters", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    add_args(ap, cap_s=0.0)  # only --save-baseline matters: deterministic figures, one run
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    overrides = [
        f"train.train_iters={args.steps}",
        f"train.eval_interval={args.eval_interval}",
        f"train.eval_iters={args.eval_iters}",
        "logging.progress=false",
        "logging.plots=false",
        # No checkpoints: nothing written into runs/, and no resume from an earlier run.
        "checkpoint.save=null",
        "checkpoint.load=null",
    ]
    cfgs = {"AdamW": load(ADAMW_RECIPE, overrides).cfg, "Muon": load(MUON_RECIPE, overrides).cfg}
    differ = _same_data(cfgs["AdamW"], cfgs["Muon"])
    console = Console(width=110)
    if differ:
        console.print(f"FAIL: the recipes differ in {', '.join(differ)}; not a like-for-like run")
        raise SystemExit(1)
    results: dict[str, tuple[list[dict[str, Any]], float]] = {}
    with tempfile.TemporaryDirectory(prefix="lptrain-muon-bench-") as tmp:
        for name, cfg in cfgs.items():
            results[name] = _run(cfg, Path(tmp) / name)
    evals = {name: _evals(recs) for name, (recs, _) in results.items()}
    adamw_final, muon_final = evals["AdamW"][-1][1], evals["Muon"][-1][1]
    reach = first_reach(evals["Muon"], adamw_final)

    m = cfgs["Muon"].optimizer
    console.print(f"{MUON_RECIPE} vs {ADAMW_RECIPE}: {args.steps} steps, validation every "
                  f"{args.eval_interval} steps ({args.eval_iters} batches)")
    table = Table(title="validation loss")
    for col in ("step", "AdamW val", "Muon val", "Muon / AdamW"):
        table.add_column(col, justify="right")
    for (step, a), (_, mu) in zip(evals["AdamW"], evals["Muon"], strict=True):
        table.add_row(str(step), f"{a:.3f}", f"{mu:.3f}", f"{mu / a:.3f}")
    console.print(table)
    console.print(
        f"Muon: lr {m.lr:g}, scale_mode {m.muon.scale_mode}, coefficients {m.muon.coefficients} "
        f"x{m.muon.ns_steps}; {results['Muon'][1]:.0f}s. AdamW: lr "
        f"{cfgs['AdamW'].optimizer.lr:g}; {results['AdamW'][1]:.0f}s."
    )
    frac = float("inf") if reach is None else reach / args.steps
    figures = [
        Figure("final val loss, Muon / AdamW", [muon_final / adamw_final], 1.0),
        Figure("steps for Muon to reach AdamW's final loss (fraction)", [frac], REACH_TARGET),
    ]
    note = (f"final validation loss: Muon {muon_final:.3f} vs AdamW {adamw_final:.3f}; "
            + ("Muon never reached AdamW's final loss" if reach is None
               else f"Muon reaches {adamw_final:.3f} at step {reach} of {args.steps}"))
    report(console, "muon_vs_adamw", "Muon vs AdamW (deterministic, one run)", figures, args, note)


if __name__ == "__main__":
    main()
