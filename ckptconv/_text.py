"""Text for messages and terminals: counts spelled right, and names that come from checkpoints and file
systems made harmless to print."""

from __future__ import annotations

__all__ = ["plural", "shown"]


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
