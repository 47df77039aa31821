"""Text for messages and terminals: counts spelled right, and names that come from checkpoints and file
systems made harmless to print."""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = ["human_bytes", "plural", "short_repr", "shown"]


def plural(count: int, word: str, many: str | None = None) -> str:
    """``"1 tensor"``, ``"2 tensors"``; ``many`` for irregular plurals (``plural(n, "class", "classes")``),
    so that no message says "1 classes".

    Example:
        >>> plural(1, "tensor"), plural(3, "class", "classes")
        ('1 tensor', '3 classes')
    """
    return f"{count} {word if count == 1 else many or word + 's'}"


def shown(text: str) -> str:
    """``text`` with every character that is not printable escaped, so that names from a checkpoint
    or the file system cannot move the cursor, set the terminal's title, write its clipboard or
    forge a line of the report. Bytes of a file name that are not UTF-8 show as ``\\xNN``."""
    if text.isprintable():
        return text
    out = []
    for char in text:
        if char.isprintable():
            out.append(char)
        elif "\udc80" <= char <= "\udcff":  # a byte of a non-UTF-8 file name (surrogateescape)
            out.append(f"\\x{ord(char) - 0xDC00:02x}")
        else:
            out.append(char.encode("unicode_escape").decode("ascii"))
    return "".join(out)


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 6


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to a few dozen characters, for error messages.

    Values in messages come from the file: a plain ``repr`` of a ten-million-item
    list, or of a list nested a million deep, would take the memory or the
    recursion the limits exist to protect.
    """
    return _REPR.repr(value)


def human_bytes(count: float) -> str:
    """``"512 B"``, ``"1.9 KiB"``, ``"3.2 GiB"``: a byte count for people."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"
