"""Staged folder outputs: a folder's new files are written apart, checked, then published together.

A folder output (shards and their index, a DCP folder) cannot be renamed into place whole, since the
destination may hold other files. So its new files are written into a hidden staging folder inside it
(``.ckptconv-staging.<random>``, locked for as long as its writer lives), checked there, and only then
renamed over their final names, the index or ``.metadata`` last, with Ctrl-C and SIGTERM held back
(:func:`~ckptconv.runtime.signals.signals_deferred`); the old output's files ckptconv wrote that the new
output no longer has are removed after that. Until then the old output is whole and loadable: a
failure removes the staging folder and nothing else, and a killed writer leaves its staging folder,
which the next write into the folder removes (its lock is free, as in :func:`.atomic.remove_abandoned`).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
from collections.abc import Iterable

from ckptconv.errors import CkptconvError
from ckptconv.runtime.signals import signals_deferred
from ckptconv.writing import write_policy
from ckptconv.writing.atomic import try_lock

__all__ = ["Staging", "remove_abandoned_staging"]

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


class Staging:
    """A hidden, locked folder inside ``folder`` where a folder output's new files are written.

    Args:
        folder: the output folder (it exists).
        inputs: the input's files, never removed with an abandoned staging folder.
    """

    def __init__(self, folder: str, *, inputs: write_policy.Inputs) -> None:
        remove_abandoned_staging(folder, inputs=inputs)
        self.folder = folder
        try:
            self.path = tempfile.mkdtemp(prefix=_PREFIX, dir=folder)
        except OSError as error:
            raise write_policy.os_error(error, folder) from None
        self._fd = os.open(self.path, _DIRECTORY)
        try_lock(self._fd)  # held until discard(): a live writer's staging folder is never removed

    def file(self, name: str) -> str:
        """Where the new file ``name`` is written until it is published."""
        return os.path.join(self.path, name)

    def publish(self, names: Iterable[str], *, remove: Iterable[str] = (), fsync: bool = True) -> None:
        """Rename the staged ``names`` (in this order: the index or metadata last) over their final
        names, then remove the old output's files ``remove``; the staging folder goes.

        The renames run with Ctrl-C and SIGTERM held back, so an interruption lands before or after them.
        """
        with signals_deferred():
            for name in names:
                try:
                    os.replace(self.file(name), os.path.join(self.folder, name))
                except OSError as error:
                    raise write_policy.os_error(error, os.path.join(self.folder, name)) from None
            if fsync:
                with contextlib.suppress(OSError):
                    directory = os.open(self.folder, os.O_RDONLY)
                    try:
                        os.fsync(directory)
                    finally:
                        os.close(directory)
            for path in remove:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            self.discard()

    def named_finally(self, error: CkptconvError) -> None:
        """Make ``error`` name the files it met by their final names, not where they were staged."""
        staged = self.path + os.sep
        error.message = error.message.replace(staged, self.folder + os.sep).replace(self.path, self.folder)
        error.args = (error.message, *error.args[1:])
        if error.path is not None:
            error.path = error.path.replace(staged, self.folder + os.sep).replace(self.path, self.folder)

    def discard(self) -> None:
        """Remove the staging folder and the files in it (all of them this write's own)."""
        if self._fd < 0:
            return
        try:
            _clear(self._fd)
            with contextlib.suppress(OSError):
                os.rmdir(self.path)
        finally:
            os.close(self._fd)
            self._fd = -1
