"""Error mapping: the one place library errors and interruptions meet the terminal.

Library errors become a one-line message and exit code 1 (:class:`Group`); usage errors one line too,
and exit 2, as do an output that exists (``OutputExistsError``) and a destination that contradicts the
options (``DestinationError``); Ctrl-C and SIGTERM exit 130 and 143. Set ``CKPTCONV_DEBUG=1`` to see tracebacks.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

import click
import cloup

from ckptconv.batching.report import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_NEGATIVE, EXIT_TERMINATED, EXIT_USAGE
from ckptconv.cli.terminal import echo, shortened

EXIT_CODES_HELP = """\b
Exit codes:
    0  success
    1  the operation failed (bad input, unsafe file, cannot write, ...)
    2  usage error (unknown option, invalid regular expression, an output
       that exists without --overwrite, ...)
    3  finished with a negative result (verify/diff found differences,
       fit found no plan, batch items failed, scan found files that are
       not safe: foreign, damaged, not a checkpoint)
    4  scan found at least one unsafe file, or batch an unsafe item
  130  interrupted (Ctrl-C); partial outputs are removed
  143  terminated (SIGTERM); partial outputs are removed"""


class Command(cloup.Command):
    """Every ckptconv command: ``--verify`` takes its reader only as ``--verify=NAME`` or a reader's name; its
    options in the help's sections; its whole first sentence as its summary in ``ckptconv --help``."""

    def get_short_help_str(self, limit: int = 45) -> str:
        return (self.help or "").strip().split("\n\n")[0].replace("\n", " ") or super().get_short_help_str(limit)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # `--verify` takes an optional value (`--verify=torch`); click would take the next
        # word (`--verify SRC DST`) as that value. Only a reference's name is one.
        from ckptconv.options import REFERENCES

        args = [
            "--verify=ckptconv" if arg == "--verify" and (i + 1 == len(args) or args[i + 1] not in REFERENCES) else arg
            for i, arg in enumerate(args)
        ]
        return super().parse_args(ctx, args)


class UsageError(click.UsageError):
    """A usage error shown as every other error is, on one line, with where to find the usage:
    click's own shows three (the usage, a hint, a blank line) before the message."""

    def show(self, file: Any = None) -> None:
        where = f"; see '{self.ctx.command_path} --help'" if self.ctx is not None else ""
        message = shortened(self.format_message())
        # A message of several lines (one per option that differs) is printed line by line, each escaped.
        *lines, last = f"ckptconv: error: {message}".split("\n")
        for line in lines:
            echo(line, err=True)
        echo(f"{last.removesuffix('.') if where else last}{where}", err=True)


# `ckptconv` (or a group's command) run with no arguments: click shows the help, which is no error to shorten.
_HELP_SHOWN: tuple[type[click.UsageError], ...] = tuple(
    kind for kind in (getattr(click.exceptions, "NoArgsIsHelpError", None),) if kind is not None
)


def _one_line(error: click.UsageError) -> click.UsageError:
    """``error`` as a :class:`UsageError` (exit code 2, as every click usage error), unless it is one
    already or the help that click shows instead."""
    if isinstance(error, (UsageError, *_HELP_SHOWN)):
        return error
    return UsageError(error.format_message(), error.ctx)


class Group(cloup.Group):
    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.exceptions.NoSuchCommand as error:
            # click suggests by spelling alone ('convrt'); a command's first part counts too ('strip').
            import difflib

            name = error.command_name or ""
            close = [command for command in self.commands if command.split("-")[0] == name or command.startswith(name)]
            close += [c for c in difflib.get_close_matches(name, list(self.commands)) if c not in close]
            if not close:
                raise
            suggested = " or ".join(repr(command) for command in close[:3])
            raise UsageError(f"No such command {name!r}. Did you mean {suggested}?", ctx) from None

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as error:  # the command line's own options (`ckptconv --bogus`)
            raise _one_line(error) from None

    def invoke(self, ctx: click.Context) -> Any:
        from ckptconv.errors import CkptconvError, DestinationError, FitError, OutputExistsError, interruption

        transaction = sys.modules.get("ckptconv.writing.transaction")  # not imported for --help
        if transaction is not None:
            transaction.published_outputs(forget=True)  # an interruption names only what this command published
        try:
            return super().invoke(ctx)
        except click.UsageError as error:  # a command's options and arguments
            raise _one_line(error) from None
        except DestinationError as error:  # the options contradict DST: a usage error, exit 2
            if os.environ.get("CKPTCONV_DEBUG"):
                raise
            name = ctx.invoked_subcommand
            command = self.get_command(ctx, name) if name else None
            usage = click.Context(command, info_name=name, parent=ctx) if command else ctx
            raise UsageError(str(error), usage) from None
        except CkptconvError as error:
            if os.environ.get("CKPTCONV_DEBUG"):
                raise
            interrupt = interruption(error) or received_interruption()
            if interrupt is not None:
                # An error raised while Ctrl-C or SIGTERM unwound the work (a worker thread's read of a
                # file the unwinding had closed) is a consequence of the interruption, not the failure.
                _interrupted(ctx, interrupt)
            echo(f"ckptconv: error: {shortened(error)}", err=True)
            # A fit that cannot be made is a negative result with a report, not a failure.
            if isinstance(error, FitError) and error.report is not None:
                for line in error.report.details():
                    echo(f"  {line}", err=True)
                ctx.exit(EXIT_NEGATIVE)
            # An output that exists without --overwrite: a usage error (the README's table), its line as it is.
            ctx.exit(EXIT_USAGE if isinstance(error, OutputExistsError) else EXIT_FAILED)
        except KeyboardInterrupt as interrupt:
            if os.environ.get("CKPTCONV_DEBUG"):
                raise
            _interrupted(ctx, interrupt)
        except Exception as error:
            # Any error raised once Ctrl-C or SIGTERM came is its consequence: an import that Ctrl-C cut
            # short inside a C extension's initialisation (numpy's) fails the next time anything imports
            # the module ("cannot load module more than once per process"), with no trace of the
            # KeyboardInterrupt, which that initialisation swallowed.
            cause = interruption(error) or received_interruption()
            # (click's own exits, such as an interrupted batch's exit 130, pass through as they are.)
            if cause is None or isinstance(error, (click.exceptions.Exit, click.ClickException)):
                raise
            if os.environ.get("CKPTCONV_DEBUG"):
                raise
            _interrupted(ctx, cause)


