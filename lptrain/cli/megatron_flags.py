"""Megatron-LM's flags on lptrain's command line: ``--tensor-model-parallel-size 2`` is read
as the override ``model.tensor_model_parallel_size=2``, with one note saying so.

Why accept them: a Megatron user types them from habit, and Typer's "No such option" named
nothing they could use. A flag is read as a key only by the commands that take overrides
(``pretrain``, ``validate-config``, ...), only when it is not one of the command's own options,
and only when it names an lptrain key (:func:`lptrain.config.aliases.key_for`); any other
flag is left to Typer's usual error. A flag for a boolean key takes no value (``--sequence-parallel``,
``--no-sequence-parallel``), as Megatron's ``store_true`` flags; the others take the next word
or ``--flag=value``.
"""

from __future__ import annotations

from typing import Any, Optional

import click

OVERRIDES_PARAM = "overrides"


def _own_options(command: click.Command) -> set[str]:
    opts = {"--help"}
    for p in command.params:
        opts.update(getattr(p, "opts", ()))
        opts.update(getattr(p, "secondary_opts", ()))
    return opts


def _is_bool(key: str) -> bool:
    from lptrain.config.rules import get_key
    from lptrain.config.schema import LPTrainConfig

    return isinstance(get_key(LPTrainConfig(), key), bool)


def _flag_key(name: str) -> Optional[tuple[str, Optional[str]]]:
    """``(key, fixed value)`` a flag (without ``--``) stands for: the value is set for flags
    that take none (boolean keys, ``--no-X``, :data:`~lptrain.config.aliases.FIXED`)."""
    from lptrain.config.aliases import FIXED, key_for
    from lptrain.config.compose import all_keys

    name = name.replace("-", "_")
    if name in FIXED:
        return FIXED[name]
    key = key_for(name, all_keys())
    if key is not None:
        return key, "true" if _is_bool(key) else None
    if name.startswith("no_"):
        key = key_for(name[3:], all_keys())
        if key is not None and _is_bool(key):
            return key, "false"
    return None


def translate(command: click.Command, args: list[str]) -> tuple[list[str], list[str]]:
    """``args`` (a command's own arguments) with every Megatron-LM flag for an lptrain key
    turned into ``key=value``; and the notes saying which."""
    if not any(getattr(p, "name", None) == OVERRIDES_PARAM for p in command.params):
        return args, []
    own = _own_options(command)
    out: list[str] = []
    notes: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            out += args[i - 1:]
            break
        flag, eq, inline = arg.partition("=")
        found = _flag_key(flag[2:]) if flag.startswith("--") and flag not in own else None
        if found is None:
            out.append(arg)
            continue
        key, value = found
        if value is None or eq:
            if eq:
                value = inline
            elif i < len(args):
                value, i = args[i], i + 1
            else:
                out.append(arg)  # no value: Typer's error
                continue
        typed = f"{arg} {args[i - 1]}" if value is not None and not eq and found[1] is None else arg
        out.append(f"{key}={value}")
        notes.append(f"note: {typed} is Megatron-LM's flag: read as {key}={value}")
    return out, notes


def translate_command_line(group: click.Group, ctx: Any, args: list[str]) -> list[str]:
    """The root group's ``args`` with the subcommand's Megatron-LM flags translated; the notes
    go to stderr."""
    first = next((i for i, a in enumerate(args) if not a.startswith("-")), None)
    if first is None:
        return args
    command = group.get_command(ctx, args[first])
    if command is None:
        return args
    rest, notes = translate(command, args[first + 1:])
    for note in notes:
        click.echo(note, err=True)
    return [*args[:first + 1], *rest]
