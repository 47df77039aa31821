"""Printing: names from files reach the terminal escaped."""

from __future__ import annotations

import click

from .._text import shown


def echo(message: str, *, err: bool = False) -> None:
    """One line on stdout (or stderr), escaped; ``--json`` output goes to click.echo unescaped (JSON escapes)."""
    click.echo(shown(message), err=err)


def say(quiet: bool, message: str) -> None:
    """A progress or result line on stderr, unless ``--quiet``."""
    if not quiet:
        echo(message, err=True)


def printable(text: str) -> str:
    """``text`` with control and invisible characters escaped (names come from the file)."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)
