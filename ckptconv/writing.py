"""Write: stream a state dict to ``.pt``, safetensors, a sharded folder or a DCP folder, atomically.

Bytes go from the input file to the output tensor by tensor, in bounded
chunks, so memory stays bounded by the largest tensor. The output is written to
a temporary file beside the destination and renamed into place only when it is
complete: an interrupted or failed write leaves the old file (or nothing),
never a truncated one (huggingface/safetensors#762).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import functools
import itertools
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
import warnings
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Union

from . import _cores, write_policy
from ._paths import PathLike, as_path, tilde_note
from ._text import shown
from .errors import CastOverflowError, CkptconvError, DestinationError, OutputExistsError, WriteError
from .formats import dcp, safetensors, sharded, torch_zip
from .formats._base import MetadataValue, metadata_text, split_aliases
from .formats.torch_zip import PlannedStorage
from .integrity import crc32, crc32_combine
from .options import TIED
from .read_policy import descriptor, keeping_open
from .standins import short_repr
from .streaming import iter_bytes_with_crcs, keeping_workers, reads_whole_record
from .suffixes import SAFETENSORS_SUFFIX, TAR_SUFFIX, TORCH_SUFFIXES
from .tensor import FileRegion, Storage, TensorRef, read_exactly_into

__all__ = ["WriteReport", "output_format", "save"]

Progress = Union[bool, Callable[[int], None]]

_FORMAT_NAMES = {
    "pt": "pt",
    "torch": "pt",
    "pth": "pt",
    "bin": "pt",
    "safetensors": "safetensors",
    "st": "safetensors",
    "dcp": "dcp",
}
_FORMAT_TITLES = {"pt": "torch", "safetensors": "safetensors", "dcp": "DCP"}
_COPY_CHUNK = 32 << 20
# Each thread copying through Python carries the bytes in one buffer of this size: it fits a core's
# L2 cache, so checksumming them and writing them out find them there (see _copy_through_buffers).
_COPY_BUFFER = 1 << 20
#: A copy through buffers is handed out to its threads in runs of this many bytes; the run's
#: CRC-32s are joined at the end (one crc32_combine per run: 0.7 ms per GiB).
_COPY_STRIPE = 8 << 20
_PAGE = torch_zip.PAGE
#: Copies up to this many bytes go through the output's own buffer: for small tensors the
#: system calls of a kernel copy (flush, seek, copy, seek) cost more than the bytes. At least
#: torch_zip.BUFFERED_RECORD, since records that small are filled into memory, not a file.
SMALL_COPY = torch_zip.BUFFERED_RECORD


@dataclass(frozen=True)
class WriteReport:
    """What :func:`save` wrote.

    Attributes:
        path: the output file, or folder.
        format: ``"pt"``, ``"safetensors"`` or ``"dcp"``.
        tensors: keys written (aliases included).
        bytes: tensor bytes written.
        aliases: for safetensors, keys stored as references to another key's data.
        files: every file written (one, or the shards and the index).
    """

    path: str
    format: str
    tensors: int
    bytes: int
    aliases: Mapping[str, str] = field(default_factory=dict)
    files: tuple[str, ...] = ()


def _suffix_format(name: str) -> tuple[str, str] | None:
    """The format a file name's suffix names, and the suffix; None for a name without one."""
    lowered = name.lower()
    if lowered.endswith(SAFETENSORS_SUFFIX):
        return "safetensors", name[-len(SAFETENSORS_SUFFIX) :]
    for suffix in (*TORCH_SUFFIXES, TAR_SUFFIX):  # longest first
        if lowered.endswith(suffix):
            return "pt", name[-len(suffix) :]
    return None


