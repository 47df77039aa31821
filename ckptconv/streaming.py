"""Reading a lazy tensor's bytes: whole, or streamed in chunks through reused buffers.

:class:`~ckptconv.tensor.TensorRef` says where a tensor's bytes are; this module
reads them. :func:`read_array` gives the tensor as one contiguous numpy array;
:func:`iter_bytes` streams what a writer stores in bounded pieces, casting on
worker threads when a cast is pending. ``TensorRef.numpy()``, ``.tobytes()``
and ``.iter_bytes()`` call these.

This module does not import torch.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .errors import CastOverflowError
from .tensor import ZipMember

if TYPE_CHECKING:
    import numpy as np

    from .tensor import TensorRef

__all__ = ["DEFAULT_CHUNK_BYTES", "iter_bytes", "read_array"]

# Reads larger than this are split; it keeps single allocations modest when a
# caller streams a huge tensor.
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024


def _bytes_view(array: np.ndarray) -> memoryview:
    """A contiguous array's bytes, without a copy."""
    if array.size == 0:
        return memoryview(b"")  # memoryview cannot cast a view with a zero in its shape
    return array.data.cast("B")


def apply_bits(ref: TensorRef, array: np.ndarray) -> np.ndarray:
    """``array`` (contiguous, little-endian, ``ref.dtype``'s storage form) with ``ref``'s conj and neg bits applied.

    Floats negate by flipping the sign bit (what torch's ``neg`` does, NaNs
    included), complex numbers conjugate by flipping the imaginary part's, and
    integers negate in two's complement, wrapping as torch does.
    """
    if not (ref.conj or ref.neg):
        return array
    import numpy as np

    out = np.array(array, copy=True).reshape(-1)
    kind = ref.dtype.kind
    if kind in ("float", "complex"):
        half = ref.dtype.itemsize // (2 if kind == "complex" else 1)
        words = out.view(np.dtype(f"<u{half}"))
        sign = words.dtype.type(1 << (8 * half - 1))
        if ref.neg:
            words ^= sign
        if ref.conj:
            words[1::2] ^= sign
    else:  # the integers torch can negate (TensorRef.checked refuses the rest)
        np.negative(out, out=out)
    return out.reshape(array.shape)


