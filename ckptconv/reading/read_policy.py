"""Read policy: which paths ckptconv may open, and how it opens them.

Every reader asks this module before it touches a file (the format readers,
the sharded and DCP folder readers, discovery, fit's ``--like`` file, the
checksums, the byte sources of lazy tensors). The rules:

* **Regular files only.** A FIFO, a character or block device (``/dev/zero``),
  a socket or a folder is refused with one line before it is opened, so a read
  can never block forever or run on without end. Files are opened with
  ``O_NONBLOCK`` (a FIFO swapped in after the check still cannot block the
  open) and checked again with ``fstat`` on the open descriptor: it must be the
  regular file that was checked.
* **Inside the checkpoint's folder.** A file a folder checkpoint names (index,
  ``.metadata``, shards, chunk files) must be a plain relative name inside the
  folder; a link is followed only when it stays inside the folder, or, in a
  snapshot of the Hugging Face hub cache, when it leads to the same
  repository's ``blobs`` (which every file of a snapshot is). The same
  holds for the members :func:`ckptconv.reading.discovery.discover` finds under SRC.
  The path a user names on the command line is theirs to choose, links included.
* **Inside the source folder of a batch.** While a batch converts an item,
  every file read under its source folder (:func:`confined`) must lead inside
  it, whatever opens it, so an item swapped for a link out of SRC after
  discovery checked it is refused when it is opened, not read.
* **Size caps** for files read whole into memory as JSON or text: indexes,
  key lists (:data:`MAX_TEXT_BYTES`); the cap is enforced on the bytes read,
  not on the size the file system reports (``/proc`` files report 0).
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import os
import stat
import threading
from collections import Counter
from collections.abc import Iterator

from ckptconv._paths import missing
from ckptconv._text import short_repr
from ckptconv.errors import LoadError, MalformedCheckpointError, UnsupportedFormatError

__all__ = [
    "MAX_TEXT_BYTES",
    "check_file",
    "confined",
    "descriptor",
    "found_inside",
    "hub_blob",
    "inside",
    "keeping_open",
    "kind_of",
    "member",
    "open_descriptor",
    "open_file",
    "read_limited",
    "within",
]

# JSON and text files read whole: shard indexes, key lists for fit --like.
MAX_TEXT_BYTES = 100_000_000

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def kind_of(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words (``"a FIFO (named pipe)"``)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def inside(path: str, folder: str) -> bool:
    """True when ``path``, links resolved, lies inside ``folder`` (links resolved)."""
    real_folder = os.path.realpath(folder)
    real = os.path.realpath(path)
    try:
        return os.path.commonpath([real, real_folder]) == real_folder
    except ValueError:  # different drives (Windows)
        return False


def hub_blob(path: str, folder: str) -> bool:
    """True when ``folder`` is a snapshot of the Hugging Face hub cache and ``path`` links into the
    same repository's ``blobs`` folder, as every file of a snapshot does
    (``models--org--name/snapshots/<revision>/model.safetensors -> ../../blobs/<sha256>``).

    The ``blobs`` folder must be a folder of that repository, not a link: a look-alike cache whose
    ``blobs`` leads elsewhere would otherwise make any folder count as its blobs.
    """
    real_folder = os.path.realpath(folder)
    snapshots = os.path.dirname(real_folder)
    if os.path.basename(snapshots) != "snapshots":
        return False
    blobs = os.path.join(os.path.dirname(snapshots), "blobs")  # every part but the last already resolved
    if os.path.islink(blobs) or not os.path.isdir(blobs):
        return False
    return inside(path, blobs)


def within(path: str, folder: str) -> bool:
    """The read policy's rule for a file a folder checkpoint holds: inside the folder, or a
    Hugging Face cache snapshot's link into its repository's blobs (:func:`hub_blob`)."""
    return inside(path, folder) or hub_blob(path, folder)


def found_inside(path: str, root: str) -> bool:
    """The read policy's rule for a file found under ``root`` (a batch's or scan's source folder): it lies
    inside ``root``, links resolved, or it is a Hugging Face cache snapshot's link into its blobs
    (:func:`hub_blob`) from a folder that itself lies inside ``root``, so a folder swapped for a link to a
    look-alike snapshot elsewhere, whose ``blobs`` may lead anywhere, does not count as one."""
    folder = os.path.dirname(os.path.abspath(path))
    return inside(path, root) or (inside(folder, root) and hub_blob(path, folder))


# Source folders of batches being converted (absolute, real paths), each with the output folder spelled
# under it that its rule leaves out ("" for none), counted: one per item in progress.
_CONFINED: Counter[tuple[str, str]] = Counter()
_CONFINED_LOCK = threading.Lock()


@contextlib.contextmanager
def confined(folder: str, *, output: str | None = None) -> Iterator[None]:
    """While active, a file read under ``folder`` (its path spelled through ``folder``) must lead inside it,
    or be a Hugging Face cache snapshot's link into its blobs (the rule :func:`ckptconv.reading.discovery.discover`
    applied when it found the file), in every thread of this process and whatever reads it: a batch worker
    converts its item inside this, so a file swapped for a link out of SRC since discovery is refused when
    it is opened. Files spelled under ``output`` (the batch's output folder, which discovery leaves out of
    SRC) are the batch's own, read back to verify them wherever the folder leads, and are not held to it.

    Example:
        >>> with confined("/data/zoo"):               # doctest: +SKIP
        ...     ckptconv.convert("/data/zoo/m.pt", "/out/m.safetensors")
    """
    root = os.path.realpath(folder)
    apart = os.path.abspath(output) if output is not None else ""
    # Only an output folder inside SRC is left out: one above SRC would leave SRC's own files out too.
    key = (root, apart if _spelled_under(apart, root) else "")
    with _CONFINED_LOCK:
        _CONFINED[key] += 1
    try:
        yield
    finally:
        with _CONFINED_LOCK:
            _CONFINED[key] -= 1
            if not _CONFINED[key]:
                del _CONFINED[key]


def _spelled_under(absolute: str, folder: str) -> bool:
    return absolute.startswith(folder.rstrip(os.sep) + os.sep)


def _confining(path: str) -> list[str]:
    """The :func:`confined` folders ``path`` is spelled under (and not under their output folder)."""
    if not _CONFINED:
        return []
    absolute = os.path.abspath(path)
    with _CONFINED_LOCK:
        keys = list(_CONFINED)
    return [
        root
        for root, output in keys
        if _spelled_under(absolute, root) and not (output and _spelled_under(absolute, output))
    ]


def _escapes(path: str) -> str | None:
    """The :func:`confined` folder whose rule ``path`` breaks, or None."""
    for root in _confining(path):
        if not found_inside(path, root):
            return root
    return None


def _stat_error(error: OSError, path: str) -> LoadError:
    if isinstance(error, (FileNotFoundError, NotADirectoryError)):
        if os.path.islink(path):
            return LoadError(f"{path!r} is a link to a missing file; check the path", path=path)
        return LoadError(f"{missing(path)}; check the path", path=path)
    if isinstance(error, PermissionError):
        return LoadError(f"{path!r} cannot be read: permission denied", path=path)
    return LoadError(f"{path!r} cannot be read: {error.strerror or error}", path=path)


def check_file(path: str, *, folder: str | None = None) -> os.stat_result:
    """Refuse anything but a regular file (inside ``folder``, when given); return its status.

    Raises:
        LoadError: the path is missing, unreadable, or a link leading out of ``folder``.
        UnsupportedFormatError: it is a folder, a FIFO, a device or a socket.
    """
    try:
        info = os.stat(path)
    except (OSError, ValueError) as error:
        if isinstance(error, ValueError):  # embedded NUL
            raise LoadError(f"{path!r} is not a valid path", path=path) from None
        raise _stat_error(error, path) from None
    if folder is not None and not within(path, folder):
        raise MalformedCheckpointError(
            f"{path!r} is a link that leads outside the checkpoint folder {folder!r}; "
            "ckptconv reads only files inside it (copy the file in instead of linking it)",
            path=path,
        )
    root = _escapes(path)
    if root is not None:
        raise LoadError(
            f"{path!r} is a link that leads outside the source folder {root!r} (to {os.path.realpath(path)!r}); "
            "not followed",
            path=path,
        )
    if stat.S_ISDIR(info.st_mode):
        raise UnsupportedFormatError(f"{path!r} is a folder; give the checkpoint file inside it", path=path)
    if not stat.S_ISREG(info.st_mode):
        raise UnsupportedFormatError(
            f"{path!r} is {kind_of(info.st_mode)}, not a regular file; ckptconv reads only regular files",
            path=path,
        )
    return info


def open_descriptor(path: str, *, folder: str | None = None, flags: int = 0) -> int:
    """:func:`open_file`, as a raw descriptor opened with extra ``flags`` (``O_DIRECT``).

    Raises:
        LoadError: see :func:`check_file`; or the file changed between the check and the open.
        OSError: the file system refuses ``flags``.
    """
    info = check_file(path, folder=folder)
    target = path
    flags |= _OPEN_FLAGS
    if folder is not None or _confining(path):
        # Open the resolved path without following a link in its last component, so a
        # link swapped in after the check cannot lead out of the folder.
        target = os.path.realpath(path)
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(target, flags)
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            raise LoadError(f"{path!r} changed while it was being opened; try again", path=path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(path: str, *, folder: str | None = None) -> io.BufferedReader:
    """Open a regular file for reading, after :func:`check_file`, without blocking on FIFOs.

    The open descriptor is checked again with ``fstat``: it must be the regular
    file that was checked (not something swapped in meanwhile).

    Raises:
        LoadError: see :func:`check_file`; or the file changed between the check and the open.
    """
    try:
        fd = open_descriptor(path, folder=folder)
    except OSError as error:
        raise _stat_error(error, path) from None
    try:
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


# Files :func:`descriptor` keeps open inside :func:`keeping_open`, by path (None outside one).
_KEPT: contextvars.ContextVar[dict[str, io.BufferedReader] | None] = contextvars.ContextVar(
    "ckptconv_kept_open", default=None
)

#: Files kept open at most; past this many, :func:`descriptor` opens and closes each read.
MAX_KEPT_OPEN = 64


@contextlib.contextmanager
def keeping_open() -> Iterator[None]:
    """Inside this block, :func:`descriptor` opens each file once, and closes them all at its end.

    A write of 10^5 small tensors opened and checked their file 10^5 times (a
    tenth of its time); kept open, every read also comes from the file that
    was checked first, whatever is renamed into its place meanwhile. Nested
    blocks share the outer one's files. Threads other than the caller's open
    their own (a context variable does not follow them).
    """
    if _KEPT.get() is not None:
        yield
        return
    files: dict[str, io.BufferedReader] = {}
    token = _KEPT.set(files)
    try:
        yield
    finally:
        _KEPT.reset(token)
        for file in files.values():
            file.close()


@contextlib.contextmanager
def descriptor(path: str) -> Iterator[int]:
    """A descriptor of the regular file at ``path`` (:func:`open_file`), kept open inside :func:`keeping_open`.

    Raises:
        LoadError: see :func:`open_file`.
    """
    kept = _KEPT.get()
    file = kept.get(path) if kept is not None else None
    if file is not None:
        yield file.fileno()
        return
    if kept is None or len(kept) >= MAX_KEPT_OPEN:
        with open_file(path) as file:
            yield file.fileno()
        return
    file = kept[path] = open_file(path)
    yield file.fileno()


def read_limited(path: str, *, limit: int = MAX_TEXT_BYTES, folder: str | None = None, what: str = "file") -> bytes:
    """The whole content of a small regular file; refused when longer than ``limit`` bytes.

    Raises:
        LoadError: see :func:`open_file`.
        MalformedCheckpointError: the file holds more than ``limit`` bytes.
    """
    with open_file(path, folder=folder) as file:
        # read(limit + 1) allocates limit + 1 bytes first (100 MB for a shard index), whatever the size.
        data = file.read(min(os.fstat(file.fileno()).st_size, limit) + 1)
    if len(data) > limit:
        raise MalformedCheckpointError(
            f"{path!r} is larger than {limit:,} bytes, too large for a {what}; it is not one", path=path
        )
    return data


def _name_problem(name: object) -> str:
    """Why ``name`` is not a plain relative ``/``-separated file name inside a folder, or ``""``."""
    if not isinstance(name, str) or not name:
        return "is not a file inside its folder (it is not a file name)"
    parts = name.split("/")
    if os.path.isabs(name) or ".." in parts:
        return "is not a file inside its folder (it leads outside the checkpoint folder)"
    if "\\" in name or "\x00" in name:
        return "is not a file inside its folder (its name holds a backslash or a NUL character)"
    if any(part in ("", ".") for part in parts):
        return "is not a plain name of a file inside its folder (it has a '.' or an empty component)"
    return ""


def member(folder: str, name: object, *, source: str, what: str = "file") -> str:
    """The path of the file ``name`` a folder checkpoint refers to, checked by :func:`check_file`.

    ``name`` must be a relative ``/``-separated path without ``.`` or ``..``
    components, naming a regular file inside ``folder`` (links allowed only
    when they stay inside).

    Raises:
        MalformedCheckpointError: the name leads out of the folder or is not a name.
        LoadError: the file is missing, or is not a regular file.
    """
    problem = _name_problem(name)
    if problem or not isinstance(name, str):
        raise MalformedCheckpointError(
            f"{source!r} names the {what} {short_repr(name)}, which {problem}; the checkpoint is damaged", path=source
        )
    path = os.path.join(folder, *name.split("/"))
    if not os.path.lexists(path):
        raise MalformedCheckpointError(
            f"{source!r} lists the {what} {short_repr(name)}, which is missing; download or copy every file of the "
            "checkpoint",
            path=source,
        )
    check_file(path, folder=folder)
    return path
