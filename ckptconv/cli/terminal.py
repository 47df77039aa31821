"""Printing: names from files reach the terminal escaped."""

from __future__ import annotations

import click

from ckptconv._text import shown

#: The most characters of an error message that are printed. Values from a file are shortened where
#: the messages are made; this catches any that are not (a 2 MB tensor name made a 2 MB line).
MAX_ERROR_CHARS = 2000


def shortened(message: object) -> str:
    """An error message as printed: its start and its end, when it is longer than :data:`MAX_ERROR_CHARS`."""
    text = str(message)
    if len(text) <= MAX_ERROR_CHARS:
        return text
    head, tail = text[: MAX_ERROR_CHARS - 500], text[-400:]
    return f"{head} ...({len(text) - len(head) - len(tail)} characters left out)... {tail}"


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
