"""How the command line turns failures into one line and a documented exit status.

Every command (including those added by ``register(app)`` hooks) runs inside
:meth:`LPTrainGroup.invoke`, so one place decides what a failure looks like:

* an :class:`~lptrain.errors.LPTrainError` prints ``error: <one line>`` on stderr and exits
  with its ``exit_code`` (2 unreadable input, 3 a run that failed, ...); one that lists
  several independent problems (``lines``: each incompatible key of a resume) prints one
  ``error:`` line per problem; one that every rank of a multi-rank run raises alike
  (``every_rank``: a failed save, a NaN step) is printed by rank 0 only;
* Ctrl-C exits 130, SIGTERM 143, each with one line -- none for the SIGTERM with which a
  launcher stops a rank after another rank failed (that rank's line says what happened);
* a collective that failed because a peer rank died is one line ``rank N lost peer M``, exit 3,
  printed by the first rank of the launch to print any error only (the others, and the
  launcher, then say nothing: one failure, one line)
  (also when it arrives inside a ``BaseException`` such as torch's ``CheckpointException``);
  one that waited past ``dist.distributed_timeout_minutes`` is one line too, exit 3 -- none
  when the launcher's watchdog has already named the hung rank;
* anything else is a bug: its traceback, then one line asking for a bug report, exit 70 --
  a ``BaseException`` that is neither a signal nor an exit (torch's ``CheckpointException``)
  included.

``--debug`` (anywhere on the command line) or ``LPTRAIN_DEBUG=1`` adds the traceback to the
expected errors too. Typer's own exits (``typer.Exit``, ``typer.Abort``, usage errors) pass through.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import typer
from typer.core import TyperGroup

from lptrain.errors import EXIT_INTERNAL, EXIT_SIGINT, EXIT_SIGTERM, LPTrainError

DEBUG_META_KEY = "lptrain.debug"
DEBUG_ENV = "LPTRAIN_DEBUG"
DEBUG_HELP = "Show tracebacks for expected errors too (also LPTRAIN_DEBUG=1); may go anywhere."
BUG_REPORT = (
    "this is a bug in lptrain, not a problem with your input: please report it with the "
    "command line and the traceback above"
)


class TerminatedError(KeyboardInterrupt):
    """SIGTERM turned into an exception, so cleanup that handles Ctrl-C runs for it too."""


def debug_enabled(ctx: typer.Context | None = None) -> bool:
    env = os.environ.get(DEBUG_ENV, "").strip().lower()
    if env not in ("", "0", "false", "no", "off"):
        return True
    return bool(ctx is not None and ctx.meta.get(DEBUG_META_KEY))


def root_callback(
    ctx: typer.Context,
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Global options shared by every command."""
    if debug:
        ctx.meta[DEBUG_META_KEY] = True


def _raise_terminated(signum: int, frame: Any) -> None:
    raise TerminatedError()


@contextlib.contextmanager
def _sigterm_as_exception() -> Iterator[None]:
    """Turn SIGTERM into :class:`TerminatedError` while a command runs (main thread only, and
    only when nobody else installed a handler), restoring the previous handler afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _echo_err(text: str) -> None:
    typer.echo(text, err=True)


def _print_traceback(exc: BaseException) -> None:
    sys.stderr.flush()
    typer.echo("".join(traceback.format_exception(exc)).rstrip("\n"), err=True)


def _lost_peer(exc: BaseException) -> LPTrainError | None:
    """The one-line error when ``exc`` is a collective that failed because a peer rank died
    or did not answer within the timeout (:mod:`lptrain.launch.peers`), else None."""
    from lptrain.launch.peers import collective_timeout_error, lost_peer_error

    return lost_peer_error(exc) or collective_timeout_error(exc)


def _watchdog_spoke() -> bool:
    """This node's launcher named a hung rank and is stopping the job: its line is the job's."""
    from lptrain.distributed.progress import watchdog_fired

    return watchdog_fired()


def _other_rank() -> bool:
    """A rank other than 0 of a multi-rank run."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != 0


def _claim_the_word() -> bool:
    """Whether this rank is the first of its launch to print an error (:mod:`lptrain.launch.peers`)."""
    from lptrain.launch.peers import claim_the_word

    return claim_the_word()


def _stopped_for_a_peer() -> bool:
    from lptrain.launch.peers import peer_failed_first

    return peer_failed_first()


def _leave_with_the_job(status: int, limit_s: float = 60.0) -> None:
    """This rank's copy of an error every rank raised alike (``every_rank``): rank 0 prints it
    and exits, then the launcher ends this rank, silently (SIGTERM's default action). Exiting
    at once instead would let the launcher end rank 0 before it printed the error; after
    ``limit_s`` without a launcher (a world started by hand) this rank exits ``status``."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(0.1)
    raise typer.Exit(status)


class LPTrainGroup(TyperGroup):
    """The root command group: ``--debug`` anywhere, and one error surface for all commands."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        # `lptrain pretrain ... --debug` works like `lptrain --debug pretrain ...`: move the flag
        # in front of the subcommand (only before a `--`, after which everything is an argument).
        end = args.index("--") if "--" in args else len(args)
        head = args[:end]
        if "--debug" in head:
            head = [a for a in head if a != "--debug"]
            args = ["--debug", *head, *args[end:]]
        # Megatron-LM's flags for lptrain keys (--tensor-model-parallel-size 2) read as overrides
        from lptrain.cli.megatron_flags import translate_command_line

        return super().parse_args(ctx, translate_command_line(self, ctx, args))

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            with _sigterm_as_exception():
                return super().invoke(ctx)
        except (typer.Exit, typer.Abort, typer.TyperException):  # exits and usage errors
            raise
        except LPTrainError as exc:
            if exc.every_rank and _other_rank():  # rank 0 says it, once for the job
                _leave_with_the_job(exc.exit_code)
            if debug_enabled(ctx):
                _print_traceback(exc)
            _claim_the_word()  # a peer that then loses this rank says nothing more
            for line in getattr(exc, "lines", None) or [str(exc)]:
                _echo_err(f"error: {' '.join(str(line).split())}")
            raise typer.Exit(exc.exit_code) from None
        except TerminatedError as exc:
            if debug_enabled(ctx):
                _print_traceback(exc)
            if not _stopped_for_a_peer():  # the launcher's teardown after another rank failed
                _echo_err("error: terminated (SIGTERM)")
            raise typer.Exit(EXIT_SIGTERM) from None
        except KeyboardInterrupt as exc:
            if debug_enabled(ctx):
                _print_traceback(exc)
            _echo_err("error: interrupted (Ctrl-C)")
            raise typer.Exit(EXIT_SIGINT) from None
        except (SystemExit, GeneratorExit):
            raise
        except BaseException as exc:
            lost = _lost_peer(exc)
            if lost is not None:  # a peer rank died or hung: not a bug here, one line and exit 3
                if debug_enabled(ctx):
                    _print_traceback(exc)
                if not _watchdog_spoke() and _claim_the_word():  # one line for the job
                    _echo_err(f"error: {lost}")
                raise typer.Exit(lost.exit_code) from None
            _print_traceback(exc)
            summary = " ".join(f"{type(exc).__name__}: {exc}".split())
            _echo_err(f"error: internal error ({summary[:300]}); {BUG_REPORT}")
            raise typer.Exit(EXIT_INTERNAL) from None
