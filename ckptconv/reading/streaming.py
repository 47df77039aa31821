"""Reading a lazy tensor's bytes: whole, or streamed in chunks through reused buffers.

:class:`~ckptconv.values.tensor.TensorRef` says where a tensor's bytes are; this module
reads them. :func:`read_array` gives the tensor as one contiguous numpy array;
:func:`iter_bytes` streams what a writer stores in bounded pieces, casting on
worker threads when a cast is pending (straight from a memory map of the
source, into reused buffers). ``TensorRef.numpy()``, ``.tobytes()`` and
``.iter_bytes()`` call these.

This module does not import torch.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import contextvars
import itertools
import threading
from collections.abc import Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING

from ckptconv.errors import CastOverflowError
from ckptconv.runtime import cores as _cores
from ckptconv.values.tensor import Storage

if TYPE_CHECKING:
    from ckptconv.transforms.casts import Array
    from ckptconv.values.tensor import TensorRef

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "iter_bytes",
    "iter_bytes_with_crcs",
    "keeping_workers",
    "read_array",
    "reads_whole_record",
]

# Reads larger than this are split; it keeps single allocations modest when a
# caller streams a huge tensor.
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024


def _bytes_view(array: Array) -> memoryview:
    """A contiguous array's bytes, without a copy."""
    if array.size == 0:
        return memoryview(b"")  # memoryview cannot cast a view with a zero in its shape
    return array.data.cast("B")


def apply_bits(ref: TensorRef, array: Array) -> Array:
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


def _cast(ref: TensorRef, values: Array, out: Array | None = None) -> Array:
    from ckptconv.transforms.casts import cast_array, cast_counting_overflows

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


def _first_overflow(ref: TensorRef, values: Array) -> str:
    """A finite source value that overflows the cast target, for the error message."""
    import numpy as np

    from ckptconv.transforms.casts import cast_array

    assert ref.cast_to is not None
    wide = cast_array(values, ref.dtype.name, "float64")
    narrow = cast_array(cast_array(values, ref.dtype.name, ref.cast_to.name), ref.cast_to.name, "float64")
    offending = np.flatnonzero(np.isfinite(wide) & np.isinf(narrow))
    return repr(float(wide[offending[0]])) if len(offending) else "?"


def read_array(ref: TensorRef) -> Array:
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
    # Writers store little-endian whatever the machine or the source. (asarray: ascontiguousarray
    # gives a 0-dim tensor one dimension.)
    array = apply_bits(ref, np.asarray(array, dtype=stored.newbyteorder("<"), order="C"))
    if ref.cast_to is not None:
        array = _cast(ref, array.reshape(-1)).reshape(ref.shape)
    return array


def iter_bytes(
    ref: TensorRef, chunk_bytes: int | None = None, *, record_crcs: MutableMapping[Storage, int] | None = None
) -> Iterator[memoryview]:
    """The bytes of ``ref.tobytes()`` in pieces of about ``chunk_bytes``.

    Contiguous little-endian tensors are streamed through a few reused
    buffers, so memory stays at a few chunks whatever the tensor's size and
    no page is allocated per chunk. Under a cast, pieces are read and cast
    by two worker threads (file reads and numpy release the GIL) while the
    caller writes the previous one; see :func:`_iter_cast_pieces`. Others are
    gathered first, bounded by the tensor's own size.

    ``record_crcs``, if given, receives the CRC-32 of the source record under
    ``ref.storage`` when a cast reads that whole record from an uncompressed
    file region that records one (:func:`reads_whole_record`), taken from the
    very bytes that were cast. A converter compares it with the archive's
    (:func:`ckptconv.reading.integrity.check_record_crcs`, ``computed=``) instead of
    reading the record a second time.

    Each chunk is a view that is only valid until the next one is asked
    for: consume it (write, hash) before advancing.
    """
    for view, _ in _chunks(ref, chunk_bytes, record_crcs, chunk_crcs=False):
        yield view


