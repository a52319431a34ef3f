"""The one exception type for configuration input that cannot be read."""

from __future__ import annotations


class ConfigError(Exception):
    """Unreadable configuration input: missing recipe, YAML syntax error, unknown key, wrong type.

    The message is a single human-readable line (or a few) naming the file, line and dotted
    key where known; the CLI prints it as-is, without a traceback, and exits with status 2.
    Rule violations of a well-formed config are *not* ConfigErrors: they are collected by
    :func:`lptrain.config.check.check` and reported together.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message