def output_format(path: PathLike, to: str | None = None, *, folder: bool = False) -> str:
    """``"pt"``, ``"safetensors"`` or ``"dcp"``: ``to`` if given, else from the destination's suffix.

    Folder outputs default to safetensors, as Hugging Face checkpoints are.

    Raises:
        DestinationError: ``to`` contradicts the destination's suffix (``o.safetensors`` with ``pt``).
        WriteError: neither ``to`` nor the suffix says which format to write.
    """
    text = as_path(path)
    named = None if folder or not text else _suffix_format(os.path.basename(text))
    if to is not None:
        name = _FORMAT_NAMES.get(to.lower())
        if name is None:
            raise WriteError(f"unknown output format {to!r}; use 'pt', 'safetensors' or 'dcp'")
        if name == "dcp" and not folder:
            raise WriteError("a DCP checkpoint is a folder; give a folder as the destination")
        if named is not None and named[0] != name:
            stem = text[: -len(named[1])]
            instead = stem + (".safetensors" if name == "safetensors" else ".pt")
            raise DestinationError(
                f"{text!r} is named as a {_FORMAT_TITLES[named[0]]} file but --to {to} writes a "
                f"{_FORMAT_TITLES[name]} file; write {instead!r} instead, or leave out --to",
                path=text,
            )
        return name
    if folder:
        return "safetensors"
    if named is not None:
        return named[0]
    torch_names = ", ".join(sorted({*TORCH_SUFFIXES, TAR_SUFFIX}, key=len))
    raise DestinationError(
        f"cannot tell the output format from {text!r}: end it in {SAFETENSORS_SUFFIX} or a torch file's "
        f"suffix ({torch_names}), end it in '/' for a folder of shards, or pass --to",
        path=text,
    )


def _source_paths(entries: Iterable[tuple[str, TensorRef]]) -> set[str]:
    """Every file the tensors are read from (a DCP tensor's chunks included)."""
    paths: set[str] = set()
    for _, ref in entries:
        paths |= ref.storage.source.paths()
    return paths


# Temporary files are created with O_TMPFILE where the file system supports it: they
# have no name until the finished file is linked into place, so a process killed by
# SIGKILL leaves nothing behind. Elsewhere they are named ``.NAME.<random>.partial``
# and locked (flock) for as long as their writer lives; a later write of the same
# output removes the ones whose lock it can take, as their writer is provably gone.
_USE_TMPFILE = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")
_PARTIAL = ".partial"


def _lock(fd: int) -> bool:
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
            if stat.S_ISREG(info.st_mode) and _lock(fd):
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
            _lock(fd)  # a name linked to it for a moment (overwrite) is then provably in use
            file = os.fdopen(fd, "r+b")
            file.raw.name = f"/proc/self/fd/{fd}"  # type: ignore[attr-defined]
            return file, None
    fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=_PARTIAL, dir=folder)
    _lock(fd)
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
    if reserve is not None and length > 0:
        reserve(fd, length)


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


def _copy_file_region(
    source: FileRegion, start: int, length: int, file: BinaryIO, *, checksum: bool = False
) -> Generator[int, None, int]:
    """Copy a run of ``source`` to the end of ``file``: see :func:`_copy_range`."""
    with descriptor(source.path) as src:
        return (yield from _copy_range(src, source.offset + start, length, file, source.path, checksum))


def _copy_range(
    src: int, offset: int, length: int, file: BinaryIO, path: str, checksum: bool = False
) -> Generator[int, None, int]:
    """Copy ``length`` bytes at ``offset`` of ``src`` to the end of ``file``, yielding byte counts.

    Returns the bytes' CRC-32 when ``checksum`` is set (0 otherwise), taken
    from the very bytes written. With no checksum wanted and both sides at the
    same offset within a page, the kernel copies (copy_file_range: the bytes
    never enter Python). Otherwise the bytes pass through buffers that fit a
    core's L2 cache and are checksummed there (:func:`_copy_through_buffers`):
    between offsets out of phase the kernel splits every page (1 GiB took
    0.38-0.47 s against 0.27 s through one buffer, CRC-32 included, on the
    development VM). Up to :data:`SMALL_COPY` bytes are written through
    ``file``'s own buffer, which gathers many small tensors into one write.
    """
    if length <= SMALL_COPY:
        data = bytearray(length)
        read_exactly_into(src, offset, memoryview(data), path)
        file.write(data)
        yield length
        return crc32(data) if checksum else 0
    file.flush()
    out = file.fileno()
    end = offset + length
    copy_range = getattr(os, "copy_file_range", None)
    if checksum or (offset - os.lseek(out, 0, os.SEEK_CUR)) % _PAGE:
        copy_range = None
    while offset < end and copy_range is not None:
        try:
            copied = copy_range(src, out, min(end - offset, _COPY_CHUNK), offset)
        except OSError as error:
            if error.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF):
                break  # this pair of file systems cannot; copy through the buffer
            raise
        if copied == 0:
            break  # the end of the file: the buffered read below refuses it in words
        offset += copied
        yield copied
    crc = 0
    if offset < end:
        crc = yield from _copy_through_buffers(src, offset, end - offset, out, path, checksum)
    file.seek(0, os.SEEK_END)  # the raw descriptor moved; resynchronise the buffered file
    return crc