def _interrupted(ctx: click.Context, interrupt: KeyboardInterrupt) -> NoReturn:
    """Say the command was interrupted (its partial outputs are gone) and exit 130, or 143 for SIGTERM."""
    transaction = sys.modules.get("ckptconv.writing.transaction")
    published = transaction.published_outputs() if transaction is not None else ()  # a folder output, published whole
    written = f"{published[-1]!r} was written whole first" if published else "no output was written"
    echo(f"ckptconv: interrupted{signal_name(interrupt)}; {written}", err=True)
    ctx.exit(interrupted_code(interrupt))


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that it unwinds like Ctrl-C: every partial output is removed."""


# The interruptions the command line's handlers raised in this process (one, at most, that counts).
_RECEIVED: list[KeyboardInterrupt] = []


def received_interruption() -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM this process received, if any (see :func:`on_sigint`)."""
    return _RECEIVED[0] if _RECEIVED else None


def handle_signals() -> None:
    """Install the command line's handlers of Ctrl-C and SIGTERM (only the main thread may), and forget
    the interruptions of an earlier command run in this process."""
    import signal
    import threading

    _RECEIVED.clear()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, on_sigint)
        signal.signal(signal.SIGTERM, on_sigterm)


def on_sigint(signum: int, frame: Any) -> None:
    """Ctrl-C: KeyboardInterrupt, as Python's own handler raises it, remembered (C extensions and
    finalizers can swallow the exception; the failures that follow are still the interruption's)."""
    interrupt = KeyboardInterrupt()
    _RECEIVED.append(interrupt)
    raise interrupt


def on_sigterm(signum: int, frame: Any) -> None:
    interrupt = Terminated()
    _RECEIVED.append(interrupt)
    raise interrupt


def on_unraisable(unraisable: Any) -> None:
    """``sys.unraisablehook``: an interruption raised where it cannot propagate is sent again.

    A signal handler's exception raised inside a finalizer or a weakref callback (an import's module
    lock, torch's) cannot leave it: Python printed it ("Exception ignored in ...", a traceback) and
    went on, and the command finished as if never interrupted. The signal is sent again from a
    thread once the main thread has left this hook (raised from here, the exception would end in
    this hook, as unraisable as before): a fixed delay was not enough, as on a busy machine the main
    thread could still be inside this hook's own ``Thread.start()`` when the signal came. Other
    unraisable errors go to Python's hook.
    """
    import signal
    import sys
    import threading

    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        signum = signal.SIGTERM if isinstance(unraisable.exc_value, Terminated) else signal.SIGINT
        threading.Thread(target=_send_again, args=(signum,), name="ckptconv-resignal", daemon=True).start()
        return
    sys.__unraisablehook__(unraisable)


def _in_the_hook(thread_id: int) -> bool:
    """True while the thread ``thread_id`` runs :func:`on_unraisable` (or is about to, or just did)."""
    import sys

    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code is on_unraisable.__code__:
            return True
        frame = frame.f_back
    return False


def _send_again(signum: int) -> None:
    import threading
    import time

    main = threading.main_thread().ident
    while True:
        time.sleep(0.001)  # past the callback the first one could not leave
        if main is None or not _in_the_hook(main):
            break
    os.kill(os.getpid(), signum)


def signal_name(interrupt: BaseException) -> str:
    return " (SIGTERM)" if isinstance(interrupt, Terminated) else ""


def interrupted_code(interrupt: BaseException) -> int:
    """128 + the signal's number, as shells report it: 130 for Ctrl-C, 143 for SIGTERM."""
    return EXIT_TERMINATED if isinstance(interrupt, Terminated) else EXIT_INTERRUPTED