def _cast(ref: TensorRef, values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    from ._cast import cast_array, cast_counting_overflows

    assert ref.cast_to is not None
    if ref.allow_overflow:
        return cast_array(values, ref.dtype.name, ref.cast_to.name, out=out)
    # The overflow count runs on each block while it is still in cache from the cast.
    result, overflows = cast_counting_overflows(values, ref.dtype.name, ref.cast_to.name, out=out)
    if overflows:
        example = _first_overflow(ref, values)
        raise CastOverflowError(
            f"casting to {ref.cast_to.name} would turn finite values such as {example} into inf; "
            "keep this tensor's dtype (--keep-dtype) or pass --allow-overflow",
            count=overflows,
        )
    return result


def _first_overflow(ref: TensorRef, values: np.ndarray) -> str:
    """A finite source value that overflows the cast target, for the error message."""
    import numpy as np

    from ._cast import cast_array

    assert ref.cast_to is not None
    wide = cast_array(values, ref.dtype.name, "float64")
    narrow = cast_array(cast_array(values, ref.dtype.name, ref.cast_to.name), ref.cast_to.name, "float64")
    offending = np.flatnonzero(np.isfinite(wide) & np.isinf(narrow))
    return repr(float(wide[offending[0]])) if len(offending) else "?"


def read_array(ref: TensorRef) -> np.ndarray:
    """The tensor's elements, contiguous, in ``out_dtype``'s storage representation.

    bfloat16 and float8 come back as unsigned integers of the same width,
    since numpy has no such types; ``.tobytes()`` gives what a writer stores.
    """
    import numpy as np

    stored = np.dtype(ref.dtype.numpy)
    if ref.storage.byteorder == "big":
        stored = stored.newbyteorder(">")
    start, end = ref.byte_span
    raw = ref.storage.read(start, end - start)
    if ref.is_contiguous:
        array = np.frombuffer(raw, dtype=stored, count=ref.numel).reshape(ref.shape)
    else:
        base = np.frombuffer(raw, dtype=stored)
        array = np.lib.stride_tricks.as_strided(
            base,
            shape=ref.shape,
            strides=tuple(s * stored.itemsize for s in ref.stride),
            writeable=False,
        )
    # Writers store little-endian whatever the machine or the source.
    array = apply_bits(ref, np.ascontiguousarray(array, dtype=stored.newbyteorder("<")))
    if ref.cast_to is not None:
        array = _cast(ref, array.reshape(-1)).reshape(ref.shape)
    return array


def iter_bytes(ref: TensorRef, chunk_bytes: int | None = None) -> Iterator[memoryview]:
    """The bytes of ``ref.tobytes()`` in pieces of about ``chunk_bytes``.

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
    if not (ref.is_contiguous and ref.storage.byteorder == "little" and not (ref.conj or ref.neg)):
        yield from _iter_gathered(ref, chunk_bytes)
        return
    import numpy as np

    itemsize = ref.dtype.itemsize
    start, end = ref.byte_span
    if start == end:
        return
    chunk = min(max(chunk_bytes // itemsize, 1) * itemsize, end - start)
    if ref.cast_to is None:
        read_buffer = np.empty(chunk, dtype=np.uint8)
        with ref.storage.reader() as read_into:
            for position in range(start, end, chunk):
                piece = read_buffer[: min(chunk, end - position)]
                read_into(position, piece.data)
                yield piece.data
        return
    if end - start <= chunk or isinstance(ref.storage.source, ZipMember):
        # Small tensors: no threads to start. Compressed records: one stream
        # read in order (two threads reading out of order would rewind it).
        with ref.storage.reader() as read_into:
            for position in range(start, end, chunk):
                raw = np.empty(min(chunk, end - position), dtype=np.uint8)
                read_into(position, raw.data)
                yield _bytes_view(_cast(ref, raw.view(np.dtype(ref.dtype.numpy))))
        return
    yield from _iter_cast_chunks(ref, start, end, max(chunk // 2 // itemsize, 1) * itemsize)


def _iter_gathered(ref: TensorRef, chunk_bytes: int) -> Iterator[memoryview]:
    """Strided, big-endian, conj or neg tensors: the bytes the view spans are read
    once, and the elements gathered from them in blocks of about ``chunk_bytes``.

    Memory stays at the span the view touches plus one block: a view that repeats
    a few stored bytes (stride 0) into terabytes never allocates those terabytes.
    """
    import numpy as np

    if ref.numel == 0:
        return
    stored = np.dtype(ref.dtype.numpy)
    if ref.storage.byteorder == "big":
        stored = stored.newbyteorder(">")
    start, end = ref.byte_span
    base = np.frombuffer(ref.storage.read(start, end - start), dtype=stored)
    view = np.lib.stride_tricks.as_strided(
        base, shape=ref.shape, strides=tuple(s * stored.itemsize for s in ref.stride), writeable=False
    )
    for block in _blocks(view, max(chunk_bytes // stored.itemsize, 1)):
        array = apply_bits(ref, np.ascontiguousarray(block, dtype=stored.newbyteorder("<")).reshape(-1))
        if ref.cast_to is not None:
            array = _cast(ref, array)
        yield _bytes_view(array)


def _blocks(view: np.ndarray, limit: int) -> Iterator[np.ndarray]:
    """Consecutive pieces of ``view`` in row-major order, each of at most ``limit`` elements
    (or one element row of the innermost dimension)."""
    if view.size <= limit or view.ndim == 0:
        yield view
        return
    inner = view.size // view.shape[0]
    if inner <= limit:
        step = limit // inner
        for index in range(0, view.shape[0], step):
            yield view[index : index + step]
    else:
        for index in range(view.shape[0]):
            yield from _blocks(view[index], limit)


def _iter_cast_chunks(ref: TensorRef, start: int, end: int, chunk: int) -> Iterator[memoryview]:
    """Cast chunk by chunk, two chunks in flight on worker threads, results in order."""
    import numpy as np

    from ._cast import storage_dtype

    assert ref.cast_to is not None
    source_dtype = np.dtype(ref.dtype.numpy)
    target_dtype = storage_dtype(ref.cast_to.name)
    itemsize = ref.dtype.itemsize
    in_flight = 2
    # One spare buffer pair beyond those in flight: the one the caller is consuming.
    free = [
        (np.empty(chunk, dtype=np.uint8), np.empty(chunk // itemsize, dtype=target_dtype)) for _ in range(in_flight + 1)
    ]
    positions = iter(range(start, end, chunk))
    with ref.storage.reader() as read_into, concurrent.futures.ThreadPoolExecutor(max_workers=in_flight) as pool:

        def work(
            position: int, buffers: tuple[np.ndarray, np.ndarray]
        ) -> tuple[memoryview, tuple[np.ndarray, np.ndarray]]:
            raw, out = buffers
            length = min(chunk, end - position)
            read_into(position, raw[:length].data)
            values = raw[:length].view(source_dtype)
            return _bytes_view(_cast(ref, values, out=out[: len(values)])), buffers

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
