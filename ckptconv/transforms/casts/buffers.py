"""Buffers the cast kernels work in: aligned blocks, per-thread scratch space, and each dtype's storage type."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from functools import lru_cache
from typing import Any, Callable, TypeAlias

import numpy as np

#: A numpy array of any shape and dtype (numpy before 2.3 wants both type arguments under mypy --strict).
Array: TypeAlias = "np.ndarray[Any, Any]"

#: Elements per internal block. Each kernel makes 5-15 numpy passes over a
#: block, so its temporaries (1 MiB each at 4 bytes) should stay in cache:
#: measured, 2**17 and 2**18 were fastest on one thread, 2**20 lost 25-50 % to
#: memory traffic and 2**14 as much to numpy's per-call overhead. Threads that
#: cast at once take the GIL between passes, and the shorter the passes the
#: more they wait for it: a 1 GiB float16 conversion on the 2-core VM took
#: 0.75 s with 2**18 against 0.83 s with 2**17 and 0.77 s with 2**19 (medians
#: of 11, alternating, fresh install).
BLOCK_ELEMENTS = 1 << 18

#: Byte boundary that the buffers the kernels stream through start on. numpy's own
#: allocations start 16 bytes past one, so every 64-byte (AVX-512) vector load of its
#: loops, and every other 32-byte one, straddled two cache lines: aligned, the float16
#: kernel took 280-286 us a block of 2**18 against 307-319 us (2-core VM).
ALIGNMENT = 64

_STORAGE: dict[str, np.dtype[Any]] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float8_e4m3fn": np.dtype(np.uint8),
    "float8_e5m2": np.dtype(np.uint8),
    "float8_e4m3fnuz": np.dtype(np.uint8),
    "float8_e5m2fnuz": np.dtype(np.uint8),
    "float8_e8m0fnu": np.dtype(np.uint8),
}

# The unsigned integer type of the same width, to work on bit patterns.
_UINT: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}

# Bit pattern of +inf per dtype, or of the largest finite magnitude + 1 for
# float8_e4m3fn, which has no inf (0x7F is its NaN).
_INF_BITS = {
    "float64": 0x7FF0000000000000,
    "float32": 0x7F800000,
    "float16": 0x7C00,
    "bfloat16": 0x7F80,
    "float8_e4m3fn": 0x7F,
    "float8_e5m2": 0x7C,
}

_BIG_ENDIAN = sys.byteorder == "big"

# The bits of a float32 but its sign.
_MAGNITUDE_32 = np.uint32(0x7FFFFFFF)


def aligned_empty(count: int, dtype: Any) -> Array:
    """An uninitialised array of ``count`` elements whose data starts on an :data:`ALIGNMENT` boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty(count * dtype.itemsize + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + count * dtype.itemsize].view(dtype)


