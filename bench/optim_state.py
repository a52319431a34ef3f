"""Low-precision optimizer state (Megatron's precision-aware optimizer): validation loss after
300 steps against fp32 state, for the AdamW recipe and the Muon recipe.

Not a test: trains ``tiny_cpu.yaml`` (bf16, AdamW, here with the distributed optimizer at one
rank, which the precision-aware optimizer needs) and ``mxfp8_muon_cpu.yaml`` (MXFP8 emulated,
layer-wise Muon + AdamW) through ``lptrain.train.pretrain``, each once with fp32 state and
once per variant, all with ``optimizer.use_precision_aware_optimizer=true`` (Transformer
Engine's FusedAdam math; the fp32 row keeps ``store_param_remainders=false``), the same data,
seed and steps. Reads each run's final ``val_loss`` from ``metrics.jsonl``.

Targets (issue "Low-precision optimizer state"), as the final validation loss over the fp32
run's: bf16 moments within 1.0%, an FP8 first moment with a bf16 second moment within 2.0%,
bf16 main grads within 1.0%. The remainder row (TE's fp32 masters kept as the bf16 param plus
an int16 remainder: the same 32 bits) has no target here: its masters are the fp32 masters'
bits (tests/unit/optim/test_precision_aware_optimizer.py proves it step by step), but TE's
split rounds the bf16 param half away from zero where the fp32 path rounds it to even, so the
runs part at the first exact tie; the table prints how far apart they end. The MXFP8 Muon
recipe keeps fp32 masters in lptrain (TE holds none there): no remainder row. Rows without a
target (fp16 masters, torch's AdamW without the precision-aware optimizer) are for reference.

The figures are losses of seeded runs, deterministic on one machine: one run is the
measurement (no repeats), judged through ``bench/harness.py`` like every bench. The wall time
of each run is printed for information. Writes ``optim_state.png`` (the validation curves)
next to ``--out``.

    .venv/bin/python bench/optim_state.py [--steps 300] [--eval-interval 50] [--eval-iters 8]
        [--rows NAME ...] [--out bench-out] [--save-baseline]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
from harness import Figure, add_args, report
from rich.console import Console
from rich.table import Table

from lptrain.config.compose import load
from lptrain.train import pretrain

PAO = ["optimizer.use_precision_aware_optimizer=true", "ddp.use_distributed_optimizer=true"]
FP32 = [*PAO, "optimizer.store_param_remainders=false"]
BF16_MOMENTS = ["optimizer.exp_avg_dtype=bf16", "optimizer.exp_avg_sq_dtype=bf16"]
FP8_BF16 = ["optimizer.exp_avg_dtype=fp8", "optimizer.exp_avg_sq_dtype=bf16"]
# (recipe label, recipe, {row: (overrides, target ratio or None)}); the first row is the baseline
RECIPES: dict[str, tuple[str, dict[str, tuple[list[str], Optional[float]]]]] = {
    "AdamW": ("tiny_cpu.yaml", {
        "fp32 state": (FP32, None),
        "bf16 moments": ([*FP32, *BF16_MOMENTS], 1.010),
        "fp8 exp_avg + bf16 exp_avg_sq": ([*FP32, *FP8_BF16], 1.020),
        "bf16 main grads": ([*FP32, "optimizer.main_grads_dtype=bf16"], 1.010),
        "fp32 masters as remainders": ([*PAO, "optimizer.store_param_remainders=true"], None),
        "fp16 masters": ([*FP32, "optimizer.main_params_dtype=fp16"], None),
        "torch AdamW (no precision-aware optimizer)": (["ddp.use_distributed_optimizer=true"], None),
    }),
    "Muon": ("mxfp8_muon_cpu.yaml", {
        "fp32 state": (FP32, None),
        "bf16 moments": ([*FP32, *BF16_MOMENTS], 1.010),
        "fp8 exp_avg + bf16 exp_avg_sq": ([*FP32, *FP8_BF16], 1.020),
        "bf16 main grads": ([*FP32, "optimizer.main_grads_dtype=bf16"], 1.010),
    }),
}


def _run(recipe: str, overrides: list[str], out: Path) -> tuple[list[tuple[int, float]], float]:
    t0 = time.perf_counter()
    pretrain(load(recipe, overrides).cfg, out)
    seconds = time.perf_counter() - t0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [(int(r["step"]), float(r["val_loss"])) for r in recs if "val_loss" in r], seconds


def _plot(curves: dict[str, dict[str, list[tuple[int, float]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(6.5 * len(curves), 4.2), squeeze=False)
    for ax, (label, rows) in zip(axes[0], curves.items(), strict=True):
        for name, pts in rows.items():
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", ms=3, label=name,
                    lw=2.2 if name == "fp32 state" else 1.2)
        ax.set_title(f"{label} ({RECIPES[label][0]})")
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-interval", type=int, default=50)
    ap.add_argument("--eval-iters", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", nargs="*", default=None, help="only these recipes/rows (e.g. AdamW)")
    ap.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for the plot")
    add_args(ap, cap_s=0.0)  # only --save-baseline matters: deterministic figures, one run
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    common = [f"train.train_iters={args.steps}", f"train.eval_interval={args.eval_interval}",
              f"train.eval_iters={args.eval_iters}", "logging.progress=false", "logging.plots=false",
              "checkpoint.save=null", "checkpoint.load=null"]
    console = Console(width=120)
    table = Table(title=f"validation loss after {args.steps} steps, against fp32 state")
    for col in ("recipe", "state", "val loss", "/ fp32", "target", "seconds"):
        table.add_column(col, justify="left" if col in ("recipe", "state") else "right")
    figures: list[Figure] = []
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="lptrain-optim-state-") as tmp:
        for label, (recipe, rows) in RECIPES.items():
            if args.rows and label not in args.rows and not any(r in args.rows for r in rows):
                continue
            base: Optional[float] = None
            curves[label] = {}
            for name, (ov, target) in rows.items():
                if args.rows and label not in args.rows and name not in args.rows and name != "fp32 state":
                    continue
                evals, seconds = _run(recipe, [*common, *ov], Path(tmp) / f"{label}-{len(curves[label])}")
                curves[label][name] = evals
                final = evals[-1][1]
                base = final if base is None else base
                ratio = final / base
                table.add_row(label, name, f"{final:.4f}", f"{ratio:.4f}",
                              "-" if target is None else f"<= {target:.3f}", f"{seconds:.0f}")
                console.print(f"{label} / {name}: val {final:.4f} ({ratio:.4f} of fp32), {seconds:.0f}s")
                if name != "fp32 state":
                    figures.append(Figure(f"{label}: {name}, val loss / fp32", [ratio], target))
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    plot = args.out / "optim_state.png"
    _plot(curves, plot)
    report(console, "optim_state", "low-precision optimizer state (deterministic, one run each)",
           figures, args, f"wrote {plot}")


if __name__ == "__main__":
    main()
