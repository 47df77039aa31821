"""Text for terminals: names that come from checkpoints and file systems, made harmless to print."""

from __future__ import annotations

__all__ = ["shown"]


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