def _copy_through_buffers(
    src: int, offset: int, length: int, out: int, path: str, checksum: bool
) -> Generator[int, None, int]:
    """Copy ``length`` bytes at ``offset`` of ``src`` to the end of ``out``, through L2-sized buffers.

    Runs of :data:`_COPY_STRIPE` bytes are handed out in turn to this thread
    and, where a core is spare (:func:`ckptconv._cores.spare`) and the copy
    has more than one run, to a second one: while one waits for the kernel to
    fill its page-cache pages, the other reads or checksums (1 GiB on the
    2-core VM: 0.32 s against 0.46 s for one thread). Each thread writes its
    run at the run's place (``pwrite``), through a buffer of its own that
    stays in its core's cache. Returns the bytes' CRC-32 when ``checksum`` is
    set, else 0; yields byte counts as runs complete.
    """
    position = os.lseek(out, 0, os.SEEK_CUR)
    stripes = range(0, length, _COPY_STRIPE)
    crcs = [0] * len(stripes)
    next_stripe = itertools.count().__next__  # atomic under the GIL: each run is taken once
    stop = threading.Event()
    helped: list[int] = [0]  # bytes the second thread copied; only it writes this
    failure: list[BaseException] = []

    def copy_stripes(buffer: memoryview, copied: list[int] | None) -> Iterator[int]:
        while not stop.is_set():
            index = next_stripe()
            if index >= len(stripes):
                return
            start = stripes[index]
            stripe_end = min(start + _COPY_STRIPE, length)
            crc = 0
            while start < stripe_end:
                view = buffer[: min(stripe_end - start, len(buffer))]
                read_exactly_into(src, offset + start, view, path)  # a file cut short since it was opened: one line
                if checksum:
                    crc = crc32(view, crc)
                written = 0
                while written < view.nbytes:
                    written += os.pwrite(out, view[written:], position + start + written)
                start += view.nbytes
                if copied is not None:
                    copied[0] += view.nbytes
                else:
                    yield view.nbytes
            crcs[index] = crc

    def second_thread() -> None:
        try:
            for _ in copy_stripes(memoryview(bytearray(_COPY_BUFFER)), helped):
                pass
        except BaseException as error:  # re-raised by the first thread
            failure.append(error)
            stop.set()

    helper = None
    if len(stripes) > 1 and _cores.spare():
        helper = threading.Thread(target=second_thread, name="ckptconv-copy", daemon=True)
        helper.start()
    helper_reported = 0
    try:
        for count in copy_stripes(memoryview(bytearray(min(length, _COPY_BUFFER))), None):
            helper_count = helped[0]
            yield count + helper_count - helper_reported
            helper_reported = helper_count
    finally:
        stop.set()  # every run is taken by now, unless this copy failed or was abandoned
        if helper is not None:
            _cores.join_uninterrupted(helper)
    if failure:
        raise failure[0]
    if helped[0] > helper_reported:
        yield helped[0] - helper_reported
    os.lseek(out, position + length, os.SEEK_SET)
    crc = 0
    for index, start in enumerate(stripes if checksum else ()):
        crc = crc32_combine(crc, crcs[index], min(_COPY_STRIPE, length - start))
    return crc


