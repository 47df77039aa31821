"""Copy engines: a tensor's bytes from its source to the output file, as fast as the kernel allows.

A run of the input file as stored goes through ``copy_file_range`` (no bytes through Python);
other tensors stream through reused buffers on several threads, taking CRC-32s as they pass."""

from __future__ import annotations

import concurrent.futures
import errno
import itertools
import os
import threading
from collections.abc import Generator, Iterable, Iterator
from typing import BinaryIO, Callable

from ckptconv.errors import CastOverflowError
from ckptconv.reading.checksums import crc32, crc32_combine
from ckptconv.reading.read_policy import descriptor
from ckptconv.reading.sources import read_exactly_into
from ckptconv.reading.streaming import iter_bytes_with_crcs, reads_whole_record
from ckptconv.runtime import cores as _cores
from ckptconv.values.tensor import Storage, StoredRegion, TensorRef
from ckptconv.writing import torch_zip as zip_writer
from ckptconv.writing.torch_zip import PlannedStorage

_COPY_CHUNK = 32 << 20

# Each thread copying through Python carries the bytes in one buffer of this size: it fits a core's
# L2 cache, so checksumming them and writing them out find them there (see _copy_through_buffers).
_COPY_BUFFER = 1 << 20

#: A copy through buffers is handed out to its threads in runs of this many bytes; the run's
#: CRC-32s are joined at the end (one crc32_combine per run: 0.7 ms per GiB).
_COPY_STRIPE = 8 << 20

_PAGE = zip_writer.PAGE

#: Copies up to this many bytes go through the output's own buffer: for small tensors the
#: system calls of a kernel copy (flush, seek, copy, seek) cost more than the bytes. At least
#: zip_writer.BUFFERED_RECORD, since records that small are filled into memory, not a file.
SMALL_COPY = zip_writer.BUFFERED_RECORD


def _copy_file_region(
    source: StoredRegion, start: int, length: int, file: BinaryIO, *, checksum: bool = False
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
    and, where a core is spare (:func:`ckptconv.runtime.cores.spare`) and the copy
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


def stream_tensor(ref: TensorRef, file: BinaryIO, record_crcs: dict[Storage, int] | None = None) -> Iterator[int]:
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


def write_planned_storage(
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


def naming_overflows(entries: list[tuple[str, TensorRef]], ref: TensorRef, counts: Iterator[int]) -> Iterator[int]:
    try:
        yield from counts
    except CastOverflowError as error:
        raise overflow_named(error, next((k for k, r in entries if r is ref), "?")) from None


def overflow_named(error: CastOverflowError, key: str) -> CastOverflowError:
    """``error`` saying which tensor it is about, as every format's writer reports it."""
    return CastOverflowError(f"tensor {key!r}: {error}", key=key, count=error.count)
