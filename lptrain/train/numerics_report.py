"""Reading a run's quantization statistics back: the worst layers and the heatmaps.

``metrics.jsonl`` holds a ``numerics`` object on every ``logging.numerics_interval``-th step
(``{operand: {statistic: value}}``, :mod:`lptrain.precision.operand_stats`). From it
:func:`worst_layers` ranks the operands per statistic by their worst value over the run and
finds the step where each first crossed a threshold (``lptrain numerics RUN_DIR``), and
:func:`write_heatmaps` draws one operands x steps heatmap per statistic
(``numerics_<statistic>.png``). Torch-free: it reads files only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lptrain.train.jsonl import step_records

# statistic -> (worse when "high" or "low", default threshold or None, label)
STATISTICS: dict[str, tuple[str, Optional[float], str]] = {
    "nonfinite": ("high", 0.0, "non-finite values (count)"),
    "underflow": ("high", 0.01, "fraction of nonzero values flushed to zero"),
    "saturation": ("high", 0.001, "fraction of values clamped at the format's max"),
    "snr_db": ("low", 12.0, "quantization SNR (dB)"),
    "zero_blocks": ("high", 0.0, "fraction of all-zero blocks"),
    "amax": ("high", None, "amax (largest finite magnitude)"),
    "scale_exp_min": ("low", None, "smallest block-scale exponent"),
    "scale_exp_max": ("high", None, "largest block-scale exponent"),
}


@dataclass
class Series:
    """The statistics of a run: its numerics steps, the operands (first-seen order) and
    ``values[statistic][operand]`` aligned with ``steps`` (None where absent)."""

    steps: list[int]
    operands: list[str]
    values: dict[str, dict[str, list[Optional[float]]]]


def numerics_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """The step lines of ``metrics.jsonl`` that carry statistics (a torn line is skipped)."""
    return [rec for rec in step_records(Path(run_dir) / "metrics.jsonl") if isinstance(rec.get("numerics"), dict)]


def load_series(run_dir: str | Path) -> Series:
    recs = numerics_records(run_dir)
    operands: dict[str, None] = {}
    for r in recs:
        operands.update(dict.fromkeys(r["numerics"]))
    values: dict[str, dict[str, list[Optional[float]]]] = {}
    for stat in STATISTICS:
        values[stat] = {op: [(r["numerics"].get(op) or {}).get(stat) for r in recs] for op in operands}
    return Series([int(r["step"]) for r in recs], list(operands), values)


def _crossed(direction: str, value: float, threshold: float) -> bool:
    return value > threshold if direction == "high" else value < threshold


@dataclass(frozen=True)
class Worst:
    """One operand's worst value of a statistic, its step, and the first step past the
    threshold (None: never crossed, or no threshold)."""

    operand: str
    value: float
    step: int
    first_crossed: Optional[int]


def worst_layers(series: Series, stat: str, top: int = 5,
                 threshold: Optional[float] = None) -> list[Worst]:
    """The ``top`` operands with the worst ``stat`` over the run (ties: first-seen order)."""
    direction, default, _ = STATISTICS[stat]
    limit = default if threshold is None else threshold
    rows = []
    for op in series.operands:
        pts = [(s, v) for s, v in zip(series.steps, series.values[stat][op], strict=True)
               if v is not None and math.isfinite(v)]
        if not pts:
            continue
        pick = max if direction == "high" else min
        step, value = pick(pts, key=lambda p: p[1])  # the first step at the worst value
        first = None
        if limit is not None:
            first = next((s for s, v in pts if _crossed(direction, v, limit)), None)
        rows.append(Worst(op, value, step, first))
    rows.sort(key=lambda w: -w.value if direction == "high" else w.value)
    return rows[:top]


def write_heatmaps(run_dir: str | Path, series: Optional[Series] = None) -> list[Path]:
    """``numerics_<statistic>.png``: operands (rows) x numerics steps (columns) per statistic
    that has values; amax on a log10 scale. Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from lptrain.train.plots import save_png

    run_dir = Path(run_dir)
    series = series if series is not None else load_series(run_dir)
    written: list[Path] = []
    if not series.steps:
        return written
    for stat, (_, _, label) in STATISTICS.items():
        grid = np.array([[np.nan if v is None else v for v in series.values[stat][op]]
                         for op in series.operands], dtype=float)
        if np.isnan(grid).all():
            continue
        if stat == "amax":
            with np.errstate(divide="ignore"):
                grid = np.log10(np.where(grid > 0, grid, np.nan))
            label = "log10 " + label
        rows, cols = grid.shape
        fig, ax = plt.subplots(figsize=(min(4 + 0.25 * cols, 16), min(2 + 0.18 * rows, 24)))
        im = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest",
                       cmap="viridis_r" if STATISTICS[stat][0] == "low" else "viridis")
        fig.colorbar(im, ax=ax, label=label)
        every = max(1, rows // 60)
        ax.set_yticks(range(0, rows, every))
        ax.set_yticklabels(series.operands[::every], fontsize=6)
        xevery = max(1, cols // 20)
        ax.set_xticks(range(0, cols, xevery))
        ax.set_xticklabels(series.steps[::xevery], fontsize=7, rotation=90)
        ax.set_xlabel("step")
        ax.set_title(f"{stat}: {label}")
        fig.tight_layout()
        path = run_dir / f"numerics_{stat}.png"
        save_png(fig, path, dpi=100)  # whole or not at all
        plt.close(fig)
        written.append(path)
    return written
