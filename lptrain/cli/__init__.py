"""lptrain's command line (Typer): ``lptrain`` and ``python -m lptrain``.

* :mod:`lptrain.cli.app` builds the app: the root group and the commands, in help order;
* :mod:`lptrain.cli.common`: what the commands share (options, help texts, loading a recipe,
  the violations report), public so that command modules never import the app module;
* one module per command (or group of commands): :mod:`~lptrain.cli.config_commands`
  (validate-config, show-config, rules), :mod:`~lptrain.cli.pretrain`,
  :mod:`~lptrain.cli.slurm`, :mod:`~lptrain.cli.plot`, :mod:`~lptrain.cli.estimate_memory`;
  ``prepare-data`` and ``export`` register themselves from :mod:`lptrain.data.commands` and
  :mod:`lptrain.interop.command`, which know nothing of this package;
* :mod:`lptrain.cli.errors`: one error surface (``error: ...`` and the documented exit
  status) for every command; :mod:`lptrain.cli.preflight`: pretrain's start-up checks.

Commands are thin: their logic lives in the packages below.
"""

from lptrain.cli.app import app, main

__all__ = ["app", "main"]
