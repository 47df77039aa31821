"""The ``ckptconv`` command: a thin layer over the library.

Each command parses its options, makes one library call, and prints the report. The package is split by
job: :mod:`.failures` maps errors and interruptions to exit codes in one place, :mod:`.params` and
:mod:`.option_sets` turn flags into a :class:`~ckptconv.options.ConversionOptions`, :mod:`.converting`
holds the commands that write and :mod:`.examining` those that only read.
"""

from __future__ import annotations

from collections.abc import Sequence

import click
import cloup

from ckptconv._version import __version__
from ckptconv.cli.adapting import extract_lora, merge_lora
from ckptconv.cli.converting import add_module, batch, convert, fit, strip_module
from ckptconv.cli.examining import diff, inspect, scan, verify
from ckptconv.cli.failures import EXIT_CODES_HELP, Group, handle_signals, on_unraisable


@click.group(
    cls=Group,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=EXIT_CODES_HELP,
    # The commands in the order of the work: look, convert, check.
    sections=[
        cloup.Section("Look at checkpoints", [inspect, scan]),
        cloup.Section("Convert", [convert, strip_module, add_module, fit, batch, merge_lora, extract_lora]),
        cloup.Section("Check a conversion", [verify, diff]),
    ],
)
@click.version_option(__version__, "--version", prog_name="ckptconv")
def cli() -> None:
    """Open any PyTorch checkpoint safely on the CPU and convert it.

    Nothing in a checkpoint is ever executed: classes from code you do not
    have become inert stand-ins, and files that reach for code-running
    functions are refused. GPU-saved files load on any machine, and every
    output is CPU-tagged.
    """


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``ckptconv`` console script and ``python -m ckptconv``.

    SIGTERM (``kill``, a job scheduler's time limit) is handled like Ctrl-C:
    partial outputs are removed and the exit code is 143 (130 for Ctrl-C).
    """
    import contextlib
    import gc
    import os
    import sys

    # ckptconv makes no BLAS calls, but importing numpy starts OpenBLAS's thread pool, whose
    # threads spin: 0.1 s of CPU per run on the 2-core VM, taken from the conversion's own threads
    # (bench/results/bench_convert_round3_2core_vm.md). Only the command line sets this: a
    # library caller's numpy is theirs to configure.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # What is alive now (modules, classes, click's commands) lives until exit: frozen, the cyclic
    # collector stops walking it each time a streaming cast's short-lived arrays and views set it
    # off (1 GiB to fp16 on the 2-core VM: 0.045 s less CPU, 0.025 s less wall, medians of 6).
    gc.freeze()
    # Names come from files: a console that cannot encode one (latin-1, Windows' cp1252) gets it as
    # \uXXXX, which --json output decodes back, instead of a UnicodeEncodeError traceback.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    handle_signals()
    from ckptconv.runtime import cores as _cores

    python_hook, sys.unraisablehook = sys.unraisablehook, on_unraisable
    try:
        with _cores.switching_often():  # the cast threads wait less for the GIL (see _cores)
            cli.main(args=list(argv) if argv is not None else None, prog_name="ckptconv")
    finally:
        sys.unraisablehook = python_hook


__all__ = ["cli", "main"]
