"""The one error hierarchy: every expected failure is an :class:`LPTrainError`.

Why one type: the command line turns any of them into a single ``error: ...`` line on stderr
and the documented exit status, without a traceback (``--debug`` or ``LPTRAIN_DEBUG=1`` show
it). Anything else that escapes a command is a bug and is reported as one.

Exit statuses (also in the README):

====  ==========================================================================
0     success (``validate-config``: valid, warnings allowed)
1     rule violations (the config is readable but breaks the rule catalog)
2     unreadable input: recipe, override, data, tokenizer, output folder, device
3     a run that started and failed: divergence, a rank's failure
130   interrupted (SIGINT / Ctrl-C); 143 terminated (SIGTERM)
70    an unexpected internal error (a bug: the traceback is printed)
====  ==========================================================================

Importing this module imports nothing heavy (the validate path stays torch-free).
"""

from __future__ import annotations

from typing import ClassVar, Optional

EXIT_OK = 0
EXIT_RULES = 1
EXIT_INPUT = 2
EXIT_RUN_FAILED = 3
EXIT_INTERNAL = 70  # sysexits.h EX_SOFTWARE: not one of the documented failure kinds
EXIT_SIGINT = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_SIGTERM = 143  # 128 + SIGTERM


def _one_line(text: str) -> str:
    """Collapse a message onto one line (the CLI promises exactly one line per error)."""
    return " ".join(str(text).split())


class LPTrainError(Exception):
    """An expected failure with what went wrong, where (key, file, line) and how to fix it.

    ``message`` says what is wrong; ``file`` (optionally with ``line``) and ``key`` say where,
    and are prefixed to the rendered line unless the message already names them; ``fix`` is
    appended as ``; fix: ...``. ``str(err)`` is the one line the CLI prints after ``error:``.
    """

    exit_code: ClassVar[int] = EXIT_INPUT
    # Raised alike on every rank after the ranks agreed on it (a failed save, a NaN step): in a
    # multi-rank run only rank 0 prints it (lptrain.cli.errors), so the job says it once.
    every_rank: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        key: Optional[str] = None,
        file: Optional[str] = None,
        line: Optional[int] = None,
        fix: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.key = key
        self.file = None if file is None else str(file)
        self.line = line
        self.fix = fix

    def where(self) -> str:
        """``file:line`` (or ``file``, or ``key``) when known and not already in the message."""
        if self.file and self.file not in self.message:
            return f"{self.file}:{self.line}" if self.line else self.file
        if not self.file and self.key and self.key not in self.message:
            return self.key
        return ""

    def __str__(self) -> str:
        where = self.where()
        text = f"{where}: {self.message}" if where else self.message
        if self.fix and self.fix not in text:
            text = f"{text}; fix: {self.fix}"
        return _one_line(text)


class InputError(LPTrainError):
    """Input that cannot be read or used: recipe, override, data, tokenizer (exit 2)."""

    exit_code: ClassVar[int] = EXIT_INPUT


class OutputDirError(LPTrainError):
    """The run folder cannot be created or written (exit 2)."""

    exit_code: ClassVar[int] = EXIT_INPUT


class DeviceError(LPTrainError):
    """The requested device or backend is not usable on this machine (exit 2)."""

    exit_code: ClassVar[int] = EXIT_INPUT


class RunFailedError(LPTrainError):
    """A run that started and then failed: divergence, a rank's failure (exit 3)."""

    exit_code: ClassVar[int] = EXIT_RUN_FAILED


__all__ = [
    "EXIT_INPUT",
    "EXIT_INTERNAL",
    "EXIT_OK",
    "EXIT_RULES",
    "EXIT_RUN_FAILED",
    "EXIT_SIGINT",
    "EXIT_SIGTERM",
    "DeviceError",
    "InputError",
    "LPTrainError",
    "OutputDirError",
    "RunFailedError",
]
