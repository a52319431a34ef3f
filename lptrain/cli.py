"""lptrain command line (Typer). Commands are thin: their logic lives in the packages.

The validate path (``validate-config``, ``show-config``, ``rules`` and the checks at the
start of ``pretrain``) imports only the config package, OmegaConf, YAML and rich; torch and
the training code are imported after the config is known to be valid.
"""

from __future__ import annotations

import enum
import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from lptrain.cli_errors import LPTrainGroup, root_callback
from lptrain.config.compose import DEFAULT_RECIPE

app = typer.Typer(
    cls=LPTrainGroup,  # one error surface: `error: ...` + documented exit status (lptrain.errors)
    help="lptrain: low-precision LLM pretraining (FP8, MXFP8, blockwise FP8, NVFP4, Muon, MoE) "
    "with every flag combination validated before a GPU is touched.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)
app.callback()(root_callback)  # --debug (anywhere on the line) shows tracebacks


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
DP_HELP = "Data-parallel size to check for (default: $WORLD_SIZE or 1)."
TARGET_HELP = (
    "Hardware to check for (a GPU target assumes CUDA and a recent Transformer Engine); "
    "default: this machine."
)
TE_HELP = "Transformer Engine version to assume (default: installed, or recent with --target)."

RecipeOpt = typer.Option(DEFAULT_RECIPE, "--recipe", "-r", help=RECIPE_HELP)
OverridesArg = typer.Argument(None, help=OVERRIDES_HELP, show_default=False)
DpOpt = typer.Option(None, "--dp", min=1, help=DP_HELP)
TargetOpt = typer.Option(None, "--target", help=TARGET_HELP, case_sensitive=False)
TeOpt = typer.Option(None, "--te-version", help=TE_HELP)


def _console(stderr: bool = False):  # -> rich.console.Console
    from rich.console import Console

    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "160"))
    return Console(stderr=stderr, width=width, highlight=False)


