"""The exception type for configuration input that cannot be read (an ``InputError``)."""

from __future__ import annotations

from lptrain.errors import InputError


class ConfigError(InputError):
    """Unreadable configuration input: missing recipe, YAML syntax error, unknown key, wrong type.

    The message is one human-readable line naming the file, line and dotted key where known;
    the CLI prints it without a traceback and exits with status 2 (it is an
    :class:`lptrain.errors.InputError`). Rule violations of a well-formed config are *not*
    ConfigErrors: they are collected by :func:`lptrain.config.check.check` and reported
    together (exit 1).
    """