def iter_bytes_with_crcs(
    ref: TensorRef, chunk_bytes: int | None = None, *, record_crcs: MutableMapping[Storage, int] | None = None
) -> Iterator[tuple[memoryview, int | None]]:
    """:func:`iter_bytes`, each chunk with its CRC-32 where the cast threads took it, else None.

    A cast thread checksums the piece it has just cast while it is still in
    its cache, instead of a writer reading it once more on another thread
    (the ``.pt`` writer needs each record's CRC-32).
    """
    return _chunks(ref, chunk_bytes, record_crcs, chunk_crcs=True)


def _chunks(
    ref: TensorRef, chunk_bytes: int | None, record_crcs: MutableMapping[Storage, int] | None, *, chunk_crcs: bool
) -> Iterator[tuple[memoryview, int | None]]:
    chunk_bytes = chunk_bytes or DEFAULT_CHUNK_BYTES
    if not (ref.is_contiguous and ref.storage.byteorder == "little" and not (ref.conj or ref.neg)):
        for view in _iter_gathered(ref, chunk_bytes):
            yield view, None
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
                yield piece.data, None
        return
    if ref.storage.source.in_order:
        # Compressed records: one stream read in order (two threads reading
        # out of order would rewind it).
        with ref.storage.reader() as read_into:
            for position in range(start, end, chunk):
                raw = np.empty(min(chunk, end - position), dtype=np.uint8)
                read_into(position, raw.data)
                yield _bytes_view(_cast(ref, raw.view(np.dtype(ref.dtype.numpy)))), None
        return
    if end - start <= min(chunk, SMALL_CAST_BYTES):
        piece_bytes = end - start  # one piece, cast on this thread
    else:
        piece_bytes = max(min(chunk // 2, CAST_PIECE_BYTES) // itemsize, 1) * itemsize
    yield from _iter_cast_pieces(
        ref, start, end, piece_bytes, record_crcs if reads_whole_record(ref) else None, chunk_crcs=chunk_crcs
    )


def reads_whole_record(ref: TensorRef) -> bool:
    """True when writing ``ref`` reads its whole source record in order, taking the record's CRC-32 for ``record_crcs``.

    That is: a tensor that spans its whole record, stored uncompressed in a
    file that records the record's CRC-32 (a zip checkpoint), and either
    copied as stored (the writers' copy) or cast from contiguous
    little-endian values (:func:`iter_bytes`).
    """
    source = ref.storage.source
    if not (
        source.stored_region() is not None
        and source.crc32 is not None
        and ref.is_whole_storage
        and ref.storage.nbytes > 0
    ):
        return False
    if ref.cast_to is None:
        return ref.verbatim_region is not None
    return ref.storage.byteorder == "little" and not (ref.conj or ref.neg)


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


def _blocks(view: Array, limit: int) -> Iterator[Array]:
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


#: Source bytes per piece of a cast (at most half a chunk). Two pieces in flight, their
#: outputs and the one being written stay in the CPU's last-level cache: measured on the
#: 2-core VM (32 MiB L3), a 1 GiB float32 -> float16 cast took 1.41 s of CPU with 8 MiB
#: pieces, 1.00 s with 4 MiB and 1.12 s with 2 MiB (where handing pieces over costs more).
CAST_PIECE_BYTES = 4 << 20
#: A cast of up to this many source bytes runs as one piece on the caller's thread: split in two,
#: a tensor of a few bytes started a pool of two threads (30,000 tiny tensors to bf16: 26 s, of
#: which 8.6 s of CPU, the rest waiting for threads).
SMALL_CAST_BYTES = 1 << 20

# Buffers the cast path reuses from piece to piece and tensor to tensor, so
# that no piece faults in (and the kernel zeroes) fresh pages: the cast of a
# 1 GiB checkpoint spent 0.1 s of CPU on that. Worker threads share the list
# under a lock (picking the best fit looks at it whole).
_SPARE: list[Array] = []
_SPARE_LOCK = threading.Lock()
#: At most this many bytes of spare buffers are kept between pieces (and after a write).
_SPARE_BYTES = 32 << 20


def _take(nbytes: int) -> Array:
    """A uint8 buffer of at least ``nbytes``: the smallest spare one that fits, or a new one.

    Spares too small stay for a smaller request (a worker's read buffer and the pieces'
    outputs differ in size): dropped, each would be allocated, and its pages faulted in,
    again for the next piece (about 8,000 page faults of a 4 GiB fp16 cast, 7-10 MiB of RSS;
    bench/results/bench_fp16_cpu_2core_vm.md).
    """
    import numpy as np

    from ckptconv.transforms.casts import aligned_empty

    with _SPARE_LOCK:
        fitting = [index for index, spare in enumerate(_SPARE) if spare.nbytes >= nbytes]
        if fitting:
            return _SPARE.pop(min(fitting, key=lambda index: _SPARE[index].nbytes))
    return aligned_empty(nbytes, np.uint8)  # the casts' vector loads then stay within cache lines


def _give_back(buffer: Array) -> None:
    with _SPARE_LOCK:
        if buffer.nbytes + sum(spare.nbytes for spare in _SPARE) <= _SPARE_BYTES:
            _SPARE.append(buffer)


# The pool :func:`keeping_workers` keeps for the casts of its block (empty until the first one
# needs it), or None outside one.
_KEPT_WORKERS: contextvars.ContextVar[list[concurrent.futures.ThreadPoolExecutor] | None] = contextvars.ContextVar(
    "ckptconv_kept_workers", default=None
)
#: The most threads that cast pieces. Through ml_dtypes' casts (one call per block), a 4 GiB
#: float16 cast on a 16-core host took 2.53 s with 2 threads, 1.91 s with 3 or 4 and 1.68 s with 6
#: (bfloat16: 1.74, 1.47, 1.51 and 1.57 s); past that the one thread that writes sets the pace.
#: The numpy passes scale as far there, casting alone: 6 threads 11.2 GB/s against 3.2 for one, as
#: 6 processes (11.0), so the GIL between their dozen calls a block is not what limits them
#: (``bench/bench_cast_limit.py --workers 6``; on 2 cores, threads reached 1.5x one and processes 2x).
MAX_CAST_WORKERS = 6


def cast_workers() -> int:
    """Threads that cast pieces: a core each, one left for the thread that writes, and at least
    two (one per core of the 2-core VM, where one and three were slower)."""
    return min(max(_cores.usable() - 1, 2), MAX_CAST_WORKERS)


@contextlib.contextmanager
def keeping_workers() -> Iterator[None]:
    """Inside this block, the casts of every tensor share one pool of worker threads.

    Threads started for each tensor, and stopped at its end, cost about 0.5 ms of wall time a
    tensor on the 2-core VM: 64 tensors of 4 MiB cast to float16 in 0.13 s with a pool per
    tensor, 0.09 s with one pool (``bench/bench_cast_workers.py``). The pool ends with the
    block, so that no thread outlives a conversion, and each conversion (several run at once
    under ``batch``) has its own. Nested blocks share the outer one's pool; threads other than
    the caller's start their own per tensor (a context variable does not follow them).
    """
    if _KEPT_WORKERS.get() is not None:
        yield
        return
    pools: list[concurrent.futures.ThreadPoolExecutor] = []
    token = _KEPT_WORKERS.set(pools)
    try:
        yield
    finally:
        _KEPT_WORKERS.reset(token)
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def _cast_pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    """The pool :func:`keeping_workers` keeps, or one of this tensor's own."""
    kept = _KEPT_WORKERS.get()
    if kept is None:
        with concurrent.futures.ThreadPoolExecutor(cast_workers(), thread_name_prefix="ckptconv-cast") as pool:
            yield pool
        return
    if not kept:
        kept.append(concurrent.futures.ThreadPoolExecutor(cast_workers(), thread_name_prefix="ckptconv-cast"))
    yield kept[0]


@contextlib.contextmanager
def _piece_reader(ref: TensorRef) -> Iterator[Callable[[int, int], tuple[memoryview, Array]]]:
    """``read(position, length)`` giving a piece of the storage's bytes and the pooled buffer
    holding them (to give back). Safe to call from several threads.

    Pieces are read, never memory-mapped: a file cut short while it is mapped kills the process
    with SIGBUS, where a read gets the one-line truncation error. Reading cost 0.00-0.02 s per
    GiB cast against maps (1 GiB to bf16 and fp16, medians of 7 on the development VM).
    """
    with ref.storage.reader() as read_into:

        def read(position: int, length: int) -> tuple[memoryview, Array]:
            buffer = _take(length)
            view = buffer[:length].data
            read_into(position, view)
            return view, buffer

        yield read


def _iter_cast_pieces(
    ref: TensorRef,
    start: int,
    end: int,
    piece: int,
    record_crcs: MutableMapping[Storage, int] | None,
    *,
    chunk_crcs: bool,
) -> Iterator[tuple[memoryview, int | None]]:
    """Cast piece by piece on two worker threads, results in order, each with its
    output's CRC-32 if ``chunk_crcs`` (else None).

    Pieces are read into reused buffers and cast into reused output buffers.
    With ``record_crcs``, each piece's CRC-32 is taken from the bytes read as
    they were cast, and the pieces' CRCs are joined
    (:func:`~ckptconv.reading.integrity.crc32_combine`) into the record's.
    """
    import numpy as np

    from ckptconv.reading.checksums import crc32, crc32_combine
    from ckptconv.transforms.casts import storage_dtype

    assert ref.cast_to is not None
    source_dtype = np.dtype(ref.dtype.numpy)
    target_dtype = storage_dtype(ref.cast_to.name)
    positions = range(start, end, piece)
    crc = 0

    with _piece_reader(ref) as read:

        def work(position: int) -> tuple[memoryview, Array, int | None, int | None]:
            length = min(piece, end - position)
            raw, raw_buffer = read(position, length)
            values = np.frombuffer(raw, dtype=source_dtype)
            out = _take(values.size * target_dtype.itemsize)
            result = _cast(ref, values, out=out[: values.size * target_dtype.itemsize].view(target_dtype))
            piece_crc = crc32(raw) if record_crcs is not None else None
            del values, raw
            _give_back(raw_buffer)
            view = _bytes_view(result)
            return view, out, piece_crc, crc32(view) if chunk_crcs else None

        if len(positions) == 1:  # no thread to start for a small tensor
            view, out, piece_crc, view_crc = work(start)
            yield view, view_crc
            _give_back(out)
            if record_crcs is not None and piece_crc is not None:
                record_crcs[ref.storage] = piece_crc
            return
        # One piece more than there are workers, so that each has work while the caller writes
        # (5 and 8 in flight were no faster on the 2-core VM).
        in_flight = cast_workers() + 1
        pending: collections.deque[concurrent.futures.Future[tuple[memoryview, Array, int | None, int | None]]]
        pending = collections.deque()
        upcoming = iter(positions)
        with _cast_pool() as pool:
            try:
                for position in itertools.islice(upcoming, in_flight):
                    pending.append(pool.submit(work, position))
                for position in positions:
                    view, out, piece_crc, view_crc = pending.popleft().result()
                    following = next(upcoming, None)
                    if following is not None:
                        pending.append(pool.submit(work, following))
                    if piece_crc is not None:
                        crc = crc32_combine(crc, piece_crc, min(piece, end - position))
                    yield view, view_crc
                    _give_back(out)
            finally:
                for future in pending:
                    future.cancel()
                # A kept pool outlives this tensor: its pieces still running read through this
                # tensor's reader into its buffers, so they end here, as in a pool of its own.
                concurrent.futures.wait(pending)
    if record_crcs is not None:
        record_crcs[ref.storage] = crc
