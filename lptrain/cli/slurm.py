"""``lptrain slurm``: validate a recipe for a SLURM allocation, then render and submit its
sbatch script (rendering and submission: :mod:`lptrain.launch.slurm`).

The command refuses before rendering: a recipe with rule errors for NODES x GPUS ranks, a
``#SBATCH`` value or run folder that a script line cannot carry, a recipe without a target.
"""

from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from lptrain.cli.common import (
    RECIPE_HELP,
    Target,
    complete_override,
    complete_recipe,
    load_recipe,
    report_violations,
)
from lptrain.launch.slurm import (
    DEFAULT_SIGNAL_LEAD_S,
    SlurmJob,
    launch_violations,
    render,
    render_template,
    script_path,
    submit,
)

if TYPE_CHECKING:
    from lptrain.config.compose import Composed


def slurm(
    overrides: Optional[list[str]] = typer.Argument(
        None, help="Overrides as dotted key=value, validated now and passed to pretrain.",
        show_default=False, autocompletion=complete_override),
    recipe: Optional[str] = typer.Option(None, "--recipe", "-r", help=RECIPE_HELP,
                                         autocompletion=complete_recipe),
    nodes: int = typer.Option(1, "--nodes", "-N", min=1, help="Nodes to allocate."),
    gpus_per_node: int = typer.Option(
        8, "--gpus-per-node", "-G", min=1,
        help="GPUs (= training processes) per node; for a cpu target, gloo processes per node "
        "(no GPU is requested)."),
    partition: Optional[str] = typer.Option(None, "--partition", "-p", help="SLURM partition."),
    time: Optional[str] = typer.Option(None, "--time", "-t", help="Time limit, e.g. 04:00:00."),
    account: Optional[str] = typer.Option(None, "--account", "-A", help="SLURM account."),
    container: Optional[str] = typer.Option(
        None, "--container", help="Run inside this image (pyxis srun --container-image), "
        "with the image's python."),
    env_activate: Optional[str] = typer.Option(
        None, "--env-activate", help="Shell code that activates lptrain's environment on the "
        "nodes (e.g. 'module load cuda; source ~/venv/bin/activate'); default: the "
        "environment of this lptrain (its interpreter and prefix)."),
    output_dir: Optional[str] = typer.Option(
        None, "--output-dir", "-o", help="Run folder (default: run.output_dir of the recipe); "
        "a requeued or resubmitted job resumes from it."),
    target: Optional[Target] = typer.Option(
        None, "--target", case_sensitive=False,
        help="Hardware to validate for (default: the recipe's meta.target)."),
    signal_lead: int = typer.Option(
        DEFAULT_SIGNAL_LEAD_S, "--signal-lead", min=10,
        help="Seconds before the time limit at which lptrain checkpoints and stops."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the script; submit nothing."),
    template: bool = typer.Option(
        False, "--template", help="Print the hand-editable scripts/slurm/pretrain.sbatch."),
) -> None:
    """Validate a recipe for NODES x GPUS ranks, then render and submit its sbatch script.

    Exit status: 0 submitted (or printed), 1 rule errors for that world (nothing is
    rendered), 2 unreadable input or sbatch missing/refusing the job.
    """
    if template:
        typer.echo(render_template(signal_lead), nl=False)
        return
    if recipe is None:
        typer.echo("error: --recipe is required (or --template for the generic script)",
                   err=True)
        raise typer.Exit(2)
    _check_sbatch_values(partition=partition, time=time, account=account)
    user_overrides = list(overrides or [])
    all_overrides = user_overrides + ([f"run.output_dir={output_dir}"] if output_dir else [])
    composed = load_recipe(recipe, all_overrides)
    tgt = target.value if target else composed.meta.target
    if tgt is None:
        typer.echo(f"error: {recipe}: no meta.target in the recipe; pass --target "
                   "{cpu,sm89,sm90,sm100}", err=True)
        raise typer.Exit(2)
    out = _run_folder(composed)
    _refuse_invalid(composed, recipe, nodes * gpus_per_node, tgt)
    recipe_arg = str(Path(recipe).expanduser().absolute()) if "/" in recipe else recipe
    python, activate = _environment(container, env_activate)
    job = SlurmJob(
        recipe=recipe_arg, nodes=nodes, gpus_per_node=gpus_per_node, output_dir=str(out),
        overrides=tuple(user_overrides), gpu=tgt != "cpu",
        job_name=re.sub(r"[^A-Za-z0-9_.-]", "_", f"lptrain-{composed.cfg.run.name}"), partition=partition, time=time,
        account=account, container=container, signal_lead_s=signal_lead, python=python,
        env_activate=activate)
    if not composed.cfg.checkpoint.save:
        typer.echo("note: checkpoint.save is not set, so a preempted or requeued job restarts "
                   "from step 0; set checkpoint.save=${run.output_dir}/checkpoints to resume",
                   err=True)
    text = render(job)
    if dry_run:
        typer.echo(text, nl=False)
        return
    path = script_path(job)
    created = _missing_parents(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    try:
        job_id = submit(path)
    except typer.Exit:  # refused: leave nothing behind (script, and folders made for it)
        path.unlink(missing_ok=True)
        for folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty
        raise
    typer.echo(f"submitted job {job_id} ({nodes} node(s) x {gpus_per_node}); script {path}; "
               f"logs in {path.parent / 'logs'}")


def _environment(container: Optional[str], env_activate: Optional[str]) -> tuple[str, str]:
    """``(python, activation)`` for the nodes: inside a container the image's ``python``;
    with ``--env-activate`` that code and the ``python`` it puts on ``PATH``; else this
    lptrain's own interpreter and prefix."""
    from lptrain.launch.slurm import interpreter_environment

    if container:
        return "python", ""
    if env_activate is not None:
        return "python", env_activate
    return interpreter_environment()


def _missing_parents(path: Path) -> list[Path]:
    """The folders above ``path`` that do not exist yet, deepest first."""
    out = []
    for parent in path.parents:
        if parent.exists():
            break
        out.append(parent)
    return out


def _check_sbatch_values(**values: Optional[str]) -> None:
    """``--partition``/``--time``/``--account`` go on ``#SBATCH`` lines: no spaces or shell."""
    for name, value in values.items():
        if value is not None and not re.fullmatch(r"[\w.:,+@-]+", value):
            typer.echo(f"error: --{name} {value!r}: #SBATCH lines take no spaces, quotes or "
                       "shell characters", err=True)
            raise typer.Exit(2)


def _run_folder(composed: Composed) -> Path:
    """The absolute run folder; refused (exit 2) when a ``#SBATCH`` line cannot carry it."""
    out = Path(composed.cfg.run.output_dir).expanduser().absolute()
    if re.search(r"[\s\"'$`\\]", str(out)):
        typer.echo(f"error: run folder '{out}' has whitespace, quotes, '$' or backslashes, "
                   "which #SBATCH lines cannot carry; choose another --output-dir", err=True)
        raise typer.Exit(2)
    return out


def _refuse_invalid(composed: Composed, recipe: str, world_size: int, target: str) -> None:
    """The validate-config report for this world on stderr (stdout is the script); exit 1
    when any rule fails."""
    from lptrain.config.check import has_errors
    from lptrain.config.layers import check_composed
    from lptrain.config.world import World

    # The job's rank count: the data-parallel size is what tensor parallelism leaves of it
    # (World.for_config), and expert parallelism splits the experts over the world.
    world = replace(World.detect(ranks=world_size, target=target),
                    launcher="--nodes x --gpus-per-node").for_config(composed.cfg)
    violations = check_composed(composed, world) + launch_violations(composed.cfg, world_size)
    if violations:
        with contextlib.redirect_stdout(sys.stderr):
            report_violations(violations, Path(recipe).name, world, as_json=False)
    if has_errors(violations):
        typer.echo("not rendered: fix the errors above for this world", err=True)
        raise typer.Exit(1)