def _write_tensor(ref: TensorRef, file: BinaryIO, record_crcs: dict[Storage, int] | None = None) -> Iterator[int]:
    """Write one tensor's contiguous bytes; a plain copy when nothing needs converting.

    With ``record_crcs``, a copy of a whole zip record takes the record's
    CRC-32 on the way (:func:`reads_whole_record`), so that checking the
    source needs no read of its own.
    """
    if ref.verbatim_region is None:
        for chunk in ref.iter_bytes(record_crcs=record_crcs):
            file.write(chunk)
            yield len(chunk)
        return
    yield from _copy_verbatim(ref, file, record_crcs)


def _copy_verbatim(
    ref: TensorRef, file: BinaryIO, record_crcs: dict[Storage, int] | None, *, checksum: bool = False
) -> Generator[int, None, int]:
    """Copy a tensor stored as is (:attr:`TensorRef.verbatim_region`); return the bytes' CRC-32
    if taken (``checksum``, or a whole zip record whose CRC-32 goes into ``record_crcs``), else 0."""
    region = ref.verbatim_region
    assert region is not None
    takes_record = record_crcs is not None and reads_whole_record(ref)
    crc = yield from _copy_file_region(*region, file, checksum=checksum or takes_record)
    if takes_record and record_crcs is not None:
        record_crcs[ref.storage] = crc
    return crc


def _write_planned_storage(
    storage: PlannedStorage,
    file: BinaryIO,
    update: Callable[[int], None],
    record_crcs: dict[Storage, int] | None = None,
) -> int:
    """Write one output storage record and return its CRC-32.

    A run of a file is copied (:func:`_copy_range`). A whole zip record keeps
    the CRC-32 its source recorded, so that one converted with the check off
    (``--no-crc-check``) is still seen as damaged; with the check on, the copy
    takes the bytes' CRC-32 for it on the way (:func:`reads_whole_record`).
    Other runs are checksummed as they are copied; anything else is streamed
    in chunks and checksummed.
    """
    ref = storage.tensor
    region = ref.verbatim_region
    if region is None:
        return _write_with_crc(iter_bytes_with_crcs(ref, record_crcs=record_crcs), file, update)
    recorded = region[0].crc32 if ref.is_whole_storage else None
    crc = _run(_copy_verbatim(ref, file, record_crcs, checksum=recorded is None), update)
    return crc if recorded is None else recorded


def _run(steps: Generator[int, None, int], update: Callable[[int], None]) -> int:
    """Run a copy to its end, reporting each byte count; return what it returns."""
    while True:
        try:
            update(next(steps))
        except StopIteration as end:
            result: int = end.value
            return result


def _write_with_crc(
    chunks: Iterable[tuple[memoryview, int | None]], file: BinaryIO, update: Callable[[int], None]
) -> int:
    """Write chunks and return their CRC-32.

    A chunk that comes with its CRC-32 (a cast thread took it while the bytes
    were in its cache) is joined in (:func:`crc32_combine`); for the others,
    one chunk is checksummed on a second thread while the kernel writes it
    (crc32 and os.write both release the GIL, so on two cores the checksum
    costs almost nothing on top of the write).
    """
    crc = 0
    pieces = iter(chunks)
    for first in pieces:
        small, small_crc = first
        if small.nbytes > SMALL_COPY:
            break
        # A small chunk goes through the file's buffer, checksummed here: no thread to start.
        crc = crc32(small, crc) if small_crc is None else crc32_combine(crc, small_crc, small.nbytes)
        file.write(small)
        update(small.nbytes)
    else:
        return crc
    file.flush()
    fd = file.fileno()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        for chunk, chunk_crc in itertools.chain([first], pieces):
            pending = pool.submit(crc32, chunk, crc) if chunk_crc is None else None
            view = chunk
            while view.nbytes:
                view = view[os.write(fd, view) :]
            crc = pending.result() if pending is not None else crc32_combine(crc, chunk_crc or 0, chunk.nbytes)
            update(chunk.nbytes)
    file.seek(0, os.SEEK_END)  # the raw descriptor moved; resynchronise the buffered file
    return crc


