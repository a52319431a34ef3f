"""Schema field helpers: a field's default, its one-line documentation and its allowed values.

Every field of :mod:`lptrain.config.schema` is declared with one of these, so its help text
(``--help``, ``show-config --explain``) and, for a choice key, the one declaration of its
allowed values (read through :func:`lptrain.config.schema.choices_of`) live in the field's
metadata.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any


def opt(default: Any, help: str) -> Any:
    """A dataclass field with a scalar default and its one-line documentation."""
    return field(default=default, metadata={"help": help})


def opt_factory(factory: Any, help: str) -> Any:
    """A dataclass field with a mutable default (list, nested section) and its documentation."""
    return field(default_factory=factory, metadata={"help": help})


def show_value(value: Any) -> str:
    """A config value as a user writes it (``None`` is ``null``)."""
    return "null" if value is None else str(value)


def one_of(values: Sequence[Any], notes: Mapping[Any, str] | None = None, last: str = "or") -> str:
    """``a, b or c`` (each value followed by its note in parentheses, when it has one)."""
    notes = notes or {}
    shown = [show_value(v) + (f" ({notes[v]})" if notes.get(v) else "") for v in values]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} {last} {shown[-1]}"


def choice(default: Any, values: Sequence[Any], help: str,
           notes: Mapping[Any, str] | None = None) -> Any:
    """A field that takes one of ``values``: the one declaration of them. ``help`` names the
    place of the list as ``{choices}``; ``notes`` explain single values there."""
    return field(default=default, metadata={
        "help": help.format(choices=one_of(values, notes)), "choices": tuple(values)})
