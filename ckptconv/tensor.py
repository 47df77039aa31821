"""Lazy tensors: where a tensor's bytes are, not the bytes themselves.

Loading a checkpoint produces :class:`TensorRef` objects. Each one points into a
:class:`Storage` (a run of bytes in the input file, or in memory) with an
offset, shape and stride, exactly like a torch tensor points into its storage.
Nothing is read until a writer asks for the bytes, so peak memory is bounded by
the largest tensor, never by the checkpoint. Tensors that share a storage in the
file share one :class:`Storage` object here, which is how tied weights and views
survive a conversion.

This module does not import torch.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import math
import os
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from .dtypes import DType
from .errors import CastOverflowError, MalformedCheckpointError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["FileRegion", "InMemory", "Storage", "TensorRef", "ZipMember"]

# Reads larger than this are split; it keeps single allocations modest when a
# caller streams a huge tensor.
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024


# Every byte source has one interface: ``opened()`` yields a ``read_into(start, out)``
# that fills a buffer from ``start`` (in the source's own numbering), keeping
# whatever must stay open (a file, a decompressor) open for many reads; and
# ``paths()`` names the files it reads, so a writer never overwrites them.
ReadInto = Callable[[int, memoryview], None]


@dataclass(frozen=True)
class FileRegion:
    """Bytes stored uncompressed at ``offset`` in the file at ``path``.

    ``crc32`` is the CRC-32 the source format recorded for the whole storage
    (zip records have one), which lets a verbatim copy skip recomputing it.
    """

    path: str
    offset: int
    crc32: int | None = None

    @contextlib.contextmanager
    def opened(self) -> Iterator[ReadInto]:
        from .read_policy import open_file

        with open_file(self.path) as file:
            fd = file.fileno()

            def read_into(start: int, out: memoryview) -> None:
                read_exactly_into(fd, self.offset + start, out, self.path)

            yield read_into

    def paths(self) -> frozenset[str]:
        return frozenset({self.path})


# What zipfile raises on a damaged compressed member: a corrupt deflate stream
# (zlib.error), a stream that ends early (EOFError), a wrong CRC-32 (BadZipFile).
_DECOMPRESS_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, KeyError, ValueError, RuntimeError)


@dataclass(frozen=True)
class ZipMember:
    """A compressed zip member: read by decompressing from its start."""

    path: str
    name: str

    @contextlib.contextmanager
    def opened(self) -> Iterator[ReadInto]:
        """Reads over one open member: chunk after chunk decompresses the member once
        (reopening it per chunk made a large record cost quadratic time)."""
        from .read_policy import open_file

        file = open_file(self.path)
        try:
            archive = zipfile.ZipFile(file)
            member = archive.open(self.name)
        except _DECOMPRESS_ERRORS as error:
            file.close()
            raise self._damaged(error) from None
        except BaseException:
            file.close()
            raise

        def read_into(start: int, out: memoryview) -> None:
            try:
                if member.tell() != start:
                    member.seek(start)
                data = member.read(out.nbytes)
            except _DECOMPRESS_ERRORS as error:
                raise self._damaged(error) from None
            if len(data) != out.nbytes:
                raise MalformedCheckpointError(
                    f"{self.path!r} is truncated: record {self.name!r} ends early; the file is damaged",
                    path=self.path,
                )
            out.cast("B")[:] = data

        with file, archive, member:
            yield read_into

    def paths(self) -> frozenset[str]:
        return frozenset({self.path})

    def _damaged(self, error: BaseException) -> MalformedCheckpointError:
        return MalformedCheckpointError(
            f"{self.path!r} is a damaged zip checkpoint: record {self.name!r} cannot be decompressed ({error})",
            path=self.path,
        )


@dataclass(frozen=True, eq=False)
class InMemory:
    """Bytes already in memory (numpy arrays inside a pickle, tensors handed to ``save``)."""

    data: bytes | bytearray | memoryview

    @contextlib.contextmanager
    def opened(self) -> Iterator[ReadInto]:
        def read_into(start: int, out: memoryview) -> None:
            out.cast("B")[:] = memoryview(self.data).cast("B")[start : start + out.nbytes]

        yield read_into

    def paths(self) -> frozenset[str]:
        return frozenset()


@dataclass(frozen=True, eq=False)
class Assembled:
    """A tensor stored as several chunks (a DCP checkpoint's shards), read as one contiguous tensor.

    Chunks that split the tensor along its first dimension (FSDP's layout) are
    read in place, piece by piece; chunks of any other shape are pasted into
    one buffer the first time the tensor is read (bounded by the tensor's size).

    Attributes:
        chunks: ``(offsets, chunk)`` pairs: where each chunk starts in the full
            tensor, and the chunk itself.
        shape: the full tensor's shape.
        itemsize: bytes per element.
    """

    chunks: tuple[tuple[tuple[int, ...], TensorRef], ...]
    shape: tuple[int, ...]
    itemsize: int

    @functools.cached_property
    def _rows(self) -> list[tuple[int, int, TensorRef]] | None:
        """``(first byte, last byte, chunk)`` when every chunk is a contiguous block of whole rows."""
        if not self.shape:
            return None
        row = math.prod(self.shape[1:]) * self.itemsize
        rows = []
        for offsets, chunk in self.chunks:
            if any(offsets[1:]) or tuple(chunk.shape[1:]) != tuple(self.shape[1:]) or not chunk.is_contiguous:
                return None
            rows.append((offsets[0] * row, (offsets[0] + chunk.shape[0]) * row, chunk))
        rows.sort(key=lambda item: item[0])
        expected = 0
        for first, last, _ in rows:
            if first != expected:
                return None
            expected = last
        return rows if expected == math.prod(self.shape) * self.itemsize else None

    @contextlib.contextmanager
    def opened(self) -> Iterator[ReadInto]:
        def read_into(start: int, out: memoryview) -> None:
            out = out.cast("B")
            rows = self._rows
            if rows is None:
                out[:] = _assembled_bytes(self)[start : start + len(out)]
                return
            end = start + len(out)
            for first, last, chunk in rows:
                if last <= start or first >= end:
                    continue
                piece_start, piece_end = max(first, start), min(last, end)
                chunk_start = chunk.byte_span[0] + piece_start - first
                chunk.storage.read_into(chunk_start, out[piece_start - start : piece_end - start])

        yield read_into

    def paths(self) -> frozenset[str]:
        return frozenset().union(*(chunk.storage.source.paths() for _, chunk in self.chunks))


_assembled_cache: dict[int, tuple[Assembled, bytes]] = {}


def _assembled_bytes(source: Assembled) -> bytes:
    """The whole tensor, pasted together from its chunks; the last one is kept for the next read."""
    import numpy as np

    cached = _assembled_cache.get(0)
    if cached is not None and cached[0] is source:
        return cached[1]
    _assembled_cache.clear()
    full = np.zeros(math.prod(source.shape) * source.itemsize, dtype=np.uint8)
    view = full.view(f"V{source.itemsize}").reshape(source.shape) if source.itemsize else full
    for offsets, chunk in source.chunks:
        block = chunk.numpy().view(f"V{source.itemsize}").reshape(chunk.shape)
        view[tuple(slice(o, o + n) for o, n in zip(offsets, chunk.shape))] = block
    data = full.tobytes()
    _assembled_cache[0] = (source, data)
    return data


ByteSource = Union[FileRegion, ZipMember, InMemory, Assembled]


def _bytes_view(array: np.ndarray) -> memoryview:
    """A contiguous array's bytes, without a copy."""
    return array.data.cast("B")


def read_exactly_into(fd: int, offset: int, out: memoryview, path: str) -> None:
    """Fill ``out`` from ``fd`` at ``offset`` without an intermediate copy; a short read means a truncated file."""
    out = out.cast("B")
    filled = 0
    while filled < len(out):
        count = os.preadv(fd, [out[filled : filled + (1 << 30)]], offset + filled)
        if count <= 0:
            raise MalformedCheckpointError(
                f"{path!r} is truncated: {len(out) - filled} bytes missing at offset {offset + filled}; "
                "the file is damaged or still being written",
                path=path,
            )
        filled += count


@dataclass(frozen=True, eq=False)
class Storage:
    """One storage record: ``nbytes`` bytes shared by every tensor that views them.

    Storages compare by identity: two tensors share memory exactly when they
    hold the same ``Storage`` object.

    Attributes:
        nbytes: size of the record in bytes.
        source: where the bytes are.
        location: the device the storage was saved from (``"cuda:1"``); only
            reported, since ckptconv always loads on the CPU.
        byteorder: ``"little"`` or ``"big"``; big-endian files are swapped on read.
        name: the record's name in the source, for messages.
    """

    nbytes: int
    source: ByteSource
    location: str = "cpu"
    byteorder: str = "little"
    name: str = ""

    def __repr__(self) -> str:
        return f"<Storage {self.name or '?'} {self.nbytes} bytes from {self.location}>"

    def _check(self, start: int, length: int) -> None:
        if start < 0 or length < 0 or start + length > self.nbytes:
            raise ValueError(f"byte range {start}+{length} outside storage of {self.nbytes} bytes")

    @contextlib.contextmanager
    def reader(self) -> Iterator[ReadInto]:
        """A ``read_into(start, out)`` that keeps the source open for many reads."""
        with self.source.opened() as read_into:

            def checked(start: int, out: memoryview) -> None:
                self._check(start, out.nbytes)
                if out.nbytes:
                    read_into(start, out)

            yield checked

    def read_into(self, start: int, out: memoryview) -> None:
        """Fill ``out`` with the record's bytes from ``start`` (no intermediate copy for files)."""
        with self.reader() as read_into:
            read_into(start, out)

    def read(self, start: int = 0, length: int | None = None) -> bytearray:
        """Raw bytes ``[start, start + length)`` of the record, as stored."""
        if length is None:
            length = self.nbytes - start
        self._check(start, length)
        out = bytearray(length)
        self.read_into(start, memoryview(out))
        return out


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides (in elements) for ``shape``."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class TensorRef:
    """A tensor that has not been read: a view into a :class:`Storage`.

    Attributes:
        storage: the bytes this tensor views.
        dtype: the element type of the stored bytes.
        shape: sizes, as in ``torch.Tensor.shape``.
        stride: strides in elements, as in ``torch.Tensor.stride()``.
        offset: storage offset in elements of ``dtype``.
        cast_to: the dtype this tensor will have when written, if a cast is
            pending; see :meth:`cast`.
        origin: ``"torch"`` for tensors, ``"numpy"`` for numpy arrays found in a pickle.
        allow_overflow: under a cast, let finite values beyond the target's
            range become inf instead of raising :class:`CastOverflowError`.
    """

    storage: Storage
    dtype: DType
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int = 0
    cast_to: DType | None = None
    origin: str = "torch"
    allow_overflow: bool = False

    @classmethod
    def checked(
        cls,
        storage: Storage,
        dtype: DType,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
        offset: int = 0,
        *,
        origin: str = "torch",
    ) -> TensorRef:
        """A TensorRef after the bounds checks ``torch.Tensor.set_`` does.

        Raises:
            MalformedCheckpointError: the view reaches outside its storage or
                its sizes are not non-negative integers.
        """
        ints_ok = all(type(v) is int and v >= 0 for v in (*shape, *stride, offset))
        if not ints_ok or len(shape) != len(stride) or len(shape) > 64:
            raise MalformedCheckpointError(
                f"tensor view (size {shape}, stride {stride}, offset {offset}) is invalid; the checkpoint is damaged"
            )
        ref = cls(storage, dtype, tuple(shape), tuple(stride), offset, origin=origin)
        start, end = ref.byte_span
        if end > storage.nbytes:
            raise MalformedCheckpointError(
                f"tensor of size {list(shape)} and stride {list(stride)} at offset {offset} "
                f"needs {end} bytes but its storage {storage.name or ''!s} holds only "
                f"{storage.nbytes}; the checkpoint is damaged"
            )
        return ref

    def __repr__(self) -> str:
        cast = f" -> {self.cast_to.name}" if self.cast_to else ""
        return f"<TensorRef {self.dtype.name}{list(self.shape)}{cast} in {self.storage!r}>"

    # -- shape facts -----------------------------------------------------------------

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def out_dtype(self) -> DType:
        """The dtype this tensor has once written (after any pending cast)."""
        return self.cast_to or self.dtype

    @property
    def nbytes(self) -> int:
        """Bytes this tensor occupies once written contiguously in ``out_dtype``."""
        return self.numel * self.out_dtype.itemsize

    @functools.cached_property
    def is_contiguous(self) -> bool:
        """True when the elements are laid out row-major with no gaps."""
        expected = 1
        for size, step in zip(reversed(self.shape), reversed(self.stride)):
            if size == 1:
                continue
            if step != expected:
                return False
            expected *= size
        return True

    @functools.cached_property
    def byte_span(self) -> tuple[int, int]:
        """``(start, end)`` bytes of the storage this tensor touches (``start == end`` if empty)."""
        itemsize = self.dtype.itemsize
        start = self.offset * itemsize
        if self.numel == 0:
            return start, start
        last = sum((size - 1) * step for size, step in zip(self.shape, self.stride))
        return start, start + (last + 1) * itemsize

    @property
    def is_whole_storage(self) -> bool:
        """True when this tensor is contiguous and covers its storage exactly."""
        return self.is_contiguous and self.byte_span == (0, self.storage.nbytes)

    @property
    def verbatim_region(self) -> tuple[FileRegion, int, int] | None:
        """``(region, start, length)`` when the bytes this tensor writes are a run of its file as stored.

        That is, a file-backed, contiguous, little-endian tensor with no cast:
        writers move those bytes in the kernel instead of through Python.
        """
        source = self.storage.source
        if (
            isinstance(source, FileRegion)
            and self.cast_to is None
            and self.is_contiguous
            and self.storage.byteorder == "little"
        ):
            start, stop = self.byte_span
            return source, start, stop - start
        return None

    def cast(self, dtype: DType, *, allow_overflow: bool = False) -> TensorRef:
        """This tensor, to be converted to ``dtype`` when its bytes are read."""
        if dtype == self.dtype:
            return dataclasses.replace(self, cast_to=None, allow_overflow=False)
        return dataclasses.replace(self, cast_to=dtype, allow_overflow=allow_overflow)

    def _cast(self, values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        from ._cast import cast_array, count_overflows

        assert self.cast_to is not None
        result = cast_array(values, self.dtype.name, self.cast_to.name, out=out)
        if not self.allow_overflow:
            overflows = count_overflows(values, self.dtype.name, self.cast_to.name)
            if overflows:
                example = self._first_overflow(values)
                raise CastOverflowError(
                    f"casting to {self.cast_to.name} would turn finite values such as {example} into inf; "
                    "keep this tensor's dtype (--keep-dtype) or pass --allow-overflow",
                    count=overflows,
                )
        return result

    def _first_overflow(self, values: np.ndarray) -> str:
        """A finite source value that overflows the cast target, for the error message."""
        import numpy as np

        from ._cast import cast_array

        assert self.cast_to is not None
        wide = cast_array(values, self.dtype.name, "float64")
        narrow = cast_array(cast_array(values, self.dtype.name, self.cast_to.name), self.cast_to.name, "float64")
        offending = np.flatnonzero(np.isfinite(wide) & np.isinf(narrow))
        return repr(float(wide[offending[0]])) if len(offending) else "?"

    # -- reading ---------------------------------------------------------------------

    def numpy(self) -> np.ndarray:
        """The tensor's elements, contiguous, in ``out_dtype``'s storage representation.

        bfloat16 and float8 come back as unsigned integers of the same width,
        since numpy has no such types; ``.tobytes()`` gives what a writer stores.
        """
        import numpy as np

        stored = np.dtype(self.dtype.numpy)
        if self.storage.byteorder == "big":
            stored = stored.newbyteorder(">")
        start, end = self.byte_span
        raw = self.storage.read(start, end - start)
        if self.is_contiguous:
            array = np.frombuffer(raw, dtype=stored, count=self.numel).reshape(self.shape)
        else:
            base = np.frombuffer(raw, dtype=stored)
            array = np.lib.stride_tricks.as_strided(
                base,
                shape=self.shape,
                strides=tuple(s * stored.itemsize for s in self.stride),
                writeable=False,
            )
        # Writers store little-endian whatever the machine or the source.
        array = np.ascontiguousarray(array, dtype=stored.newbyteorder("<"))
        if self.cast_to is not None:
            array = self._cast(array.reshape(-1)).reshape(self.shape)
        return array

    def tobytes(self) -> bytes:
        """The tensor's bytes as a writer stores them: contiguous, little-endian, ``out_dtype``."""
        return self.numpy().tobytes()

    def iter_bytes(self, chunk_bytes: int | None = None) -> Iterator[memoryview]:
        """The bytes of :meth:`tobytes` in pieces of about ``chunk_bytes``.

        Contiguous little-endian tensors are streamed through a few reused
        buffers, so memory stays at a few chunks whatever the tensor's size and
        no page is allocated per chunk. Under a cast, chunks are read and cast
        by two worker threads (file reads and numpy release the GIL) while the
        caller writes the previous one. Others are gathered first, bounded by
        the tensor's own size.

        Each chunk is a view that is only valid until the next one is asked
        for: consume it (write, hash) before advancing.
        """
        chunk_bytes = chunk_bytes or DEFAULT_CHUNK_BYTES
        if not (self.is_contiguous and self.storage.byteorder == "little"):
            data = _bytes_view(self.numpy())
            for offset in range(0, len(data), chunk_bytes):
                yield data[offset : offset + chunk_bytes]
            return
        import numpy as np

        itemsize = self.dtype.itemsize
        start, end = self.byte_span
        if start == end:
            return
        chunk = min(max(chunk_bytes // itemsize, 1) * itemsize, end - start)
        if self.cast_to is None:
            read_buffer = np.empty(chunk, dtype=np.uint8)
            with self.storage.reader() as read_into:
                for position in range(start, end, chunk):
                    piece = read_buffer[: min(chunk, end - position)]
                    read_into(position, piece.data)
                    yield piece.data
            return
        if end - start <= chunk or isinstance(self.storage.source, ZipMember):
            # Small tensors: no threads to start. Compressed records: one stream
            # read in order (two threads reading out of order would rewind it).
            with self.storage.reader() as read_into:
                for position in range(start, end, chunk):
                    raw = np.empty(min(chunk, end - position), dtype=np.uint8)
                    read_into(position, raw.data)
                    yield _bytes_view(self._cast(raw.view(np.dtype(self.dtype.numpy))))
            return
        yield from self._iter_cast_chunks(start, end, max(chunk // 2 // itemsize, 1) * itemsize)

    def _iter_cast_chunks(self, start: int, end: int, chunk: int) -> Iterator[memoryview]:
        """Cast chunk by chunk, two chunks in flight on worker threads, results in order."""
        import numpy as np

        from ._cast import storage_dtype

        assert self.cast_to is not None
        source_dtype = np.dtype(self.dtype.numpy)
        target_dtype = storage_dtype(self.cast_to.name)
        itemsize = self.dtype.itemsize
        in_flight = 2
        # One spare buffer pair beyond those in flight: the one the caller is consuming.
        free = [
            (np.empty(chunk, dtype=np.uint8), np.empty(chunk // itemsize, dtype=target_dtype))
            for _ in range(in_flight + 1)
        ]
        positions = iter(range(start, end, chunk))
        with self.storage.reader() as read_into, concurrent.futures.ThreadPoolExecutor(max_workers=in_flight) as pool:

            def work(
                position: int, buffers: tuple[np.ndarray, np.ndarray]
            ) -> tuple[memoryview, tuple[np.ndarray, np.ndarray]]:
                raw, out = buffers
                length = min(chunk, end - position)
                read_into(position, raw[:length].data)
                values = raw[:length].view(source_dtype)
                return _bytes_view(self._cast(values, out=out[: len(values)])), buffers

            pending: collections.deque[concurrent.futures.Future[tuple[memoryview, tuple[np.ndarray, np.ndarray]]]]
            pending = collections.deque()
            for position in itertools.islice(positions, in_flight):
                pending.append(pool.submit(work, position, free.pop()))
            while pending:
                view, buffers = pending.popleft().result()
                position_next = next(positions, None)
                if position_next is not None:
                    pending.append(pool.submit(work, position_next, free.pop()))
                yield view
                free.append(buffers)