def _progress_callback(progress: Progress, total: int, path: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    if callable(progress):
        return progress, lambda: None
    if not progress:
        return (lambda n: None), (lambda: None)
    from tqdm.auto import tqdm

    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=shown(os.path.basename(path)),  # a file name could hold terminal escape sequences
        leave=False,
        dynamic_ncols=True,
    )

    def update(count: int) -> None:
        bar.update(count)

    return update, bar.close


def fills_record_crcs(kind: str) -> bool:
    """Whether :func:`save` of ``kind`` puts the CRC-32s of the zip records it reads whole into
    ``record_crcs``; DCP folders are written by torch.save, which takes none."""
    return kind != "dcp"


def save(
    state: Mapping[str, Any],
    path: PathLike,
    *,
    to: str | None = None,
    overwrite: bool = False,
    metadata: Mapping[str, MetadataValue] | None = None,
    extra: Mapping[str, Any] | None = None,
    max_shard_size: int | None = None,
    progress: Progress = False,
    inputs: Iterable[str] = (),
    check: Callable[[str], None] | None = None,
    fsync: bool = True,
    tied: str = "dedupe",
    format: str | None = None,
    record_crcs: dict[Storage, int] | None = None,
) -> WriteReport:
    """Write a state dict to ``.pt``, safetensors, shards or a DCP folder, streaming, atomically.

    A destination that is a folder (it exists, or ends in ``/``), or any
    destination with ``max_shard_size`` or ``to="dcp"``, gets a folder
    layout: ``model.safetensors`` or ``model-0000k-of-0000N.safetensors`` plus
    ``model.safetensors.index.json`` (``pytorch_model*.bin`` for ``pt``), or a
    DCP folder (``.metadata`` and ``__0_0.distcp``).

    Args:
        state: names to tensors: lazy :class:`~ckptconv.tensor.TensorRef` from
            :func:`ckptconv.open`, or torch tensors.
        path: the output file or folder.
        to: ``"pt"``, ``"safetensors"`` or ``"dcp"``; from the suffix of
            ``path`` when None (safetensors for folders). The same word as
            :func:`ckptconv.convert` and :func:`ckptconv.batch` use.
        overwrite: replace existing outputs, and remove shards an earlier run
            left that this one does not write.
        metadata: string metadata: safetensors ``__metadata__``, or the
            ``ckptconv.json`` record of a ``.pt`` file (also in a shard index).
        extra: ``.pt`` only: plain data (numbers, strings, tuples, lists, sets, dicts) to keep
            beside the weights, which then sit under ``"state_dict"``.
        max_shard_size: split into shards of at most this many bytes (a tensor
            larger than that gets a shard of its own).
        progress: show a progress bar on stderr, or a callable given byte counts.
        inputs: other files that must never be written, replaced or deleted (every
            file of the checkpoint read, :attr:`ckptconv.Checkpoint.files`); a folder
            output may not be a folder that holds one of them.
        check: called with the finished output's path (the temporary file, or
            the folder once written); an exception from it leaves no output behind.
        fsync: flush the output to disk before it appears under its name
            (durable across power loss); False is faster for scratch files.
        tied: for safetensors, keys that share one tensor (tied weights):
            ``"dedupe"`` stores it once and lists the other names in the file's
            ``ckptconv.aliases`` metadata, as Hugging Face files do (load with
            ``safetensors.torch.load_model(model, path)`` or :func:`ckptconv.load`);
            ``"copy"`` writes it under every name, so that
            ``model.load_state_dict(safetensors.torch.load_file(path), strict=True)``
            accepts the file. ``.pt`` files always keep tied tensors shared.
        format: deprecated spelling of ``to``.
        record_crcs: a dict that receives the CRC-32 of each whole source
            record a cast reads, taken from the bytes it cast (see
            :func:`ckptconv.streaming.iter_bytes`); a converter checks them
            with :func:`ckptconv.integrity.check_record_crcs` (``computed=``)
            instead of reading those records again.

    Returns:
        A :class:`WriteReport`.

    Raises:
        OutputExistsError: an output exists and ``overwrite`` is False.
        WriteError: the output cannot be written, or is one of the inputs.
        CastOverflowError: a pending fp16/bf16 cast would create infinities.

    Example:
        >>> ckptconv.save(model.state_dict(), "model.safetensors")  # doctest: +SKIP
        >>> ckptconv.save(state, "out/", max_shard_size=5 * 10**9)   # doctest: +SKIP
    """
    if format is not None:
        warnings.warn(
            "ckptconv.save(format=...) is deprecated; use to=..., as convert() and batch() do",
            DeprecationWarning,
            stacklevel=2,
        )
        if to is not None and to != format:
            raise ValueError(f"save() got to={to!r} and its deprecated spelling format={format!r}; pass only to")
        to = format
    if tied not in TIED:
        raise ValueError(f"tied must be one of {', '.join(TIED)}, not {tied!r}")
    path = as_path(path)
    entries = _entries(state)
    target = os.path.abspath(path)
    protected = write_policy.Inputs([*_source_paths(entries), *inputs])
    folder_output = is_folder_destination(path, to, max_shard_size)
    kind = output_format(path, to, folder=folder_output)
    # One plan of a .pt file's storages serves the room check and the write: with 10^5 tensors
    # planning costs seconds.
    zip_plan = torch_zip.plan_storages(entries) if kind == "pt" and not folder_output else None
    _check_room(entries, target, kind, planned_bytes(entries, kind, zip_plan=zip_plan))
    total = sum(ref.nbytes for _, ref in entries)
    update, close = _progress_callback(progress, total, target)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(close)
        cleanup.enter_context(keeping_open())  # each source file opened once for all its tensors
        cleanup.enter_context(keeping_workers())  # one pool of cast threads for all the tensors
        if folder_output:
            return _save_folder(
                entries,
                target,
                kind,
                overwrite=overwrite,
                metadata=metadata,
                extra=extra,
                max_shard_size=max_shard_size,
                update=update,
                inputs=protected,
                check=check,
                fsync=fsync,
                dedupe=tied == "dedupe",
                record_crcs=record_crcs,
            )
        protected.check_file(target)
        return _save_file(
            entries,
            target,
            kind,
            zip_plan=zip_plan,
            inputs=protected,
            overwrite=overwrite,
            metadata=metadata,
            extra=extra,
            update=update,
            check=check,
            fsync=fsync,
            dedupe=tied == "dedupe",
            record_crcs=record_crcs,
        )


