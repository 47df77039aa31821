"""One writer per output: an exclusive lock beside the destination that names its holder.

``convert`` (and ``fit``, and :func:`ckptconv.save` of a folder) and ``batch`` take the lock on their destination
before anything else: a second writer of the same output is refused in one line naming the first (its process id,
host and command, which the lock file records), never left to interleave its files with the first one's.

The lock is ``flock`` on a hidden file beside the destination, ``.NAME.ckptconv-lock`` (the destination's own
folder may not exist yet, and a model folder is replaced whole: a lock inside it would be replaced with it). The
holder removes the file when it is done; a writer killed by SIGKILL leaves it, with its record of what it was
doing (:attr:`OutputLock.previous`), which the next writer reads to clean up after it (:mod:`.transaction`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
from typing import Any

from ckptconv._text import shown
from ckptconv.errors import WriteError
from ckptconv.writing import faults, write_policy

__all__ = ["OutputLock", "lock_name", "resolved"]

_SUFFIX = ".ckptconv-lock"
#: A destination name longer than this is shortened (and a hash added) in the names beside it: NAME_MAX is 255.
_LONGEST = 120


def short_name(name: str) -> str:
    """``name`` as the hidden names beside it spell it: shortened, with a hash, when it is long."""
    if len(name.encode("utf-8", "surrogateescape")) <= _LONGEST:
        return name
    import hashlib

    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return name[:64] + "~" + digest


def lock_name(name: str) -> str:
    """The lock file's name beside the output ``name``."""
    return f".{short_name(name)}{_SUFFIX}"


def resolved(destination: str) -> str:
    """The destination the lock and the transaction work on: its folder's links resolved, and the destination
    itself resolved when it is a link to a folder (the user named the folder it leads to)."""
    absolute = os.path.abspath(destination)
    real = os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))
    return os.path.realpath(real) if os.path.isdir(real) else real


def _holder() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)[:500]}


def _described(record: dict[str, Any]) -> str:
    parts = []
    if isinstance(record.get("pid"), int):
        parts.append(f"pid {record['pid']}")
    if isinstance(record.get("host"), str):
        parts.append(f"on {shown(record['host'])}")
    if isinstance(record.get("command"), str) and record["command"]:
        parts.append(f"running {shown(record['command'][:200])!r}")
    return f" ({' '.join(parts)})" if parts else ""


def _read(fd: int) -> dict[str, Any] | None:
    try:
        data = os.pread(fd, 1 << 16, 0)
        record = json.loads(data.decode("utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


class OutputLock:
    """The lock on the output ``destination``, held from :meth:`acquire` (or ``with``) to :meth:`release`.

    Args:
        destination: the output file or folder (it need not exist; its folder must).
        what: the kind of writer, recorded for the refusal of the next one (``"ckptconv"``, ``"ckptconv batch"``).

    Attributes:
        path: the lock file.
        previous: the record a killed writer left in the lock file, or None.

    Raises:
        WriteError: another process holds the lock (the message names it), or the lock file cannot be made.
    """

    def __init__(self, destination: str, *, what: str = "ckptconv") -> None:
        self.destination = resolved(destination)
        folder, name = os.path.split(self.destination)
        self.path = os.path.join(folder, lock_name(name))
        self.what = what
        self.previous: dict[str, Any] | None = None
        self._fd = -1
        self._record: dict[str, Any] = {}
        self._kept = False

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def acquire(self) -> None:
        """Take the lock, or refuse in one line naming its holder."""
        try:
            import fcntl
        except ImportError:  # Windows: no flock; one writer per output is then up to the user, as for the manifest
            fcntl = None  # type: ignore[assignment]
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        for _ in range(100):  # the holder removes the file as it lets go: open the one that is there now
            try:
                faults.point("lock")
                fd = os.open(self.path, flags, 0o666)
            except OSError as error:
                if error.errno == errno.ELOOP:
                    write_policy.check_not_a_link(self.path)
                raise write_policy.os_error(error, self.path) from None
            try:
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _read(fd) or {}
                os.close(fd)
                holder = shown(record["what"]) if isinstance(record.get("what"), str) else "ckptconv"
                raise WriteError(
                    f"another {holder} is writing {self.destination!r}{_described(record)}; wait for it to finish",
                    path=self.destination,
                ) from None
            except OSError:
                pass  # a file system without locks (some network mounts): carry on unlocked, as batch's manifest does
            try:
                opened, current = os.fstat(fd), os.lstat(self.path)
            except OSError:
                os.close(fd)
                continue
            if (opened.st_dev, opened.st_ino) != (current.st_dev, current.st_ino):
                os.close(fd)  # removed (and perhaps made again) by the holder that just let go
                continue
            self._fd = fd
            self.previous = _read(fd) if opened.st_size else None
            try:
                self.record()
            except BaseException:
                self.release()
                raise
            return
        raise WriteError(f"cannot lock {self.destination!r}: its lock file keeps changing", path=self.destination)

    def record(self, **fields: Any) -> None:
        """Write the holder and ``fields`` (what it is doing, for the writer after a kill) into the lock file."""
        if self._fd < 0 or self._kept:
            return
        self._record.update(fields)
        data = json.dumps({**_holder(), "what": self.what, **self._record}, ensure_ascii=True).encode("ascii")
        try:
            faults.point("record")
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)
        except OSError as error:
            raise write_policy.os_error(error, self.path) from None

    def keep_record(self) -> None:
        """Leave the lock file and its record as they are when the lock is let go: the next writer of the output
        finishes what this one left (:mod:`.transaction`)."""
        self._kept = True

    def release(self) -> None:
        """Let go: the lock file goes (removed while still locked, so no one takes a file about to vanish)."""
        if self._fd < 0:
            return
        try:
            with contextlib.suppress(OSError):
                if self._kept:
                    raise OSError
                current = os.lstat(self.path)
                opened = os.fstat(self._fd)
                if (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
                    os.unlink(self.path)
        finally:
            os.close(self._fd)
            self._fd = -1
