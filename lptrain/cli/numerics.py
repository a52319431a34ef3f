"""``lptrain numerics RUN_DIR``, ``lptrain compare RUN_A RUN_B`` and ``lptrain replay RUN_DIR
--step N``: the tools for a low-precision run that went wrong (docs/numerics-debugging.md).

Importing this module stays light (typer only): the readers (:mod:`lptrain.train.numerics_report`,
:mod:`lptrain.train.compare`) are imported inside the commands, and ``replay``, which trains,
imports torch only once its run folder is known to be usable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from lptrain.errors import InputError

RUN_HELP = "Run folder written by lptrain pretrain (metrics.jsonl, resolved_config.yaml)."


def _run_dir(path: str) -> Path:
    run = Path(path)
    if not (run / "metrics.jsonl").is_file():
        raise InputError(f"{run / 'metrics.jsonl'} not found: pass a run folder written by "
                         "lptrain pretrain", file=str(run / "metrics.jsonl"))
    return run


def _thresholds(items: Optional[list[str]]) -> dict[str, float]:
    from lptrain.train.numerics_report import STATISTICS

    out: dict[str, float] = {}
    for item in items or []:
        stat, _, value = item.partition("=")
        if stat not in STATISTICS:
            raise InputError(f"--threshold {item!r}: unknown statistic {stat!r}",
                             fix=f"use one of {', '.join(STATISTICS)} (e.g. underflow=0.05)")
        try:
            out[stat] = float(value)
        except ValueError:
            raise InputError(f"--threshold {item!r}: {value!r} is not a number",
                             fix=f"write it as {stat}=<number>") from None
    return out


def numerics(
    run_dir: str = typer.Argument(..., help=RUN_HELP),
    top: int = typer.Option(5, "--top", min=1, help="Operands shown per statistic."),
    threshold: Optional[list[str]] = typer.Option(
        None, "--threshold", help="STAT=VALUE: the threshold whose first crossing is reported "
        "(defaults: nonfinite>0, underflow>0.01, saturation>0.001, snr_db<12, zero_blocks>0)."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable report."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write the heatmaps into RUN_DIR."),
) -> None:
    """The worst layers per quantization statistic, with the step where each first crossed
    its threshold (from the run's logging.numerics_interval records)."""
    from lptrain.train.numerics_report import STATISTICS, load_series, worst_layers, write_heatmaps

    run = _run_dir(run_dir)
    limits = _thresholds(threshold)
    series = load_series(run)
    if not series.steps:
        raise InputError(f"{run / 'metrics.jsonl'} holds no quantization statistics",
                         key="logging.numerics_interval",
                         fix="train with logging.numerics_interval=N (e.g. 100)")
    report = {stat: worst_layers(series, stat, top, limits.get(stat)) for stat in STATISTICS}
    if as_json:
        typer.echo(json.dumps({stat: [w.__dict__ for w in rows] for stat, rows in report.items()},
                              indent=2))
    else:
        _print_tables(run, series, report, limits)
    if plots:
        written = write_heatmaps(run, series)
        if not as_json and written:
            typer.echo("wrote " + ", ".join(p.name for p in written) + f" in {run}")


def _print_tables(run: Path, series: object, report: dict, limits: dict[str, float]) -> None:
    from rich.table import Table

    from lptrain.cli.common import console
    from lptrain.train.numerics_report import STATISTICS

    out = console()
    steps = series.steps  # type: ignore[attr-defined]
    out.print(f"{run}: statistics of {len(series.operands)} operands at {len(steps)} steps "  # type: ignore[attr-defined]
              f"({steps[0]}..{steps[-1]})", markup=False, soft_wrap=True)
    for stat, rows in report.items():
        if not rows:
            continue
        direction, default, label = STATISTICS[stat]
        if direction == "high" and rows[0].value == 0:
            out.print(f"{stat}: 0 for every operand at every step ({label})", markup=False,
                      soft_wrap=True)
            continue
        limit = limits.get(stat, default)
        cross = "" if limit is None else f" ({'>' if direction == 'high' else '<'} {limit:g})"
        table = Table(title=f"{stat}: {label}", title_justify="left")
        table.add_column("operand", overflow="fold")
        table.add_column("worst", justify="right")
        table.add_column("at step", justify="right")
        table.add_column(f"first crossed{cross}", justify="right")
        for w in rows:
            first = "-" if w.first_crossed is None else str(w.first_crossed)
            table.add_row(w.operand, f"{w.value:.4g}", str(w.step), first)
        out.print(table)


def compare(
    run_a: str = typer.Argument(..., help="The first run folder."),
    run_b: str = typer.Argument(..., help="The second run folder."),
    tol: float = typer.Option(0.0, "--tolerance", "--tol", min=0.0,
                              help="Relative tolerance |a-b|/max(|a|,|b|) (0: bitwise)."),
    plot: Optional[Path] = typer.Option(
        None, "--plot", help="Overlay plot: FILE.png, or a folder to write compare_vs_<B>.png "
        "into (default: into RUN_A)."),
    no_plot: bool = typer.Option(False, "--no-plot", help="Write no overlay plot."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable report."),
) -> None:
    """The first step where loss, grad norm, lr or any layer's statistics differ, and which
    layer differs first; "identical" when nothing does. Exit 0 when the runs agree within
    --tolerance on their common steps, 1 when they differ or have no step in common (a CI
    gate). Writes an overlay plot."""
    from lptrain.train.compare import compare_runs, plot_path, report_lines, write_overlay

    a, b = _run_dir(run_a), _run_dir(run_b)
    target = None if no_plot else plot_path(plot, a, b)  # a bad --plot: refused before comparing
    cmp = compare_runs(a, b, tol)
    path = None if target is None else write_overlay(a, b, target, cmp.first_step, (str(a), str(b)))
    agree = cmp.identical and bool(cmp.common)
    if as_json:
        first = [d.__dict__ for d in cmp.first]
        layer = cmp.first_layer.__dict__ if cmp.first_layer else None
        typer.echo(json.dumps({"identical": cmp.identical, "first_step": cmp.first_step,
                               "first": first, "first_layer": layer, "common_steps": len(cmp.common),
                               "settings": cmp.settings, "plot": None if path is None else str(path)},
                              indent=2, default=str))
    else:
        for line in report_lines(cmp, str(a), str(b)):
            typer.echo(line)
        if path is not None:
            typer.echo(f"wrote {path}")
    if not agree:
        raise typer.Exit(1)


def replay(
    run_dir: str = typer.Argument(..., help=RUN_HELP),
    step: int = typer.Option(..., "--step", min=1, help="The step to run again."),
    nproc_per_node: int = typer.Option(
        1, "--nproc-per-node", min=1,
        help="Replay on N local ranks, the run's own count (a TP/PP/DP run's step is bitwise "
        "only at its size); under torchrun/SLURM ($WORLD_SIZE set) it joins that world instead."),
) -> None:
    """Re-run step N from the checkpoint before it and say whether the result is bitwise the
    same as the run's (same: data or numerics; different: hardware or non-determinism)."""
    run = _run_dir(run_dir)
    from lptrain.distributed.launch_env import leave_world, world_from_env
    from lptrain.train.replay import plan_replay, replay_step

    rank, env_world, _ = world_from_env()
    if nproc_per_node > 1 and env_world == 1:
        from lptrain.launch.local import launch_local

        plan_replay(run, step, nproc_per_node)  # what it refuses, once, before any rank starts
        raise typer.Exit(launch_local(nproc_per_node, ["replay", str(run), "--step", str(step)]))
    result = replay_step(run, step)
    if rank == 0:  # the verdict once
        for line in result.lines():
            typer.echo(line)
    leave_world()