def is_folder_destination(path: PathLike, format: str | None, max_shard_size: int | None) -> bool:
    """True when ``save`` writes a folder layout to ``path``.

    Raises:
        DestinationError: a folder would be created under a file's name (``m5.safetensors``
            with ``max_shard_size``, or with ``format="dcp"``).
    """
    text = as_path(path)
    if os.path.isdir(text) or text.endswith(("/", os.sep)):
        return True
    dcp = (format or "").lower() == "dcp"
    if max_shard_size is None and not dcp:
        return False
    named = _suffix_format(os.path.basename(text))
    if named is not None and not os.path.exists(text):  # an existing file is refused when writing
        cause = "--to dcp writes a folder" if dcp else "--max-shard-size writes a folder of shards and an index"
        folder = text[: -len(named[1])] + "/"
        one_file = "leave out --to dcp" if dcp else "leave out --max-shard-size"
        raise DestinationError(
            f"{text!r} is named like a file, but {cause}; write {folder!r} instead, "
            f"or {one_file} to write the one file {text!r}",
            path=text,
        )
    return True


def _save_file(
    entries: list[tuple[str, TensorRef]],
    target: str,
    kind: str,
    *,
    overwrite: bool,
    metadata: Mapping[str, MetadataValue] | None,
    extra: Mapping[str, Any] | None,
    update: Callable[[int], None],
    check: Callable[[str], None] | None,
    fsync: bool,
    dedupe: bool = True,
    record_crcs: dict[Storage, int] | None = None,
    inputs: write_policy.Inputs | None = None,
    zip_plan: torch_zip.Plan | None = None,
) -> WriteReport:
    aliases: dict[str, str] = {}
    if kind == "pt" and zip_plan is None:
        zip_plan = torch_zip.plan_storages(entries)
    reserve = planned_bytes(entries, kind, zip_plan=zip_plan)
    with atomic_output(target, overwrite=overwrite, fsync=fsync, reserve=reserve, inputs=inputs) as file:
        if kind == "safetensors":

            def write_tensor(ref: TensorRef, out: BinaryIO) -> Iterator[int]:
                for count in _with_key(entries, ref, _write_tensor(ref, out, record_crcs)):
                    update(count)
                    yield count

            written = safetensors.write(entries, file, metadata=metadata, write_tensor=write_tensor, dedupe=dedupe)
            aliases = split_aliases(entries)[1] if dedupe else {}
        else:

            def write_storage(storage: PlannedStorage, out: BinaryIO) -> int:
                try:
                    return _write_planned_storage(storage, out, update, record_crcs)
                except CastOverflowError as error:  # named by the first tensor stored in that storage
                    key = next((k for k, r in entries if r.storage is storage.tensor.storage), "?")
                    raise _named(error, key) from None

            written = torch_zip.write(
                entries,
                file,
                write_storage=write_storage,
                plan=zip_plan,
                metadata=metadata,
                extra=extra,
            )
        if check is not None:
            file.flush()
            check(file.name)
    return WriteReport(target, kind, len(entries), written, aliases, (target,))


