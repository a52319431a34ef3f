"""What every ``lptrain`` subcommand shares: option types and help texts, loading a recipe,
the world a config is checked for, and the violations report.

Public so the subcommand modules (``slurm``, ``estimate-memory``, ...) import it instead of
reaching into the module that builds the Typer app: the app imports the subcommands, never
the other way round. Importing this module stays light (typer only); the config package,
rich and everything else are imported inside the functions.
"""

from __future__ import annotations

import enum
import json
import os
import sys
from typing import TYPE_CHECKING, Optional

import typer

from lptrain.config.compose import DEFAULT_RECIPE

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from lptrain.config.compose import Composed
    from lptrain.config.rules import Violation
    from lptrain.config.world import World


class Target(str, enum.Enum):
    """Hardware a config is checked for."""

    cpu = "cpu"
    sm89 = "sm89"
    sm90 = "sm90"
    sm100 = "sm100"
    sm120 = "sm120"


RECIPE_HELP = (
    "Recipe YAML: a bare name (mxfp8_muon.yaml) is looked up in ./recipes, then the "
    "repo's recipes/; anything with a '/' is a path."
)
OVERRIDES_HELP = "Overrides as dotted key=value (e.g. model.num_layers=4 precision.fp8_format=e4m3); last wins."
DP_HELP = ("Data-parallel size to check for; the world is tensor x context x pipeline parallel "
           "size x it (default: $WORLD_SIZE ranks, or 1 data-parallel rank).")
TARGET_HELP = (
    "Hardware to check for (a GPU target assumes CUDA and a recent Transformer Engine); "
    "default: this machine."
)
TE_HELP = "Transformer Engine version to assume (default: installed, or recent with --target)."
CUDA_HELP = (
    "CUDA (and cuBLAS) version to assume (default: torch's build, or 13.3 with --target); "
    "TE's grouped-tensor path needs cuBLASLt 13.3+, blockwise FP8 CUDA 12.9+."
)

RecipeOpt = typer.Option(DEFAULT_RECIPE, "--recipe", "-r", help=RECIPE_HELP)
OverridesArg = typer.Argument(None, help=OVERRIDES_HELP, show_default=False)
DpOpt = typer.Option(None, "--dp", min=1, help=DP_HELP)
TargetOpt = typer.Option(None, "--target", help=TARGET_HELP, case_sensitive=False)
TeOpt = typer.Option(None, "--te-version", help=TE_HELP)
CudaOpt = typer.Option(None, "--cuda-version", help=CUDA_HELP)


def console(stderr: bool = False) -> Console:
    """A rich console: the terminal's width on a terminal, ``$COLUMNS`` (default 160) else."""
    from rich.console import Console

    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "160"))
    return Console(stderr=stderr, width=width, highlight=False)


def load_recipe(recipe: str, overrides: Optional[list[str]]) -> Composed:
    """The composed recipe; a :class:`~lptrain.config.errors.ConfigError` becomes
    ``error: ...`` and exit status 2 (:mod:`lptrain.cli.errors`)."""
    from lptrain.config.compose import load

    return load(recipe, overrides or [])


def detect_world(dp: Optional[int], target: Optional[Target], te_version: Optional[str],
                 cuda_version: Optional[str] = None, ranks: Optional[int] = None) -> World:
    """The world to check for: this machine unless ``--dp``/``--target``/``--te-version``/
    ``--cuda-version`` say (``ranks``: a launch's rank count, e.g. ``--nproc-per-node``).
    ``--dp`` is the data-parallel size: the world is the model-parallel sizes times it
    (:meth:`World.for_config`)."""
    from lptrain.config.world import World, check_version

    if cuda_version is not None:
        cuda_version = check_version(cuda_version, key="--cuda-version")
    return World.detect(dp=dp, target=target.value if target else None, te_version=te_version,
                        cuda_version=cuda_version, ranks=ranks)


def violations_table(violations: list[Violation], title: str) -> Table:
    """One row per violation: rule id, severity, keys, message, fix."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(title), show_lines=True, title_justify="left")
    table.add_column("rule", style="bold", no_wrap=True)
    table.add_column("severity", no_wrap=True)
    for col in ("keys", "message", "fix"):
        table.add_column(col, overflow="fold")
    for v in violations:
        sev = "[red]error[/red]" if v.severity == "error" else "[yellow]warning[/yellow]"
        table.add_row(v.rule, sev, escape("\n".join(v.keys)), escape(v.message), escape(v.fix))
    return table


def report_violations(violations: list[Violation], name: str, world: World, as_json: bool) -> int:
    """Print the validate-config report (table and verdict, or JSON); returns the exit
    status it stands for: 1 when any violation is an error, else 0."""
    from rich.markup import escape

    from lptrain.config.check import has_errors

    errors = has_errors(violations)
    if as_json:
        payload = {"valid": not errors, "violations": [v.to_dict() for v in violations]}
        typer.echo(json.dumps(payload, indent=2))
        return 1 if errors else 0
    where = f"target {world.target}, dp {world.dp}"
    if world.ranks is not None and world.ranks != world.dp:  # model parallelism: say the world too
        where += f", {world.ranks} ranks"
    n_err = sum(v.severity == "error" for v in violations)
    n_warn = len(violations) - n_err
    out = console()
    if violations:
        out.print(violations_table(violations, f"{name} ({where})"))
    name = escape(name)
    if errors:
        out.print(f"[red]{name}: invalid[/red] ({n_err} error(s), {n_warn} warning(s); {where})")
    else:
        out.print(f"[green]{name}: valid[/green] ({n_warn} warning(s); {where})")
    return 1 if errors else 0
