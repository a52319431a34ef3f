"""``lptrain pretrain``: validate, then train (or ``--dry-run``, or start N local ranks).

The rules run before torch is imported; a refused config never touches the run folder. With
``--nproc-per-node N`` outside an existing world this command validates for N ranks, judges
the run folder as rank 0 would (paths, lock, resume), and then starts N copies of itself
(torch's elastic launcher), each of which joins the world and trains.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from lptrain.cli.common import (
    CudaOpt,
    DpOpt,
    OverridesArg,
    RecipeOpt,
    Target,
    TargetOpt,
    TeOpt,
    console,
    detect_world,
    load_recipe,
    report_violations,
)

if TYPE_CHECKING:
    from lptrain.config.schema import LPTrainConfig


def pretrain(
    overrides: Optional[list[str]] = OverridesArg,
    recipe: str = RecipeOpt,
    output_dir: Optional[str] = typer.Option(
        None, "--output-dir", "-o", help="Run folder (default: run.output_dir of the recipe)."
    ),
    dp: Optional[int] = DpOpt,
    target: Optional[Target] = TargetOpt,
    te_version: Optional[str] = TeOpt,
    cuda_version: Optional[str] = CudaOpt,
    dry_run: bool = typer.Option(
        False, "--dry-run",
        help="Validate, build the model on the meta device, open the data, then exit (writes nothing).",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace a run already in the run folder instead of refusing."
    ),
    nproc_per_node: int = typer.Option(
        1, "--nproc-per-node", min=1,
        help="Start N local ranks (torch's elastic launcher, as torchrun does); under an existing "
        "torchrun/SLURM world ($WORLD_SIZE set) the run joins that world instead.",
    ),
) -> None:
    """Validate, write resolved_config.yaml into the run folder, then train.

    Refuses to start (exit 1, same report as validate-config) when any rule fails; exit 2 when
    the recipe, data or run folder cannot be used, 3 when the run starts and fails.
    """
    from lptrain.config.check import has_errors
    from lptrain.config.derive import derive
    from lptrain.config.layers import check_composed
    from lptrain.launch.local import REPORTED_ENV, launch_local, world_from_env

    all_overrides = list(overrides or [])
    if output_dir is not None:
        all_overrides.append(f"run.output_dir={output_dir}")
    rank, env_world, _ = world_from_env()
    if env_world > 1:  # a rank: it stops with its launcher (even one killed with SIGKILL)
        from lptrain.distributed.orphans import die_with_launcher

        die_with_launcher()
    composed = load_recipe(recipe, all_overrides)
    spawn = nproc_per_node > 1 and env_world == 1 and not dry_run
    # the ranks this launch has: --nproc-per-node here, or the torchrun/SLURM world it joins
    # ($WORLD_SIZE, read by detect); --dp, or a dry run, checks a world of TP x CP x PP x dp instead
    ranks = nproc_per_node if env_world == 1 and dp is None and not dry_run else None
    world = detect_world(dp, target, te_version, cuda_version, ranks=ranks).for_config(composed.cfg)
    violations = check_composed(composed, world)
    if has_errors(violations):
        report_violations(violations, Path(recipe).name, world, as_json=False)
        console().print("[red]refusing to start: fix the errors above[/red]")
        raise typer.Exit(1)
    if violations and rank == 0 and not os.environ.get(REPORTED_ENV):  # the launcher's said it
        report_violations(violations, Path(recipe).name, world, as_json=False)
    cfg = derive(composed.cfg, world)
    if cfg.debug.nan_sample is not None:  # a module of any stage, checked before anything is written
        from lptrain.train.forensics import check_nan_module

        check_nan_module(cfg)
    if spawn:  # validated for the real world size; each rank runs this command again
        _judge_before_spawn(cfg, overwrite)
        args = _rank_args(recipe, overrides, output_dir, target, te_version, overwrite)
        if cuda_version is not None:
            args += ["--cuda-version", cuda_version]
        raise typer.Exit(launch_local(nproc_per_node, args))
    if rank != 0:  # rank 0 owns the run folder; the others only train
        _train(cfg, overwrite)
        return
    from lptrain.cli import preflight
    from lptrain.config.render import config_yaml
    from lptrain.train.run_dir import RESOLVED_CONFIG, plan_run, write_resolved_config
    from lptrain.train.run_lock import locked_by, refusal, run_lock

    out = Path(cfg.run.output_dir)
    # writable, path lengths, room (exit 2); a dry run for another machine only warns of room
    notes = preflight.check_paths(cfg, out, room_is_error=not (dry_run and target is not None))
    if dry_run:
        holder = locked_by(out)
        if holder is not None:
            raise refusal(out, holder)
        plan_run(cfg, out, overwrite)  # resume (a compatible config), or refuse the folder
        for line in [*notes, *preflight.dry_run(cfg, world).lines()]:
            typer.echo(line)
        raise typer.Exit(0)
    from lptrain.data.loader import check_data_present

    check_data_present(cfg.data)  # a missing dataset: one line, before the folder or its lock
    with run_lock(out, note=typer.echo):  # one run per folder, before anything is written
        plan_run(cfg, out, overwrite)  # resume, or refuse a folder holding another run (exit 2)
        preflight.prepare_output_dir(out)  # OutputDirError (exit 2) before anything is written
        for line in notes:
            typer.echo(line)
        if not (out / RESOLVED_CONFIG).exists():  # a resumed run's file changes only at start
            typer.echo(f"wrote {write_resolved_config(out, config_yaml(cfg))}")
        _train(cfg, overwrite)


def _judge_before_spawn(cfg: LPTrainConfig, overwrite: bool) -> None:
    """What rank 0 would refuse before writing anything -- a folder that cannot be written or
    has no room, one another run holds, a finished run, a resume the config cannot load -- is
    refused here, once, before N ranks start (each used to print it or be stopped for it)."""
    from lptrain.cli import preflight
    from lptrain.data.loader import check_data_present
    from lptrain.train.run_dir import plan_run
    from lptrain.train.run_lock import locked_by, refusal

    out = Path(cfg.run.output_dir)
    preflight.check_paths(cfg, out)  # its warnings are rank 0's to print
    check_data_present(cfg.data)
    holder = locked_by(out)
    if holder is not None:
        raise refusal(out, holder)
    plan_run(cfg, out, overwrite)


def _rank_args(recipe: str, overrides: Optional[list[str]], output_dir: Optional[str],
               target: Optional[Target], te_version: Optional[str], overwrite: bool) -> list[str]:
    """This command line again, for each local rank (the spawn itself left out)."""
    args = ["pretrain", "--recipe", recipe, *(overrides or [])]
    if output_dir is not None:
        args += ["--output-dir", output_dir]
    if target is not None:
        args += ["--target", target.value]
    if te_version is not None:
        args += ["--te-version", te_version]
    if overwrite:
        args.append("--overwrite")
    return args


def _train(cfg: LPTrainConfig, overwrite: bool) -> None:
    """Run the loop into ``run.output_dir``. Looked up on :mod:`lptrain.train` at call time
    (tests replace it there); ``overwrite`` is passed only when set."""
    from lptrain.distributed.launch_env import leave_world
    from lptrain.train import pretrain as run_pretrain

    run_pretrain(cfg, Path(cfg.run.output_dir), **({"overwrite": True} if overwrite else {}))
    leave_world()  # a finished run: every rank tears the world down together