def _save_folder(
    entries: list[tuple[str, TensorRef]],
    folder: str,
    kind: str,
    *,
    overwrite: bool,
    metadata: Mapping[str, MetadataValue] | None,
    extra: Mapping[str, Any] | None,
    max_shard_size: int | None,
    update: Callable[[int], None],
    inputs: write_policy.Inputs,
    check: Callable[[str], None] | None,
    fsync: bool,
    dedupe: bool = True,
    record_crcs: dict[Storage, int] | None = None,
) -> WriteReport:
    """Write a sharded or DCP folder: each file atomically, the index last, stale shards only with overwrite."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise WriteError(f"{folder!r} is a file; give a folder for a sharded or DCP output", path=folder)
    inputs.check_folder(folder)
    if kind == "dcp":
        plan = None
        names = [dcp.DATA_FILE, dcp.METADATA_FILE]
        family = re.compile(r"^(__\d+_\d+\.distcp|\.metadata)$")
    else:
        plan = sharded.plan_shards(entries, max_shard_size)
        shard_files, index_file = sharded.shard_names(kind, len(plan.shards))
        names = shard_files + ([index_file] if len(shard_files) > 1 else [])
        family = sharded.family_pattern(kind)
    existing = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    clashes = sorted(name for name in existing if name in names)
    stale = sorted(name for name in existing if family.match(name) and name not in names)
    if (clashes or stale) and not overwrite:
        described = ", ".join((clashes + stale)[:4]) + (" ..." if len(clashes + stale) > 4 else "")
        raise OutputExistsError(
            f"{folder!r} already holds {described}"
            + (" (left by an earlier run)" if stale and not clashes else "")
            + "; pass --overwrite to replace them",
            path=folder,
        )
    for name in names:
        inputs.check_file(os.path.join(folder, name), action="replace")
    for name in stale:
        inputs.check_file(os.path.join(folder, name), action="delete")
    created = write_policy.make_folders(folder)
    written_files: list[str] = []
    aliases: dict[str, str] = {}
    try:
        if plan is None:

            def open_output(name: str) -> Any:
                written_files.append(os.path.join(folder, name))
                return atomic_output(os.path.join(folder, name), overwrite=True, fsync=fsync, inputs=inputs)

            total = dcp.write(entries, folder, open_output=open_output, on_bytes=update)
        else:
            total = 0
            weight_map: dict[str, str] = {}
            for shard, name in zip(plan.shards, shard_files):
                # Shards are plain state dicts (what transformers loads); `extra` is for single files.
                report = _save_file(
                    list(shard),
                    os.path.join(folder, name),
                    kind,
                    inputs=inputs,
                    overwrite=True,
                    metadata=metadata,
                    extra=None,
                    update=update,
                    check=None,
                    fsync=fsync,
                    dedupe=dedupe,
                    record_crcs=record_crcs,
                )
                written_files.append(report.path)
                total += report.bytes
                aliases.update(report.aliases)
                weight_map.update({key: name for key, _ in shard if key not in report.aliases})
            if len(shard_files) > 1:
                index_metadata = {k: metadata_text(v) for k, v in (metadata or {}).items() if k.startswith("ckptconv.")}
                document = sharded.index_document(weight_map, total, index_metadata)
                index_path = os.path.join(folder, index_file)
                with atomic_output(index_path, overwrite=True, fsync=fsync, inputs=inputs) as file:
                    file.write(document)
                written_files.append(os.path.join(folder, index_file))
        if check is not None:
            # The files this write made, not whatever else the folder holds.
            check(folder if plan is None else written_files[-1])
    except BaseException:
        for path in written_files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        write_policy.remove_folders(created)
        raise
    for name in stale:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(folder, name))
    return WriteReport(folder, kind, len(entries), total, aliases, tuple(written_files))


def _with_key(entries: list[tuple[str, TensorRef]], ref: TensorRef, counts: Iterator[int]) -> Iterator[int]:
    try:
        yield from counts
    except CastOverflowError as error:
        raise _named(error, next((k for k, r in entries if r is ref), "?")) from None


def _named(error: CastOverflowError, key: str) -> CastOverflowError:
    """``error`` saying which tensor it is about, as every format's writer reports it."""
    return CastOverflowError(f"tensor {key!r}: {error}", key=key, count=error.count)


