"""``lptrain estimate-memory``: will this recipe fit, per rank, before it is queued?

A thin command over :func:`lptrain.memory.plan.estimate_memory`: validates the recipe for the
world (``--dp``, ``--target``), prints the per-category table of the most loaded rank (or
``--json``), a "fits / does not fit" line against ``--gpu-memory`` (default: the target's
memory, :data:`GPU_MEMORY_GIB`), and with ``--plot`` a bar chart.

Moved here from ``lptrain.memory``: the planner sits below the training code, the command
above it with the other commands.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from lptrain.catalog.gpus import GPUS
from lptrain.cli.common import (
    DP_HELP,
    RECIPE_HELP,
    OverridesArg,
    Target,
    load_recipe,
    report_violations,
)

if TYPE_CHECKING:
    from lptrain.memory.plan import MemoryEstimate

GIB = 1024**3

# Device memory per target, GiB: the target's reference part in the one GPU table
# (lptrain.catalog.gpus, which the MFU figures read too). The allocator, CUDA context and
# NCCL take a few GiB of it: leave headroom.
GPU_MEMORY_GIB = {g.target: g.memory_gib for g in GPUS if g.target is not None}

LABELS = {
    "weights": "weights (high precision)",
    "quantized_weights": "quantized primary weights",
    "grads": "grads",
    "masters": "fp32 masters",
    "optimizer_states": "optimizer states",
    "padding": "buffer padding",
    "param_gather_staging": "param all-gather staging",
    "weight_copies": "transient weight copies",
    "sharded_buckets": "full buckets in use (ZeRO-2/3)",
    "activations": "activations (1 micro-batch)",
    "pipeline_buffers": "pipeline receive buffers",
    "cp_buffers": "CP attention buffers (1 layer)",
}


def labels_for(estimate: MemoryEstimate) -> dict[str, str]:
    """The category labels of this estimate, the same in the text and in the plot: under
    pipeline parallelism the activations are those of the micro-batches the worst rank's
    stage holds in flight."""
    from lptrain.memory.plan import micro_batches

    if estimate.pp == 1:
        return LABELS
    return {**LABELS, "activations": f"activations ({micro_batches(estimate.in_flight)} in flight)"}


def default_gpu_memory_gib(target: str) -> float:
    """The target's device memory; for ``cpu`` this machine's RAM."""
    if target in GPU_MEMORY_GIB:
        return GPU_MEMORY_GIB[target]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16.0


def fits_line(total: int, budget_gib: float, target: str) -> str:
    need = total / GIB
    verdict = "fits" if need <= budget_gib else "does not fit"
    return f"{verdict}: {need:.2f} GiB needed per rank, {budget_gib:.2f} GiB available ({target})"


def plot(estimate: MemoryEstimate, path: Path, title: str) -> None:
    """Bar chart of the most loaded rank's categories (GiB), recompute shown hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = estimate.worst
    labels = labels_for(estimate)
    names = [labels[k] for k in w.bytes] + ["activations, full recompute"]
    values = [v / GIB for v in w.bytes.values()] + [estimate.activations_recompute / GIB]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bars = ax.barh(names, values, color="tab:blue")
    bars[-1].set_hatch("//")
    bars[-1].set_color("tab:gray")
    ax.invert_yaxis()
    ax.set_xlabel("GiB per rank")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def estimate_memory_cmd(
    overrides: Optional[list[str]] = OverridesArg,
    recipe: str = typer.Option(..., "--recipe", "-r", help=RECIPE_HELP),
    dp: int = typer.Option(1, "--dp", min=1, help=DP_HELP.split(" (default:")[0] + "."),
    target: Optional[Target] = typer.Option(
        None, "--target", case_sensitive=False,
        help="Hardware to plan for (default: the recipe's meta.target, else cpu)."),
    gpu_memory: Optional[float] = typer.Option(
        None, "--gpu-memory", min=0.0,
        help="Device memory per rank in GiB (default: the target's reference GPU: "
        + ", ".join(f"{t} {m:g}" for t, m in GPU_MEMORY_GIB.items()) + "; cpu: this machine's RAM)."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable report."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Write a bar chart (PNG)."),
) -> None:
    """Per-rank memory of a recipe at a data-parallel size, by category, before any GPU.

    Uses the engine's own buffer layout on a meta-device model. Exit status: 0 estimated
    (whether it fits is the last line, or "fits" in --json), 1 rule violations for that
    world, 2 unreadable input.
    """
    from lptrain.config.check import has_errors
    from lptrain.config.derive import derive
    from lptrain.config.layers import check_composed
    from lptrain.config.world import World
    from lptrain.memory.plan import estimate_memory

    composed = load_recipe(recipe, overrides)
    tgt = target.value if target else (composed.meta.target or "cpu")
    world = World.detect(dp=dp, target=tgt).for_config(composed.cfg)
    violations = check_composed(composed, world)
    if has_errors(violations):
        report_violations(violations, Path(recipe).name, world, as_json=False)
        typer.echo("not estimated: fix the errors above for this world", err=True)
        raise typer.Exit(1)
    cfg = derive(composed.cfg, world)
    est = estimate_memory(cfg, dp, tgt)
    budget = gpu_memory if gpu_memory is not None else default_gpu_memory_gib(tgt)
    w = est.worst
    if plot_path is not None:
        plot(est, plot_path, f"{Path(recipe).name}, dp {dp}, {tgt}: rank {w.rank}")
    if as_json:
        payload = {**est.to_dict(), "target": tgt, "gpu_memory_gib": budget,
                   "fits": w.total <= budget * GIB}
        typer.echo(json.dumps(payload, indent=2))
        return
    typer.echo(f"{Path(recipe).name}: {est.params / 1e6:.2f}M params, dp {dp}, target {tgt}; "
               f"rank {w.rank} (the most loaded)")
    labels = labels_for(est)
    if est.optimizer_state:  # the precision-aware optimizer: masters in another form
        labels["masters"] = "masters"
    width = max(30, *(len(labels[k]) for k in w.bytes))
    for k, v in w.bytes.items():
        typer.echo(f"  {labels[k]:<{width}} {v / GIB:10.3f} GiB")
    typer.echo(f"  {'total':<{width}} {w.total / GIB:10.3f} GiB")
    rc = cfg.model.recompute_granularity
    typer.echo(f"  (activations with full recompute: {est.activations_recompute / GIB:.3f} GiB; "
               f"this run: model.recompute_granularity={'null' if rc is None else rc}, "
               f"ddp.data_parallel_sharding_strategy={cfg.ddp.data_parallel_sharding_strategy})")
    for line in est.layout_report.splitlines()[:1]:
        typer.echo(f"layout: {line}")
    for note in est.notes:
        typer.echo(f"note: {note}")
    if plot_path is not None:
        typer.echo(f"wrote {plot_path}")
    typer.echo(fits_line(w.total, budget, tgt))