def _fail_input(message: str) -> typer.Exit:
    """Unreadable input: one clear line on stderr, exit status 2, no traceback."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def _load(recipe: str, overrides: Optional[list[str]]):  # -> Composed
    from lptrain.config.compose import load

    return load(recipe, overrides or [])  # a ConfigError becomes `error: ...`, exit 2 (cli_errors)


def _world(dp: Optional[int], target: Optional[Target], te_version: Optional[str]):  # -> World
    from lptrain.config.world import World

    return World.detect(dp=dp, target=target.value if target else None, te_version=te_version)


def _violations_table(violations: list, title: str):  # -> rich.table.Table
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


def _report(violations: list, name: str, world, as_json: bool) -> int:
    from rich.markup import escape

    from lptrain.config.check import has_errors

    errors = has_errors(violations)
    if as_json:
        payload = {"valid": not errors, "violations": [v.to_dict() for v in violations]}
        typer.echo(json.dumps(payload, indent=2))
        return 1 if errors else 0
    where = f"target {world.target}, dp {world.dp}"
    n_err = sum(v.severity == "error" for v in violations)
    n_warn = len(violations) - n_err
    console = _console()
    if violations:
        console.print(_violations_table(violations, f"{name} ({where})"))
    name = escape(name)
    if errors:
        console.print(f"[red]{name}: invalid[/red] ({n_err} error(s), {n_warn} warning(s); {where})")
    else:
        console.print(f"[green]{name}: valid[/green] ({n_warn} warning(s); {where})")
    return 1 if errors else 0


@app.command("validate-config")
def validate_config(
    overrides: Optional[list[str]] = OverridesArg,
    recipe: str = RecipeOpt,
    dp: Optional[int] = DpOpt,
    target: Optional[Target] = TargetOpt,
    te_version: Optional[str] = TeOpt,
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable JSON report."),
) -> None:
    """Check a recipe (plus overrides) against every rule and report all violations.

    Exit status: 0 valid (warnings allowed), 1 errors, 2 unreadable input.
    """
    from lptrain.config.check import check

    composed = _load(recipe, overrides)
    world = _world(dp, target, te_version)
    violations = check(composed.cfg, world)
    raise typer.Exit(_report(violations, Path(recipe).name, world, as_json))


@app.command("show-config")
def show_config(
    overrides: Optional[list[str]] = OverridesArg,
    recipe: str = RecipeOpt,
    diff: bool = typer.Option(False, "--diff", help="Only values that differ from the schema defaults."),
    explain: bool = typer.Option(False, "--explain", help="Append each key's help text as a comment."),
    dp: Optional[int] = DpOpt,
    target: Optional[Target] = TargetOpt,
    te_version: Optional[str] = TeOpt,
) -> None:
    """Print the resolved config as YAML, after derived values are filled in."""
    from lptrain.config.derive import derive
    from lptrain.config.render import config_yaml

    composed = _load(recipe, overrides)
    cfg = derive(composed.cfg, _world(dp, target, te_version))
    typer.echo(config_yaml(cfg, only_diff=diff, explain=explain), nl=False)


@app.command("pretrain")
def pretrain(
    overrides: Optional[list[str]] = OverridesArg,
    recipe: str = RecipeOpt,
    output_dir: Optional[str] = typer.Option(
        None, "--output-dir", "-o", help="Run folder (default: run.output_dir of the recipe)."
    ),
    dp: Optional[int] = DpOpt,
    target: Optional[Target] = TargetOpt,
    te_version: Optional[str] = TeOpt,
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
    from lptrain.config.check import check, has_errors
    from lptrain.config.derive import derive
    from lptrain.config.render import config_yaml

    all_overrides = list(overrides or [])
    if output_dir is not None:
        all_overrides.append(f"run.output_dir={output_dir}")
    composed = _load(recipe, all_overrides)
    from lptrain.launch.local import launch_local, world_from_env

    rank, env_world, _ = world_from_env()
    spawn = nproc_per_node > 1 and env_world == 1 and not dry_run
    world = _world(dp or (nproc_per_node if spawn else None), target, te_version)
    violations = check(composed.cfg, world)
    if has_errors(violations):
        _report(violations, Path(recipe).name, world, as_json=False)
        _console().print("[red]refusing to start: fix the errors above[/red]")
        raise typer.Exit(1)
    if violations and rank == 0:
        _report(violations, Path(recipe).name, world, as_json=False)
    if spawn:  # validated for the real world size; each rank runs this command again
        args = ["pretrain", "--recipe", recipe, *(overrides or [])]
        if output_dir is not None:
            args += ["--output-dir", output_dir]
        if target is not None:
            args += ["--target", target.value]
        if te_version is not None:
            args += ["--te-version", te_version]
        if overwrite:
            args.append("--overwrite")
        raise typer.Exit(launch_local(nproc_per_node, args))
    cfg = derive(composed.cfg, world)
    out = Path(cfg.run.output_dir)
    from lptrain import preflight
    from lptrain.train.run_dir import check_output_dir

    if rank != 0:  # rank 0 owns the run folder; the others only train
        from lptrain.train import pretrain as run_pretrain

        run_pretrain(cfg, out, **({"overwrite": True} if overwrite else {}))
        return
    check_output_dir(cfg, out, overwrite)  # resume, or refuse a folder holding another run (exit 2)
    if dry_run:
        preflight.check_output_dir(out)
        for line in preflight.dry_run(cfg, world).lines():
            typer.echo(line)
        raise typer.Exit(0)
    preflight.prepare_output_dir(out)  # OutputDirError (exit 2) before anything is written
    preflight.write_text(out / "resolved_config.yaml", config_yaml(cfg))
    typer.echo(f"wrote {out / 'resolved_config.yaml'}")
    try:
        from lptrain.train import pretrain as run_pretrain
    except ImportError as e:
        typer.echo(f"training loop not available in this build ({e}); config written, not training")
        raise typer.Exit(0) from None
    run_pretrain(cfg, out, **({"overwrite": True} if overwrite else {}))


@app.command("rules")
def rules(
    markdown: bool = typer.Option(
        False, "--markdown", help="Print the docs/rules.md page generated from the rule list."
    ),
) -> None:
    """List the configuration rule catalog (ids, severities, keys, conditions)."""
    from lptrain.config.render import rules_markdown
    from lptrain.config.rules import all_rules

    if markdown:
        typer.echo(rules_markdown(), nl=False)
        return
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="lptrain configuration rules", show_lines=True, title_justify="left")
    table.add_column("rule", no_wrap=True)
    table.add_column("severity", no_wrap=True)
    table.add_column("keys", overflow="fold")
    table.add_column("condition -> requirement", overflow="fold")
    for r in all_rules():
        table.add_row(r.id, r.severity, escape("\n".join(r.keys)), escape(r.condition))
    _console().print(table)


try:  # prepare-data lives with the data pipeline; the CLI works without it.
    from lptrain.data.commands import register as register_data
except ImportError:  # pragma: no cover - depends on which packages are present
    register_data = None
if register_data is not None:
    register_data(app)

from lptrain.launch.slurm import register as register_slurm  # noqa: E402  (lptrain slurm)

register_slurm(app)

from lptrain.plot_command import register as register_plot  # noqa: E402  (lptrain plot RUN_DIR)

register_plot(app)

from lptrain.memory.command import register as register_memory  # noqa: E402  (estimate-memory)

register_memory(app)

from lptrain.interop.command import register as register_export  # noqa: E402  (lptrain export)

register_export(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