def planned_bytes(
    entries: Sequence[tuple[str, TensorRef]], kind: str, *, zip_plan: torch_zip.Plan | None = None
) -> int:
    """Tensor bytes an output of ``kind`` will hold: ``.pt`` keeps views and ties as torch.save
    does (``zip_plan``, when already made, says how); the other formats store each distinct
    tensor once, contiguous."""
    if kind == "pt":
        storages, _ = zip_plan or torch_zip.plan_storages(entries)
        return sum(storage.nbytes for storage in storages)
    return sum(ref.nbytes for ref in {ref: None for _, ref in entries})


def _check_room(entries: Sequence[tuple[str, TensorRef]], target: str, kind: str, needed: int) -> None:
    """Refuse, before anything is allocated or written, an output larger than the free space.

    A view can repeat a few stored bytes (stride 0) into terabytes: a 600-byte
    ``.pt`` can ask for more than any disk holds once written contiguously.
    """
    from .report import human_bytes

    folder = os.path.dirname(target)
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        usage = shutil.disk_usage(folder or ".")
    except OSError:
        return  # no answer from the file system: the write itself will say
    # A file system of no size (/proc, /sys) answers 0 free: whether a file can be made there at all, the
    # write itself says ("needs 88 B but only 0 B are free" was no answer).
    if needed <= usage.free or usage.total == 0:
        return
    free = usage.free
    key, ref = max(entries, key=lambda entry: entry[1].nbytes)
    start, stop = ref.byte_span
    largest = f"; tensor {short_repr(key)} alone is {human_bytes(ref.nbytes)}"
    if ref.nbytes > 2 * (stop - start):
        largest += f", a view that repeats {human_bytes(stop - start)} of stored bytes"
    raise WriteError(
        f"writing {target!r} as {kind} needs {human_bytes(needed)} but only {human_bytes(free)} "
        f"are free there{largest}",
        path=target,
    )


def _entries(state: Mapping[str, Any]) -> list[tuple[str, TensorRef]]:
    entries: list[tuple[str, TensorRef]] = []
    cache: dict[Any, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise WriteError(f"state dict key {key!r} is not a string")
        if isinstance(value, TensorRef):
            entries.append((key, value))
        else:
            from ._torch import from_torch

            try:
                entries.append((key, from_torch(value, cache)))
            except TypeError:
                raise WriteError(
                    f"{key!r} holds a {type(value).__name__}, not a tensor; only tensors can be written"
                ) from None
            except CkptconvError as error:
                raise WriteError(f"{key!r} cannot be written: {error}") from None
    return entries