def storage_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype holding ``name``'s elements here (bfloat16 -> uint16, float8 -> uint8).

    Native byte order, since the kernels are numpy ufuncs; :func:`cast_bytes`
    handles the little-endian on-disk layout.
    """
    try:
        return _STORAGE[name]
    except KeyError:
        raise ValueError(f"ckptconv cannot cast {name!r} values; known: {', '.join(_STORAGE)}") from None


class _Scratch:
    """Temporaries, one block long, reused by every block of a cast.

    Each thread has its own (:func:`_thread_scratch`), so that concurrent casts
    in several threads (numpy drops the GIL inside ufuncs) never share buffers.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        #: Set per block by the caller: every value of the block is finite and its
        #: cast stays finite (see :func:`_within`), so kernels skip their NaN
        #: patching and the float16 kernel its overflow handling.
        self.tame = False
        self._u32: Array | None = None
        self._f32: Array | None = None
        # The float32 block whose |x| bits the u32 buffer holds (:meth:`magnitude`), or None.
        self._magnitude_of: Array | None = None
        self._mid: Array | None = None
        self._mask: Array | None = None
        self._intp: Array | None = None

    def indices(self, count: int) -> Array:
        """An intp buffer of ``count`` elements, for gathers through a table (numpy's take converts
        any other index type to intp in a new array of its own)."""
        if self._intp is None or self._intp.size < count:
            self._intp = np.empty(max(count, self.size), np.intp)
        return self._intp[:count]

    def magnitude(self, block: Array) -> Array:
        """The bits of ``|x|`` for a float32 block, in the u32 buffer.

        Made once per block: the tameness test reads them (their max: one reduction
        instead of a float max and min) and the float16 kernels start from them.
        """
        value = self._u32_buffer()[: block.size]
        if self._magnitude_of is not block:
            np.bitwise_and(block.view(np.uint32), _MAGNITUDE_32, out=value)
            self._magnitude_of = block
        return value

    def take_magnitude(self, block: Array) -> Array:
        """:meth:`magnitude`, for a kernel that overwrites it."""
        value = self.magnitude(block)
        self._magnitude_of = None
        return value

    def forget(self) -> None:
        """Drop the block :meth:`magnitude` last read (a view that would keep its buffer alive)."""
        self._magnitude_of = None

    def u32(self, n: int) -> Array:
        self._magnitude_of = None  # whoever asks for the buffer may write into it
        return self._u32_buffer()[:n]

    def _u32_buffer(self) -> Array:
        if self._u32 is None:
            self._u32 = aligned_empty(self.size, np.uint32)
        return self._u32

    def f32(self, n: int) -> Array:
        if self._f32 is None:
            self._f32 = aligned_empty(self.size, np.float32)
        return self._f32[:n]

    def mid(self, n: int) -> Array:
        """The float32 intermediate of two-step casts (the steps use u32 and f32)."""
        if self._mid is None:
            self._mid = aligned_empty(self.size, np.float32)
        return self._mid[:n]

    def mask(self, n: int) -> Array:
        if self._mask is None:
            self._mask = aligned_empty(self.size, np.bool_)
        return self._mask[:n]


_THREAD_SCRATCH = threading.local()


@contextlib.contextmanager
def _thread_scratch() -> Iterator[_Scratch]:
    """A block-long :class:`_Scratch` of this thread's, kept from cast to cast.

    One made per cast was freed at its end and its pages faulted in again by the
    next: the 256 pieces of a 1 GiB float16 cast took 63,000 page faults more than
    a copy, 250 MiB of pages zeroed (``perf record -e page-faults``). A cast
    nested in another (a threshold found on first use) takes a second one. They
    live as long as their thread: the cast workers' end with each write, the
    caller's (2 MiB for float32 sources, up to 3.3 MiB) stays for its next cast.
    """
    spares: list[_Scratch] | None = getattr(_THREAD_SCRATCH, "spares", None)
    if spares is None:
        spares = _THREAD_SCRATCH.spares = []
    scratch = spares.pop() if spares else None
    if scratch is None or scratch.size < BLOCK_ELEMENTS:  # the block size can be changed (tests, probes)
        scratch = _Scratch(BLOCK_ELEMENTS)
    scratch.tame = False
    try:
        yield scratch
    finally:
        scratch.forget()
        spares.append(scratch)


# A kernel casts one block: (source block, output block, scratch) -> None.
_Kernel = Callable[[Array, Array, _Scratch], None]


def _nan_positions(values: Array, scratch: _Scratch) -> Array | None:
    """Indices of the NaNs in a float32 block, or None when there are none (the common case).

    One max-reduction pass answers "any NaN?" (max propagates NaN), so a
    NaN-free block costs no mask; a block known to be tame costs nothing.
    """
    if scratch.tame or values.size == 0 or not np.isnan(values.max()):
        return None
    mask = scratch.mask(values.size)
    np.isnan(values, out=mask)
    return np.flatnonzero(mask)


@lru_cache(maxsize=8)
def _filled(value: int, size: int) -> Array:
    """A read-only uint32 array of ``value``: numpy's ``maximum`` is SIMD only between two arrays."""
    array = aligned_empty(size, np.uint32)
    array.fill(value)
    array.flags.writeable = False
    return array
