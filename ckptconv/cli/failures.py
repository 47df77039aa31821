"""Error mapping: the one place library errors and interruptions meet the terminal.

Library errors become a one-line message and exit code 1 (:class:`Group`); usage errors exit 2 through
click; Ctrl-C and SIGTERM exit 130 and 143. Set ``CKPTCONV_DEBUG=1`` to see tracebacks.
"""

from __future__ import annotations

import os
from typing import Any

import click

from ..report import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_NEGATIVE, EXIT_TERMINATED
from .terminal import echo, shortened

EXIT_CODES_HELP = """\b
Exit codes:
    0  success
    1  the operation failed (bad input, unsafe file, cannot write, ...)
    2  usage error (unknown option, invalid regular expression, ...)
    3  finished with a negative result (verify/diff found differences,
       fit found no plan, batch items failed, scan found files that are
       not safe: foreign, damaged, not a checkpoint)
    4  scan found at least one unsafe file
  130  interrupted (Ctrl-C); partial outputs are removed
  143  terminated (SIGTERM); partial outputs are removed"""


class Command(click.Command):
    """Every ckptconv command: ``--verify`` takes its reader only as ``--verify=NAME`` or a reader's name."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # `--verify` takes an optional value (`--verify=torch`); click would take the next
        # word (`--verify SRC DST`) as that value. Only a reference's name is one.
        from ..verification import REFERENCES

        args = [
            "--verify=ckptconv" if arg == "--verify" and (i + 1 == len(args) or args[i + 1] not in REFERENCES) else arg
            for i, arg in enumerate(args)
        ]
        return super().parse_args(ctx, args)


class Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        from ..errors import CkptconvError, DestinationError, FitError, interruption

        try:
            return super().invoke(ctx)
        except DestinationError as error:  # the options contradict DST: a usage error, exit 2
            if os.environ.get("CKPTCONV_DEBUG"):
                raise
            name = ctx.invoked_subcommand
            command = self.get_command(ctx, name) if name else None
            usage = click.Context(command, info_name=name, parent=ctx) if command else ctx
            raise click.UsageError(str(error), usage) from None
        except CkptconvError as error:
            if os.environ.get("CKPTCONV_DEBUG"):
                raise
            interrupt = interruption(error)
            if interrupt is not None:
                # An error raised while Ctrl-C or SIGTERM unwound the work (a worker thread's read of a
                # file the unwinding had closed) is a consequence of the interruption, not the failure.
                echo(f"ckptconv: interrupted{signal_name(interrupt)}; no output was written", err=True)
                ctx.exit(interrupted_code(interrupt))
            echo(f"ckptconv: error: {shortened(error)}", err=True)
            # A fit that cannot be made is a negative result with a report, not a failure.
            if isinstance(error, FitError) and error.report is not None:
                for line in error.report.details():
                    echo(f"  {line}", err=True)
                ctx.exit(EXIT_NEGATIVE)
            ctx.exit(EXIT_FAILED)
        except KeyboardInterrupt as interrupt:
            if os.environ.get("CKPTCONV_DEBUG"):
                raise
            echo(f"ckptconv: interrupted{signal_name(interrupt)}; no output was written", err=True)
            ctx.exit(interrupted_code(interrupt))


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that it unwinds like Ctrl-C: every partial output is removed."""


def on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def signal_name(interrupt: BaseException) -> str:
    return " (SIGTERM)" if isinstance(interrupt, Terminated) else ""


def interrupted_code(interrupt: BaseException) -> int:
    """128 + the signal's number, as shells report it: 130 for Ctrl-C, 143 for SIGTERM."""
    return EXIT_TERMINATED if isinstance(interrupt, Terminated) else EXIT_INTERRUPTED
