"""Atomic output: a file appears at its name only when complete, and nothing is left behind on failure.

Temporary files are O_TMPFILE (linked into place when complete) where the file system allows, else
hidden .NAME.<random>.partial files locked while written; writeback is started as bytes arrive
and space is reserved up front, so a full disk fails before the bytes are copied."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import stat
import struct
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO, Callable

from ckptconv._paths import PathLike, as_path, tilde_note
from ckptconv.errors import OutputExistsError, WriteError
from ckptconv.writing import faults, write_policy

# Temporary files are created with O_TMPFILE where the file system supports it: they
# have no name until the finished file is linked into place, so a process killed by
# SIGKILL leaves nothing behind. Elsewhere they are named ``.NAME.<random>.partial``
# and locked (flock) for as long as their writer lives; a later write of the same
# output removes the ones whose lock it can take, as their writer is provably gone.
_USE_TMPFILE = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")

_PARTIAL = ".partial"


def try_lock(fd: int) -> bool:
    """Take an exclusive lock without waiting; False when another process holds it."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock; stale partial files are then left for the user
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held by a live writer, or no locks on this file system
    return True


def remove_abandoned(folder: str, name: str, *, inputs: write_policy.Inputs | None = None) -> list[str]:
    """Remove ``.NAME.*.partial`` files in ``folder`` whose writer is gone (their lock is free).

    A file of the input (``inputs``) is never removed, whatever its name: someone
    may convert a file rescued from a killed run under the name that run gave it.

    Returns:
        The paths removed.
    """
    pattern = re.compile(rf"\.{re.escape(name)}\.[A-Za-z0-9_]{{8}}{re.escape(_PARTIAL)}\Z")
    removed: list[str] = []
    try:
        entries = os.listdir(folder)
    except OSError:
        return removed
    for entry in entries:
        if not pattern.match(entry):
            continue
        path = os.path.join(folder, entry)
        if inputs is not None and inputs.holds(path):
            continue
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(path, flags)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode) and try_lock(fd):
                current = os.lstat(path)
                if (current.st_dev, current.st_ino) == (info.st_dev, info.st_ino):
                    os.unlink(path)
                    removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _temporary(folder: str, name: str) -> tuple[BinaryIO, str | None]:
    """An open file to write the output to, and its name (None: it has none yet, O_TMPFILE)."""
    if _USE_TMPFILE:
        try:
            fd = os.open(folder, os.O_TMPFILE | os.O_RDWR | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                raise
        else:
            try_lock(fd)  # a name linked to it for a moment (overwrite) is then provably in use
            file = os.fdopen(fd, "r+b")
            file.raw.name = f"/proc/self/fd/{fd}"  # type: ignore[attr-defined]
            return file, None
    fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=_PARTIAL, dir=folder)
    try_lock(fd)
    if hasattr(os, "fchmod"):
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes it 0600; outputs get the usual mode
    file = os.fdopen(fd, "r+b")
    file.raw.name = temporary  # type: ignore[attr-defined]
    return file, temporary


def _publish(file: BinaryIO, temporary: str | None, target: str, *, overwrite: bool, shown: str) -> None:
    """Give the finished temporary file its final name."""
    folder, name = os.path.split(target)
    exists = f"{shown!r} already exists; pass --overwrite to replace it"
    if temporary is None:
        directory = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            if not overwrite:
                try:
                    # linkat(AT_SYMLINK_FOLLOW) through /proc: the nameless file gets its name.
                    os.link(file.name, name, dst_dir_fd=directory, follow_symlinks=True)
                except FileExistsError:
                    raise OutputExistsError(exists, path=target) from None
                return
            staged = f".{name}.{os.urandom(4).hex()}{_PARTIAL}"
            os.link(file.name, staged, dst_dir_fd=directory, follow_symlinks=True)
            try:
                os.replace(staged, name, src_dir_fd=directory, dst_dir_fd=directory)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(staged, dir_fd=directory)
                raise
        finally:
            os.close(directory)
        return
    if overwrite:
        os.replace(temporary, target)
        return
    # link() refuses to replace, so a file that appeared meanwhile is never clobbered.
    try:
        os.link(temporary, target)
    except FileExistsError:
        raise OutputExistsError(exists, path=target) from None
    except OSError:
        if os.path.lexists(target):
            raise
        os.replace(temporary, target)  # filesystems without hard links
    else:
        os.unlink(temporary)


def _umask() -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


#: sync_file_range's flag that starts writing dirty pages to disk without waiting for them.
_SYNC_FILE_RANGE_WRITE = 2

#: Seconds between two writeback starts while an output is written.
WRITEBACK_INTERVAL = 0.05


