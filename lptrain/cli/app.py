"""The ``lptrain`` Typer app: the root group (``--debug``, one error surface) and every
command, registered in the order ``lptrain --help`` lists them.

The validate path (``validate-config``, ``show-config``, ``rules`` and the checks at the
start of ``pretrain``) imports only the config package, OmegaConf, YAML and rich; torch and
the training code are imported after the config is known to be valid. So every module
imported here stays light: the commands import their work inside their bodies.
"""

from __future__ import annotations

import typer

from lptrain.cli.config_commands import rules, show_config, validate_config
from lptrain.cli.errors import LPTrainGroup, root_callback
from lptrain.cli.estimate_memory import estimate_memory_cmd
from lptrain.cli.numerics import compare, numerics, replay
from lptrain.cli.plot import plot
from lptrain.cli.pretrain import pretrain
from lptrain.cli.slurm import slurm
from lptrain.data.commands import register as register_prepare_data
from lptrain.interop.command import register as register_export

app = typer.Typer(
    cls=LPTrainGroup,  # one error surface: `error: ...` + documented exit status (lptrain.errors)
    help="lptrain: low-precision LLM pretraining (FP8, MXFP8, blockwise FP8, NVFP4, Muon, MoE) "
    "with every flag combination validated before a GPU is touched.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)
app.callback()(root_callback)  # --debug (anywhere on the line) shows tracebacks

app.command("validate-config")(validate_config)
app.command("show-config")(show_config)
app.command("pretrain")(pretrain)
app.command("rules")(rules)
register_prepare_data(app)  # prepare-data lives with the data pipeline
app.command("slurm")(slurm)
app.command("plot")(plot)
app.command("numerics")(numerics)
app.command("compare")(compare)
app.command("replay")(replay)
app.command("estimate-memory")(estimate_memory_cmd)
register_export(app)  # export lives with the Hugging Face interop


def main() -> None:
    app()


if __name__ == "__main__":
    main()
