"""PNG plots of a run folder (``lptrain plot RUN_DIR``, see :mod:`lptrain.cli.plot`; also
written at the end of a run).

Read from ``metrics.jsonl`` (and ``summary.json`` for the memory breakdown), so a run killed
half-way can still be plotted. Only files actually written are returned and reported.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from lptrain.train.jsonl import step_records


def save_png(fig: Any, path: Path, dpi: int) -> Path:
    """``fig`` as the PNG ``path``, whole or not at all: drawn into a temp file beside it and
    renamed (a full disk left a 0-byte ``loss.png``). An ``OSError`` names ``path``."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        fig.savefig(tmp, dpi=dpi, format="png")
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None
    return path


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return step_records(run_dir / "metrics.jsonl")


def write_plots(run_dir: str | Path) -> list[Path]:
    """Write loss.png, lr.png, grad_norm.png, memory.png (when the summary has the memory
    breakdown, bytes by category of this run's buffers and optimizer) and the quantization
    statistics' heatmaps ``numerics_<statistic>.png`` (when the run logged them) into
    ``run_dir``; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    recs = _records(run_dir)
    written: list[Path] = []
    if not recs:
        return written
    figures = [("loss.png", lambda: _loss_figure(plt, recs)), ("lr.png", lambda: _lr_figure(plt, recs)),
               ("grad_norm.png", lambda: _grad_norm_figure(plt, recs))]
    breakdown = _memory_breakdown(run_dir)
    if breakdown:
        figures.append(("memory.png", lambda: _memory_figure(plt, breakdown)))
    for name, draw in figures:  # one figure open at a time
        fig = draw()
        fig.tight_layout()
        try:
            save_png(fig, run_dir / name, dpi=110)
        finally:
            plt.close(fig)
        written.append(run_dir / name)
    if any(isinstance(r.get("numerics"), dict) for r in recs):
        from lptrain.train.numerics_report import write_heatmaps

        written.extend(write_heatmaps(run_dir))
    return written


def _loss_figure(plt: Any, recs: list[dict[str, Any]]) -> Any:
    train = [(r["step"], r["loss"]) for r in recs if r.get("loss") is not None]
    evals = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss")
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def _lr_figure(plt: Any, recs: list[dict[str, Any]]) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    groups = sorted({g for r in recs for g in (r.get("lrs") or {})})
    for g in groups:
        pts = [(r["step"], r["lrs"][g]) for r in recs if g in (r.get("lrs") or {})]
        ax.plot(*zip(*pts, strict=True), label=f"lr ({g})")
    if not groups:
        ax.plot([r["step"] for r in recs], [r.get("lr") for r in recs], label="lr")
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def _grad_norm_figure(plt: Any, recs: list[dict[str, Any]]) -> Any:
    gn = [(r["step"], r["grad_norm"]) for r in recs if r.get("grad_norm") is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    if gn:
        ax.plot(*zip(*gn, strict=True), label="grad norm (before clipping)")
    ax.set_xlabel("step")
    ax.set_ylabel("global grad norm")
    if gn and min(v for _, v in gn) > 0:
        from matplotlib.ticker import LogFormatter

        ax.set_yscale("log")
        # plain tick labels ("0.5", "2"): the default 10^x labels go through mathtext, whose
        # parser took longer to build than the rest of a run's plots together
        ax.yaxis.set_major_formatter(LogFormatter())
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def _memory_figure(plt: Any, breakdown: dict[str, float]) -> Any:
    """Bars for the categories, the total in the title. "padding" is already inside
    grads/param_buffer and "total" leaves it out (the engine's memory breakdown)."""
    total = breakdown.pop("total", None)
    if total is None:
        total = sum(v for k, v in breakdown.items() if k != "padding")
    unit, scale = ("GiB", 2**30) if total >= 2**30 else ("MiB", 2**20)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    names = list(breakdown)
    labels = ["padding\n(in grads/param_buffer)" if n == "padding" else n for n in names]
    bars = ax.bar(labels, [breakdown[n] / scale for n in names],
                  color=["0.6" if n == "padding" else "C0" for n in names])
    ax.bar_label(bars, fmt="%.3g")
    ax.set_ylabel(f"{unit} (rank 0)")
    ax.set_title(f"memory: {total / scale:.3g} {unit} in buffers and optimizer (no activations)")
    ax.tick_params(axis="x", rotation=30)
    return fig


def _memory_breakdown(run_dir: Path) -> dict[str, float] | None:
    """Bytes by category from ``summary.json`` (``engine.memory_breakdown()`` at the run's end)."""
    path = run_dir / "summary.json"
    try:
        got = json.loads(path.read_text()).get("memory_breakdown_bytes") if path.exists() else None
    except ValueError:
        return None
    if not isinstance(got, dict):
        return None
    return {k: float(v) for k, v in got.items() if isinstance(v, (int, float))}