@functools.cache
def _start_writeback_function() -> Callable[[int], int] | None:
    """``start(fd)``: begin writing the file's dirty pages to disk and return at once (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range  # the C library Python already uses
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return lambda fd: int(function(fd, 0, 0, _SYNC_FILE_RANGE_WRITE))


@contextlib.contextmanager
def _writeback(fd: int) -> Iterator[None]:
    """Keep the disk writing the file's pages while the file is being written.

    Without it every byte waits in the page cache until the final fsync, which
    then writes them all (0.28 s of a 1 GiB copy's 0.62 s on the development
    VM); started along the way, the writes overlap the copy and the fsync
    waits for the last pages only (0.02 s; ``cp && sync`` pays the whole 0.28 s).
    """
    start = _start_writeback_function()
    if start is None:
        yield
        return
    finished = threading.Event()

    def keep_writing_back() -> None:
        while not finished.wait(WRITEBACK_INTERVAL):
            if start(fd) != 0:
                return  # the file system cannot (errno): the fsync at the end does it all

    thread = threading.Thread(target=keep_writing_back, name="ckptconv-writeback", daemon=True)
    thread.start()
    try:
        yield
    finally:
        finished.set()
        thread.join()  # before the caller's fsync and close: the descriptor must outlive it


#: fallocate's flag that reserves blocks without changing the file's size.
_FALLOC_FL_KEEP_SIZE = 1


@functools.cache
def _reserve_function() -> Callable[[int, int], int] | None:
    """``reserve(fd, length)``: have the file system allocate a new file's first ``length`` bytes now (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        # fallocate(2) itself, not posix_fallocate: where the file system cannot, the C library's
        # posix_fallocate writes zeros instead, which costs what it was meant to save.
        function = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    function.restype = ctypes.c_int
    return lambda fd, length: int(function(fd, _FALLOC_FL_KEEP_SIZE, 0, length))


def _reserve(fd: int, length: int) -> None:
    """Allocate the blocks of bytes about to be written in one step.

    Otherwise ext4 reserves and maps blocks page by page as the writes come
    (delayed allocation): a 1 GiB copy took 0.32 s that way against 0.26 s
    reserved first, and 0.69 against 0.54-0.60 s with its fsync (development
    VM). ``length`` must not exceed what is written, since blocks reserved past
    the end stay allocated. A file system that cannot reserve (or a full disk,
    which the writes then report) is left to allocate as it goes.
    """
    reserve = _reserve_function()
    if reserve is not None and length > 0 and not _in_memory(fd):
        reserve(fd, length)


# statfs's f_type of tmpfs (linux/magic.h): its fallocate zeroes the pages the writes then fill again,
# 0.93 s of a 1.2 GB bf16 output in /dev/shm on the development VM.
_TMPFS_MAGIC = 0x01021994


@functools.cache
def _fstatfs() -> Any:
    """The C library's ``fstatfs``, or None."""
    try:
        return ctypes.CDLL(None, use_errno=True).fstatfs
    except (OSError, AttributeError):
        return None


def _in_memory(fd: int) -> bool:
    """True when ``fd`` is a file of tmpfs (Linux; False where that cannot be told)."""
    fstatfs = _fstatfs()
    buffer = ctypes.create_string_buffer(256)  # struct statfs, whose first field is f_type (a long)
    if fstatfs is None or fstatfs(ctypes.c_int(fd), buffer) != 0:
        return False
    return int(struct.unpack_from("l", buffer.raw)[0]) == _TMPFS_MAGIC


@contextlib.contextmanager
def atomic_output(
    path: PathLike,
    *,
    overwrite: bool = False,
    fsync: bool = True,
    reserve: int = 0,
    inputs: write_policy.Inputs | None = None,
) -> Iterator[BinaryIO]:
    """A file to write; it appears at ``path`` only if the block finishes without error.

    The file has no name while it is written (``O_TMPFILE``) where the file
    system allows, so even SIGKILL leaves nothing; elsewhere it is a locked
    ``.NAME.<random>.partial`` file, removed on any error, and by a later write
    of the same output if its writer was killed. ``file.name`` is a path that
    reads the unfinished file (for verification before it is published).

    With ``fsync`` the bytes reach the disk before the rename, so even a power
    cut never leaves a truncated file under the final name; without it the
    rename still protects against crashes and kills of the process.

    ``reserve``: bytes the file will hold at least, allocated on disk up front (:func:`_reserve`).
    ``inputs``: files that are never removed as a killed run's leftovers (:func:`remove_abandoned`).

    Raises:
        OutputExistsError: ``path`` exists and ``overwrite`` is False.
        WriteError: the folder is missing or not writable, the disk is full, ...
    """
    shown = as_path(path)
    target = os.path.abspath(shown)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        raise WriteError(f"{shown!r} is a folder; give a file name for the output", path=target)
    if not os.path.isdir(folder):
        try:
            os.stat(folder)
        except OSError as error:
            if error.errno == errno.ENAMETOOLONG:
                raise write_policy.os_error(error, target) from None
        raise WriteError(f"folder {folder!r} does not exist{tilde_note(shown)}; create it first", path=target)
    if os.path.lexists(target) and not overwrite:
        raise OutputExistsError(f"{shown!r} already exists; pass --overwrite to replace it", path=target)
    write_policy.check_replaceable(target, shown)
    remove_abandoned(folder, os.path.basename(target), inputs=inputs)
    try:
        faults.point(f"write {os.path.basename(target)}")
        file, temporary = _temporary(folder, os.path.basename(target))
    except OSError as error:
        raise write_policy.os_error(error, target) from None
    try:
        with file:
            _reserve(file.fileno(), reserve)
            with _writeback(file.fileno()) if fsync else contextlib.nullcontext():
                yield file
                file.flush()
            if fsync:
                os.fsync(file.fileno())
            faults.point(f"name {os.path.basename(target)}")
            _publish(file, temporary, target, overwrite=overwrite, shown=shown)
        with contextlib.suppress(OSError):
            if not fsync:
                raise OSError  # skip the directory sync too
            directory = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
    except BaseException as error:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        if isinstance(error, OSError) and not isinstance(error, WriteError):
            raise write_policy.os_error(error, target) from None
        raise
