"""The staging folders earlier versions of ckptconv made inside a folder output, removed once their writer is gone.

Those versions wrote a folder output's new files into a hidden, locked ``.ckptconv-staging.<random>`` folder inside
the destination and renamed them over their final names one by one. A folder output is now one transaction staged
beside the destination (:mod:`.transaction`); a staging folder such a version's killed writer left inside it is
removed when the folder is next written (its lock is free, as in :func:`.atomic.remove_abandoned`).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat

from ckptconv.writing import write_policy
from ckptconv.writing.atomic import try_lock

__all__ = ["remove_abandoned_staging"]

_PREFIX = ".ckptconv-staging."
_NAME = re.compile(rf"\A{re.escape(_PREFIX)}[A-Za-z0-9_]{{8}}\Z")
_DIRECTORY = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)


def _clear(fd: int) -> None:
    """Remove the files (and links) of the open folder ``fd``; never follows a link, never descends."""
    for entry in os.listdir(fd):
        with contextlib.suppress(OSError):
            if not stat.S_ISDIR(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
                os.unlink(entry, dir_fd=fd)


def remove_abandoned_staging(folder: str, *, inputs: write_policy.Inputs | None = None) -> list[str]:
    """Remove the staging folders in ``folder`` whose writer is gone (their lock is free).

    One that holds a file of the input (``inputs``) is left alone: someone may convert a file
    rescued from a killed run where that run left it.

    Returns:
        The folders removed.
    """
    removed: list[str] = []
    try:
        entries = os.listdir(folder)
    except OSError:
        return removed
    for entry in entries:
        if not _NAME.match(entry):
            continue
        path = os.path.join(folder, entry)
        try:
            fd = os.open(path, _DIRECTORY)
        except OSError:
            continue
        try:
            current = os.lstat(path)
            info = os.fstat(fd)
            if (current.st_dev, current.st_ino) != (info.st_dev, info.st_ino) or not try_lock(fd):
                continue
            if inputs is not None and any(inputs.holds(os.path.join(path, name)) for name in os.listdir(fd)):
                continue
            _clear(fd)
            os.rmdir(path)
            removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed
