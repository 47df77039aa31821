"""Write policy: where ckptconv may write, and what it may replace or delete.

Every writer asks this module (single files, shard and DCP folders, batch
outputs and their folders, the batch manifest). The rules:

* **Never an input.** No file ckptconv writes, replaces or deletes may be a
  file the input reads: index, shards, ``.metadata`` and chunk files, whatever
  the spelling (``hf/``, ``./hf``, a link, a hard link: files are compared by
  device and inode). A folder output may not be a folder that holds a file the
  input reads, so stale shards of an earlier run are never confused with the
  input's own.
* **Inside DST, never through a link ckptconv did not create.** Folders below
  an output root are created one component at a time, and an existing
  component must be a real folder, not a link (which could lead anywhere);
  relative output names never hold ``..``. Files are replaced by renaming a new
  file over the name, which replaces a link rather than writing through it; the
  manifest, which is appended to, is opened with ``O_NOFOLLOW`` and must be a
  regular file.
* **One line, nothing left behind.** Errors from the operating system (disk
  full, name too long, read-only file system, permission denied) become one
  :class:`~ckptconv.errors.WriteError` sentence, and folders ckptconv created
  for a failed write are removed again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable, Sequence
from typing import BinaryIO

from ckptconv._paths import tilde_note
from ckptconv.errors import WriteError

__all__ = [
    "Inputs",
    "check_not_a_link",
    "check_replaceable",
    "make_folders",
    "missing_folders",
    "open_append",
    "os_error",
    "remove_folders",
    "remove_written",
]

_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "the file would exceed the allowed size",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "the file system is read-only",
    errno.ENAMETOOLONG: "the name is too long for the file system",
    errno.ELOOP: "it is a link, and ckptconv does not write through links",
    errno.ENOTDIR: "a part of the path is not a folder",
    errno.EISDIR: "it is a folder",
}


def os_error(error: OSError, path: str) -> WriteError:
    """One sentence for an operating-system error met while writing ``path``."""
    reason = _REASONS.get(error.errno or 0, error.strerror or str(error))
    return WriteError(f"cannot write {path!r}: {reason}; nothing was written", path=path)


_SPECIAL_FILES = {
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "socket",
}


def check_replaceable(path: str, shown: str) -> None:
    """Refuse an output name held by a device, FIFO or socket.

    An output replaces what holds its name (a file, or a link, which is replaced
    rather than followed), so ``--overwrite`` onto ``/dev/null`` run as root would
    swap the device for a regular file.

    Raises:
        WriteError: ``path`` is a device, FIFO or socket.
    """
    try:
        mode = os.lstat(path).st_mode
    except (OSError, ValueError):
        return
    kind = _SPECIAL_FILES.get(stat.S_IFMT(mode))
    if kind is not None:
        raise WriteError(
            f"{shown!r} is a {kind}, not a file; ckptconv replaces only files, so give a file path for the output",
            path=path,
        )


def _identity(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    return info.st_dev, info.st_ino


class Inputs:
    """The files a conversion reads, which nothing it writes may touch.

    Args:
        files: every file the input consists of (:attr:`ckptconv.Checkpoint.files`).
    """

    def __init__(self, files: Iterable[str]) -> None:
        self.files = tuple(dict.fromkeys(os.path.abspath(path) for path in files))
        self._absolute = frozenset(self.files)
        self._by_identity: dict[tuple[int, int], str] = {}
        self._folders: dict[tuple[int, int], str] = {}
        for source in self.files:
            identity = _identity(source)
            if identity is not None:
                self._by_identity.setdefault(identity, source)
            folder = _identity(os.path.dirname(source))
            if folder is not None:
                self._folders.setdefault(folder, source)

    def _which(self, path: str) -> str | None:
        absolute = os.path.abspath(path)
        if absolute in self._absolute:
            return absolute
        identity = _identity(absolute)
        return self._by_identity.get(identity) if identity is not None else None

    def holds(self, path: str) -> bool:
        """True when ``path`` is one of the input's files, however it is spelled (links, hard links)."""
        return self._which(path) is not None

    def check_file(self, path: str, *, action: str = "write") -> None:
        """Refuse to write, replace or delete ``path`` when it is one of the input's files.

        Raises:
            WriteError: it is.
        """
        source = self._which(path)
        if source is not None:
            spelled = "" if os.path.abspath(path) == source else f" ({source!r})"
            verb = {"write": "write", "replace": "write", "delete": "delete"}.get(action, action)
            where = "onto" if verb == "write" else "what is"
            raise WriteError(
                f"refusing to {verb} {path!r} {where} its own input{spelled}; choose another output path", path=path
            )

    def check_folder(self, folder: str) -> None:
        """Refuse a folder output that holds a file the input reads (the input's own folder).

        Raises:
            WriteError: it does.
        """
        identity = _identity(folder)
        held = self._folders.get(identity) if identity is not None else None
        if held is None:
            return
        raise WriteError(
            f"refusing to write {folder!r} onto its own input: the folder holds {held!r}, which must never be "
            "replaced or deleted; choose another output folder",
            path=folder,
        )


def _check_parts(relative: str, path: str) -> list[str]:
    parts = [part for part in relative.replace(os.sep, "/").split("/") if part not in ("", ".")]
    if ".." in parts or os.path.isabs(relative):
        raise WriteError(f"refusing to write {path!r}: it leads outside the output folder", path=path)
    return parts


def _below_what_exists(folder: str) -> tuple[str, list[str]]:
    """The deepest part of ``folder`` (as the user spelled it) that exists, and the names to create below it.

    That part must be a folder (a link to one counts: the user named it, as when the whole folder
    exists); the names below it must be plain names, never ``..``, so nothing is created anywhere but
    under it (``new/../../x`` is refused rather than read as ``../x``), and a leading ``~`` the shell did
    not expand is not made a folder of that name.
    """
    head = folder.rstrip("/" + os.sep) or folder
    names: list[str] = []
    while head and not os.path.lexists(head):
        head, name = os.path.split(head)
        names.insert(0, name)
        head = head.rstrip("/" + os.sep) or head[:1]  # "a//b" and "/" alike
    names = [name for name in names if name not in ("", ".")]
    if not names:  # it exists: the loop below says whether it is a folder (a link the user named is)
        absolute = os.path.abspath(folder)
        return os.path.dirname(absolute), [os.path.basename(absolute)]
    existing = head or "."
    if names[0].startswith("~") and tilde_note(folder):  # "~/out.pt" from Python: no folder named "~" is made
        missing = os.path.abspath(os.path.join(existing, names[0]))
        raise WriteError(f"folder {missing!r} does not exist{tilde_note(folder)}; create it first", path=folder)
    if ".." in names:
        raise WriteError(
            f"refusing to create {folder!r}: the part of it that does not exist yet ({'/'.join(names)!r}) holds "
            "'..', and ckptconv creates folders only below the part that exists; create them first",
            path=folder,
        )
    if not os.path.isdir(existing):
        if not os.path.islink(existing):
            reason = "a file, not a folder"
        else:  # a link to a file leads somewhere: say where
            reason = "a link to a file, not a folder" if os.path.exists(existing) else "a link that leads nowhere"
        raise WriteError(f"cannot create {folder!r}: {existing!r} is {reason}{tilde_note(folder)}", path=folder)
    return os.path.abspath(existing), names


def make_folders(folder: str, *, root: str | None = None) -> list[str]:
    """Create ``folder`` and its missing parents; return the folders created, outermost first.

    Without ``root``, the missing folders are created below the deepest part of ``folder`` that
    exists, which must be a folder (or a link to one, named by the user), one at a time, none through
    a link, and never after a ``..`` (:func:`_below_what_exists`); as ``save_pretrained`` and
    ``mkdir -p`` do, but no further. With ``root`` (an output root such as a batch's DST), ``folder``
    must lie below it and every component below ``root`` must be a real folder, not a link: a link
    there (made by someone else) could lead anywhere, so it is refused.

    Raises:
        WriteError: a component is a link or a file, or the folder cannot be created
            (the folders made so far are removed again).
    """
    created: list[str] = []
    named = False  # the folder exists: nothing below what the user named is created
    if root is None:
        parent, parts = _below_what_exists(folder)
        named = os.path.lexists(folder)
    else:
        parent = os.path.abspath(root)
        parts = _check_parts(os.path.relpath(os.path.abspath(folder), parent), folder)
    try:
        for part in parts:
            parent = os.path.join(parent, part)
            try:
                os.mkdir(parent)
            except FileExistsError:
                info = os.lstat(parent)
                if stat.S_ISLNK(info.st_mode):
                    if root is None and named:
                        continue  # the user named this path, link and all (a link in what is created: refused)
                    raise WriteError(
                        f"refusing to write into {parent!r}: it is a link, and ckptconv writes only into "
                        "folders it can see are inside the output folder; remove the link",
                        path=parent,
                    ) from None
                if not stat.S_ISDIR(info.st_mode):
                    raise WriteError(f"{parent!r} is a file; a folder is needed there", path=parent) from None
            else:
                created.append(parent)
    except BaseException as error:
        remove_folders(created)
        if isinstance(error, OSError) and not isinstance(error, WriteError):
            raise os_error(error, parent) from None
        raise
    return created


def missing_folders(path: str, *, folder_output: bool, parts: Iterable[str] = ()) -> list[str]:
    """The folders of ``path`` (a file's, or with ``folder_output`` the folder's own, and its subfolders
    ``parts``) that do not exist yet, outermost first: those a write to it creates (:func:`make_folders`),
    for a caller that must remove them when a later step fails."""
    missing: list[str] = []
    top = os.path.abspath(path) if folder_output else os.path.dirname(os.path.abspath(path))
    folder = top
    while not os.path.lexists(folder) and folder != os.path.dirname(folder):
        missing.insert(0, folder)
        folder = os.path.dirname(folder)
    return missing + [os.path.join(top, part) for part in parts if not os.path.lexists(os.path.join(top, part))]


def remove_written(files: Iterable[str], made: Sequence[str]) -> None:
    """Undo a write: remove ``files`` (which it wrote), then the folders it made: ``made``
    (:func:`missing_folders`) and every folder below one of them that held a file (a model folder's
    ``scheduler/``), if empty."""
    below: set[str] = set()
    for path in files:
        os.unlink(path)
        folder = os.path.dirname(path)
        while any(folder.startswith(os.path.join(top, "")) for top in made):
            below.add(folder)
            folder = os.path.dirname(folder)
    remove_folders([*made, *sorted(below, key=len)])


def remove_folders(created: Iterable[str]) -> None:
    """Remove folders :func:`make_folders` created, innermost first, if they are empty."""
    for folder in reversed(list(created)):
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def check_not_a_link(path: str) -> None:
    """Refuse a file ckptconv would write in place (append to) when it is a link.

    Raises:
        WriteError: it is.
    """
    if os.path.islink(path):
        raise WriteError(
            f"refusing to write {path!r}: it is a link, and ckptconv never writes through links it did not "
            "create; remove it",
            path=path,
        )


def open_append(path: str) -> BinaryIO:
    """Open a regular file for appending (created if missing), never through a link.

    Raises:
        WriteError: the path is a link, a FIFO or another non-regular file, or cannot be opened.
    """
    flags = (
        os.O_RDWR
        | os.O_APPEND
        | os.O_CREAT
        | getattr(os, "O_NOFOLLOW", 0)
        | getattr(os, "O_NONBLOCK", 0)
        | getattr(os, "O_CLOEXEC", 0)
        | getattr(os, "O_BINARY", 0)
    )
    check_not_a_link(path)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as error:
        if error.errno == errno.ENXIO:  # a FIFO without a reader
            raise WriteError(f"refusing to write {path!r}: it is not a regular file", path=path) from None
        raise os_error(error, path) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise WriteError(f"refusing to write {path!r}: it is not a regular file", path=path)
    return os.fdopen(fd, "ab")  # read-write underneath, for a look at the last byte
