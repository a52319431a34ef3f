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
import re
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


# Heatmap layout: every operand's row is labelled, so a figure holds at most PANEL_ROWS rows
# per panel (whole layers where they fit: 4 dense layers of 12 operands) and PANELS panels
# side by side; a model with more operands gets one figure per group of layers.
PANEL_ROWS = 48
PANELS = 4
ROW_INCHES = 0.14  # 14 px at 100 dpi: a 6-point label (8.3 px) with room
# statistics that are fractions in [0, 1] or counts: their colour scale starts at 0
FROM_ZERO = ("underflow", "saturation", "zero_blocks", "nonfinite")
_LAYER = re.compile(r"layers\.(\d+)\.")


def _layer(operand: str) -> Optional[int]:
    m = _LAYER.match(operand)
    return int(m.group(1)) if m else None


def panels(operands: list[str], rows: int = PANEL_ROWS) -> list[list[str]]:
    """The operands (in order) cut into panels of at most ``rows``, at layer boundaries where
    a layer fits in a panel (a layer larger than a panel -- many experts -- is cut in rows)."""
    groups: list[list[str]] = []
    for op in operands:
        if groups and _layer(groups[-1][-1]) == _layer(op):
            groups[-1].append(op)
        else:
            groups.append([op])
    out: list[list[str]] = []
    for g in groups:
        for i in range(0, len(g), rows):
            piece = g[i:i + rows]
            if out and len(out[-1]) + len(piece) <= rows:
                out[-1].extend(piece)
            else:
                out.append(list(piece))
    return out


def color_limits(stat: str, values: Any) -> tuple[float, float]:
    """The colour scale of a statistic, shared by all its panels and figures: fractions and
    counts from 0 (to 1 when they are all zero: never a negative fraction), the others over
    their range (one unit either side of a constant)."""
    import numpy as np

    finite = values[np.isfinite(values)]
    lo, hi = float(finite.min()), float(finite.max())
    if stat in FROM_ZERO:
        return 0.0, hi if hi > 0 else 1.0
    return (lo - 1.0, hi + 1.0) if lo == hi else (lo, hi)


def _grid(series: Series, stat: str) -> Any:
    import numpy as np

    grid = np.array([[np.nan if v is None else v for v in series.values[stat][op]]
                     for op in series.operands], dtype=float)
    if stat == "amax":
        with np.errstate(divide="ignore", invalid="ignore"):
            grid = np.log10(np.where(grid > 0, grid, np.nan))
    return grid


def _span(ops: list[str]) -> str:
    """``layers 0-3`` (the layers of a figure's operands), ``other`` for none."""
    layers = [x for x in (_layer(op) for op in ops) if x is not None]
    return f"layers {min(layers)}-{max(layers)}" if layers else "other"


def write_heatmaps(run_dir: str | Path, series: Optional[Series] = None) -> list[Path]:
    """``numerics_<statistic>.png``: operands (rows, every one labelled) x numerics steps
    (columns) per statistic that has values, amax on a log10 scale, in panels of whole layers
    with one colour scale (:func:`color_limits`); a model with more than ``PANELS x
    PANEL_ROWS`` operands gets one figure per group of layers,
    ``numerics_<statistic>_layers_<a>-<b>.png``. Returns the paths written."""
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
    index = {op: i for i, op in enumerate(series.operands)}
    cut = panels(series.operands)
    figures = [cut[i:i + PANELS] for i in range(0, len(cut), PANELS)]
    for stat, (direction, _, label) in STATISTICS.items():
        grid = _grid(series, stat)
        if np.isnan(grid).all():
            continue
        label = ("log10 " if stat == "amax" else "") + label
        limits = color_limits(stat, grid)
        for pattern in (f"numerics_{stat}.png", f"numerics_{stat}_layers_*.png", f"numerics_{stat}_other.png"):
            for stale in run_dir.glob(pattern):  # an earlier drawing (another split) goes
                stale.unlink(missing_ok=True)
        for group in figures:
            whole = len(figures) == 1
            span = _span([o for p in group for o in p])
            fig = _figure(plt, group, [grid[[index[o] for o in ops]] for ops in group], series.steps,
                          limits, "viridis_r" if direction == "low" else "viridis", label,
                          f"{stat}: {label}" + ("" if whole else f" ({span})"))
            path = run_dir / (f"numerics_{stat}.png" if whole
                              else f"numerics_{stat}_{span.replace(' ', '_')}.png")
            save_png(fig, path, dpi=100)  # whole or not at all
            plt.close(fig)
            written.append(path)
    return written


def _figure(plt: Any, group: list[list[str]], grids: list[Any], steps: list[int],
            limits: tuple[float, float], cmap: str, label: str, title: str) -> Any:
    """Panels side by side (one per operand list, every row labelled), one colour bar. The
    layout is fixed in inches -- a label column, the steps, the colour bar -- rather than
    "tight": that would draw every label twice."""
    import numpy as np

    rows, cols = max(len(p) for p in group), len(steps)
    xevery = max(1, cols // 20)
    label_w, plot_w, top, bottom = 2.3, min(0.2 * cols, 4.0) + 0.4, 0.5, 0.6
    width = len(group) * (label_w + plot_w) + 1.2
    height = top + bottom + ROW_INCHES * rows
    fig = plt.figure(figsize=(width, height))
    box_h = ROW_INCHES * rows / height
    im = None
    for k, (ops, g) in enumerate(zip(group, grids, strict=True)):
        ax = fig.add_axes(((k * (label_w + plot_w) + label_w) / width, bottom / height,
                           plot_w / width, box_h))
        im = ax.imshow(np.ma.masked_invalid(g), aspect="auto", interpolation="nearest",
                       vmin=limits[0], vmax=limits[1], cmap=cmap)
        ax.set_yticks(range(len(ops)), ops, fontsize=6)
        ax.set_ylim(rows - 0.5, -0.5)  # equal row heights in every panel
        ax.set_xticks(range(0, cols, xevery), [str(s) for s in steps[::xevery]], fontsize=7, rotation=90)
        ax.tick_params(length=2)
        ax.set_xlabel("step", fontsize=8)
    cax = fig.add_axes(((width - 1.0) / width, bottom / height, 0.15 / width, box_h))
    fig.colorbar(im, cax=cax, label=label)
    fig.suptitle(title, y=1 - 0.12 / height)
    return fig
