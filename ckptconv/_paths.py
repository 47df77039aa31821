"""The paths the public API takes, and what to say when one names nothing.

Every public function that takes a path (``open``, ``load``, ``convert``, ``save``,
``inspect``, ``verify``, ``diff``, ``scan``, ``batch``, ``fit``'s reference,
``load_into``) turns it into text with :func:`as_path` (``open`` and what reads
through it in ``formats.resolve``), so they all take the same things: ``str``,
``bytes`` and ``os.PathLike`` of either, as the standard library's ``open`` and
``os`` functions do (``os.fsdecode``: bytes that are not UTF-8 keep their bytes
through the surrogate escapes, so the file opened is the file named).

Paths are taken literally, as ``torch.load``, ``torch.save`` and the safetensors
library take them: a leading ``~`` is not expanded (the shell does that for the
command line). A path that names nothing says so, and says that ``~`` was not
expanded where it starts with one (:func:`missing`).
"""

from __future__ import annotations

import os
import re
from typing import Union

__all__ = ["PathLike", "as_path", "missing", "tilde_note"]

PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]


def as_path(path: object, *, what: str = "path") -> str:
    """``path`` as ``str`` (``os.fsdecode``); anything but a path is a one-line ``TypeError``.

    Example:
        >>> as_path(b"caf\\xc3\\xa9.pt"), as_path(pathlib.Path("m.pt"))   # doctest: +SKIP
        ('café.pt', 'm.pt')
    """
    if isinstance(path, (str, bytes, os.PathLike)):
        return os.fsdecode(path)  # a __fspath__ returning neither str nor bytes: fsdecode's TypeError
    raise TypeError(f"{what} must be a str, bytes or os.PathLike, not {type(path).__name__}")


def missing(path: str, *, what: str = "") -> str:
    """Why ``path`` names nothing, as the start of a one-line message: ``"'x.pt' does not exist"``,
    ``"'m.pt/' ends in '/', but 'm.pt' is a file, not a folder"`` when a part that must be a folder is
    a file, and :func:`tilde_note` when the path starts with ``~``. ``what`` goes before the path.

    Example:
        >>> missing("~/m.pt")   # doctest: +SKIP
        "'~/m.pt' does not exist (a leading '~' is not expanded: ckptconv, like torch.load, ...)"
    """
    named = f"{what} {path!r}" if what else repr(path)
    blocking = _file_in_the_way(path)
    if blocking is not None:
        if blocking == path.rstrip("/" + os.sep):
            return f"{named} ends in {path[len(blocking) :]!r}, but {blocking!r} is a file, not a folder"
        return f"{named} does not exist: {blocking!r} is a file, not a folder"
    return f"{named} does not exist{tilde_note(path)}{hub_note(path)}"


# A Hugging Face Hub id: an owner and a name, with no suffix a checkpoint file would have.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9]")
_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt", ".safetensors", ".tar", ".json")


def hub_note(path: str) -> str:
    """How to download a Hugging Face Hub model, for a missing ``path`` that looks like its id
    (``openai-community/gpt2``), else ``""``: ckptconv reads local files only."""
    if (
        not _HUB_ID.fullmatch(path)
        or path.lower().endswith(_FILE_SUFFIXES)
        or os.path.lexists(path.split("/", maxsplit=1)[0])
    ):
        return ""
    return (
        " (ckptconv reads local files; for the Hugging Face Hub model, download it first: "
        f"huggingface-cli download {path} --local-dir {path.split('/')[1]}, then pass the folder)"
    )


def tilde_note(path: str) -> str:
    """``" (a leading '~' is not expanded: ...)"`` for a path that starts with ``~`` (or, made absolute,
    leads through a ``~`` folder of the current one, which is where such a path points), else ``""``."""
    if not path.startswith("~") and not (os.path.isabs(path) and _under_cwd(path).startswith("~")):
        return ""
    return " (a leading '~' is not expanded: ckptconv, like torch.load, takes paths as written)"


def _under_cwd(path: str) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path


def _file_in_the_way(path: str) -> str | None:
    """The longest leading part of ``path`` that exists but is not a folder, when a part after it
    (or a trailing slash) needs it to be one; else None."""
    head = path
    while True:
        parent = head.rstrip("/" + os.sep)
        head = parent if parent != head else os.path.dirname(head)  # "m.pt/": "m.pt" must be a folder
        if not head or head == os.path.dirname(head):
            return None
        if os.path.isdir(head):
            return None
        if os.path.exists(head):
            return head
        if os.path.lexists(head):
            return None  # a dangling link: "does not exist" is the truth
