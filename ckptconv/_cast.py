"""Floating-point casts on raw storage, bit-exact with ``torch.Tensor.to`` on CPU.

Why this module exists: ckptconv converts dtypes while streaming tensor bytes
from disk, and importing torch costs more than a second, so the casts are done
in numpy on the *storage representation* of each dtype (``float32`` as
``np.float32``, ``bfloat16`` as ``np.uint16``, float8 as ``np.uint8``; see
:func:`storage_dtype`); float32 -> bfloat16 and (finite blocks) float16 round
through ml_dtypes' casts instead where ml_dtypes is at hand (loaded, or a
release quick to import installed) and they are the faster on this machine
(:func:`_ml_dtypes_module`, :func:`_ml_faster`).
The output must be the bytes torch itself would write,
so every rule below was measured against torch 2.13 (x86-64, AVX2 kernels;
torch 2.11's AVX512 kernels behave the same), exhaustively where the input
space allows it (all 2**32 float32 patterns to float16 and bfloat16, all
2**16 patterns of each 16-bit source, all 256 of each float8) and with tie,
overflow and NaN-payload sweeps for float64.

What torch does, and so what we do:

* Finite values and infinities: round to nearest, ties to even, with IEEE
  overflow to inf and gradual underflow (subnormals kept, never flushed).
* float64 -> float16 / bfloat16 rounds **twice**: torch first converts to
  float32 (round to nearest even) and rounds that to 16 bits. So
  ``1 + 2**-11 + 2**-40`` becomes ``1.0`` in float16, not the nearer
  ``1 + 2**-10`` a single rounding would give. We do the same.
* NaN to float16 (from float32 / float64 / bfloat16 / float8) is what the F16C
  instruction gives: sign kept, quiet bit set, top 10 payload bits kept.
  (numpy's own float16 casts keep signalling NaNs signalling, and are slow
  scalar loops, so we do not use them.)
* NaN to bfloat16: from float32 and float64 it is ``0xFFFF`` (torch's
  vectorised kernel writes all ones whatever the sign and payload); from
  float16 and float8 it is ``0x7FC0`` (torch has only a scalar path there).
* float16 NaN to float32: sign kept, quiet bit set, payload shifted up
  (F16C ``vcvtph2ps``); to float64 the same, widened.
* bfloat16 to float32 is a 16-bit shift, so signalling NaNs stay signalling;
  float32 <-> float64 is the hardware conversion (quiets signalling NaNs,
  keeps the top payload bits), which numpy uses too.

Where torch is not deterministic, we follow its bulk path. Torch's CPU copy
kernel runs a vectorised loop and finishes each thread's slice of the tensor
with a scalar loop, and for two pairs the scalar loop encodes NaN differently:

* float64 -> bfloat16: vector body ``0xFFFF``, scalar tail ``0x7FC0``
  (body = whole blocks of 16 elements of each thread's slice);
* float16 -> float32: vector body as above, scalar tail ``0x7FFFFFFF`` for
  every NaN (sign and payload dropped; body = blocks of 8 elements).

So the bytes torch gives for a NaN in these two pairs depend on the tensor's
length and on ``torch.get_num_threads()``. For real tensors nearly every
element is in the body, so we always give the body's answer. Other CPU
builds of torch differ again in NaN encodings only (with
``ATEN_CPU_CAPABILITY=default``, float32 -> bfloat16 gives ``0x7FC0`` and the
float16 scalar path gives ``0x7E00`` with the sign); non-NaN values agree.

Casts run block by block (:data:`BLOCK_ELEMENTS`) so that the temporaries
stay in cache and the result does not depend on how a caller chunks its input.
A block whose values are all finite and stay finite (its max and min, two
reductions, lie inside the overflow threshold: :func:`_tame_bound`; for float16,
one reduction over ``|x|``'s bits) is *tame*:
it has no overflow to count and no NaN to patch, and float16 rounds it in 11
lighter passes instead of 15 (:func:`_f32_to_f16_tame`; checked against torch for all
finite float32 patterns below the threshold, as the bfloat16 path with it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import sys
import threading
import time
from collections.abc import Iterator
from functools import cache, lru_cache
from typing import Any, Callable, TypeAlias

import numpy as np

#: A numpy array of any shape and dtype (numpy before 2.3 wants both type arguments under mypy --strict).
Array: TypeAlias = "np.ndarray[Any, Any]"

__all__ = [
    "ALIGNMENT",
    "BLOCK_ELEMENTS",
    "CAST_PAIRS",
    "aligned_empty",
    "cast_array",
    "cast_bytes",
    "cast_counting_overflows",
    "count_overflows",
    "storage_dtype",
]

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

# What torch's bulk path writes for a NaN cast to bfloat16, per source (see
# the module docstring).
_BF16_NAN_VECTOR = 0xFFFF
_BF16_NAN_SCALAR = 0x7FC0

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


# -- to bfloat16 ------------------------------------------------------------------


#: ml_dtypes releases before this one import in milliseconds and cast faster than the numpy
#: passes, so ckptconv imports them where installed; from it on (0.7.0: 0.55 s to import with
#: numpy before 2.5, its ufunc loops registered one by one, each a linear search, and casts slower
#: than the numpy passes), only where a program has loaded ml_dtypes already.
_ML_DTYPES_IMPORTED_BELOW = (0, 7)


def _installed_ml_dtypes_version() -> tuple[int, ...] | None:
    """The installed ml_dtypes' release, from its ``.dist-info`` folder's name (without importing
    it, or importlib.metadata's 20 ms); None where not installed, or not one clear answer."""
    try:
        spec = importlib.util.find_spec("ml_dtypes")
        if spec is None or spec.origin is None:
            return None
        folder = os.path.dirname(os.path.dirname(spec.origin))
        names = [name for name in os.listdir(folder) if name.startswith("ml_dtypes-") and name.endswith(".dist-info")]
    except (ImportError, ValueError, OSError):
        return None
    if len(names) != 1:
        return None
    parts = names[0][len("ml_dtypes-") : -len(".dist-info")].split(".")
    numbers = tuple(int(part) for part in itertools.takewhile(str.isdigit, parts))
    return numbers or None


def _ml_dtypes_module() -> Any:
    """The ml_dtypes module where a program has loaded it, or a release fast to import is
    installed (:data:`_ML_DTYPES_IMPORTED_BELOW`); else None."""
    if "ml_dtypes" not in sys.modules:
        version = _installed_ml_dtypes_version()
        if version is None or version >= _ML_DTYPES_IMPORTED_BELOW:
            return None
    # An import statement even where sys.modules holds it: the first pieces of a cast start on
    # every worker at once, and while one imports ml_dtypes, the module there is half made; the
    # statement waits for that import to finish (a 6-thread conversion failed without it).
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - a broken install
        return None
    return ml_dtypes


@cache
def _ml_bfloat16() -> np.dtype[Any] | None:
    """ml_dtypes' bfloat16, where ml_dtypes is at hand (:func:`_ml_dtypes_module`); else None.

    Its float32 -> bfloat16 cast is one vectorised pass, with ml_dtypes 0.6.0
    1.2-1.7x faster than the five numpy passes of :func:`_f32_to_bf16`'s other
    path, and rounds every
    non-NaN float32 exactly as torch does (checked against torch for all
    2**32 patterns with ml_dtypes 0.5.4, 0.6.0 and 0.7.0). It encodes NaNs its own way
    (``0x7FC0`` with the sign), which is overwritten like the numpy path's.
    """
    ml_dtypes = _ml_dtypes_module()
    if ml_dtypes is None:
        return None
    dtype: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return dtype


def _f32_to_bf16(src: Array, out: Array, scratch: _Scratch, nan_bits: int, bfloat16: Any = True) -> None:
    """Round float32 to bfloat16, nearest-even; NaNs become ``nan_bits``.

    With ml_dtypes, where it is the faster here, its cast does the rounding (see
    :func:`_ml_bfloat16`, :func:`_ml_faster`). Otherwise the integer form
    ``(u + 0x7FFF + lsb) >> 16`` does, which is
    exact for every finite value and inf, including rounding across a binade
    and up to inf. NaNs are then overwritten with ``nan_bits`` (torch does not
    keep NaN payloads here); the integer sums wrap around for negative NaNs
    only, which are overwritten anyway.
    """
    if bfloat16 is True:
        bfloat16 = _fast_ml_dtype("bfloat16")
    if bfloat16 is not None:
        np.copyto(out.view(bfloat16), src, casting="unsafe")
    else:
        bits = src.view(np.uint32)
        tmp = scratch.u32(src.size)
        np.right_shift(bits, 16, out=tmp)
        np.bitwise_and(tmp, 1, out=tmp)
        np.add(tmp, 0x7FFF, out=tmp)
        np.add(tmp, bits, out=tmp)
        np.right_shift(tmp, 16, out=tmp)
        np.copyto(out, tmp, casting="unsafe")
    nans = _nan_positions(src, scratch)
    if nans is not None:
        out[nans] = nan_bits


def _k_f32_bf16(src: Array, out: Array, scratch: _Scratch) -> None:
    _f32_to_bf16(src, out, scratch, _BF16_NAN_VECTOR)


def _k_f64_bf16(src: Array, out: Array, scratch: _Scratch) -> None:
    # Twice rounded, like torch: float64 -> float32 -> bfloat16.
    f32 = scratch.mid(src.size)
    np.copyto(f32, src, casting="unsafe")
    _f32_to_bf16(f32, out, scratch, _BF16_NAN_VECTOR)


def _k_f16_bf16(src: Array, out: Array, scratch: _Scratch) -> None:
    # float16 -> float32 is exact; NaNs become 0x7FC0 whatever their payload.
    f32 = scratch.mid(src.size)
    _k_f16_f32(src, f32, scratch)
    _f32_to_bf16(f32, out, scratch, _BF16_NAN_SCALAR)


# -- to float16 -------------------------------------------------------------------


@lru_cache(maxsize=8)
def _filled(value: int, size: int) -> Array:
    """A read-only uint32 array of ``value``: numpy's ``maximum`` is SIMD only between two arrays."""
    array = aligned_empty(size, np.uint32)
    array.fill(value)
    array.flags.writeable = False
    return array


def _f32_to_f16(src: Array, out: Array, scratch: _Scratch) -> None:
    """Round float32 to float16 like F16C's ``vcvtps2ph`` (nearest even, subnormals, inf).

    numpy's own cast rounds finite values right but runs a scalar software
    loop (about half the speed) and leaves signalling NaNs signalling. This
    is the branch-free float trick of Maratyszcza's FP16 library: scaling by
    2**112 then 2**-110 sends what overflows float16 to inf, and adding a
    power of two just above the value makes the FPU round the float16
    mantissa, subnormals included, into the low bits. NaNs are patched after.
    """
    if scratch.tame:
        _f32_to_f16_tame(src, out, scratch)
        return
    n = src.size
    bits = src.view(np.uint32)
    value = scratch.take_magnitude(src).view(np.float32)  # |x|
    bias = scratch.f32(n).view(np.uint32)
    np.multiply(value, np.float32(2.0**112), out=value)
    np.multiply(value, np.float32(2.0**-110), out=value)
    # 2**(e + 15) for the value's exponent e, at least 2**1 (float16 subnormals).
    np.bitwise_and(bits, np.uint32(0x7F800000), out=bias)
    np.maximum(bias, _filled(0x38800000, max(n, BLOCK_ELEMENTS))[:n], out=bias)
    np.add(bias, np.uint32(0x07800000), out=bias)
    np.add(value, bias.view(np.float32), out=value)
    rounded = value.view(np.uint32)
    np.right_shift(rounded, 13, out=bias)
    np.bitwise_and(bias, np.uint32(0x7C00), out=bias)  # exponent
    np.bitwise_and(rounded, np.uint32(0x0FFF), out=rounded)  # mantissa, with any carry
    np.add(bias, rounded, out=bias)
    np.right_shift(bits, 16, out=rounded)  # contiguous u32 ops beat strided u16 ones
    np.bitwise_and(rounded, np.uint32(0x8000), out=rounded)
    np.bitwise_or(bias, rounded, out=bias)
    half = out.view(np.uint16)
    np.copyto(half, bias, casting="unsafe")
    nans = _nan_positions(src, scratch)
    if nans is not None:
        nan_bits = bits[nans]
        half[nans] = ((nan_bits >> 16) & 0x8000) | 0x7E00 | ((nan_bits >> 13) & 0x03FF)


@cache
def _ml_complex32() -> np.dtype[Any] | None:
    """ml_dtypes' complex32 (two float16s), where ml_dtypes is at hand (:func:`_ml_dtypes_module`),
    has it, and it rounds as torch does; else None.

    Cast from complex64, it rounds a pair of float32s to a pair of float16s,
    so a float32 block viewed as complex64 comes out as its float16 block, in
    one pass that is faster than :func:`_f32_to_f16_tame`'s numpy passes (1 GiB
    cast from a memory map on one thread of the 2-core VM: 0.60 against 0.75 s).
    For finite values below float16's overflow it
    rounds exactly as torch does (checked against torch for all such float32
    patterns with ml_dtypes 0.6.0); only tame blocks use it (NaN and overflow
    encodings are not relied on). Older ml_dtypes have no complex32; and a
    version that rounded differently is caught here, once, by comparing it
    with :func:`_f32_to_f16_tame` on every float16 rounding boundary.
    """
    ml_dtypes = _ml_dtypes_module()
    if ml_dtypes is None:
        return None
    complex32 = getattr(ml_dtypes, "complex32", None)
    if complex32 is None:  # pragma: no cover - older ml_dtypes have none
        return None
    dtype: np.dtype[Any] = np.dtype(complex32)
    if dtype.itemsize != 4:  # pragma: no cover - not two float16s
        return None
    # Every finite float16 midpoint (a tie), and the float32 values just below and above.
    halves = np.arange(0x7BFF, dtype=np.uint16)
    low = halves.view(np.float16).astype(np.float32).view(np.uint32)
    high = (halves + 1).view(np.float16).astype(np.float32).view(np.uint32)
    middle = ((low.astype(np.uint64) + high) // 2).astype(np.uint32)
    probes = np.concatenate([middle, middle | np.uint32(0x80000000), middle - 1, middle + 1, low[::7]])
    values = probes[: probes.size - probes.size % 2].view(np.float32)
    expected = np.empty(values.size, np.float16)
    scratch = _Scratch(values.size)
    _f32_to_f16_tame(values, expected, scratch, complex32=None)
    got = np.empty(values.size // 2, dtype)
    np.copyto(got, values.view(np.complex64), casting="unsafe")
    return dtype if np.array_equal(got.view(np.uint16), expected.view(np.uint16)) else None


def _f32_to_f16_tame(src: Array, out: Array, scratch: _Scratch, complex32: Any = True) -> None:
    """:func:`_f32_to_f16` for a block of finite values that all stay below float16's overflow.

    With ml_dtypes' complex32 (:func:`_ml_complex32`), where it is the faster here
    (:func:`_ml_faster`), its cast does the rounding, two elements at a time; an odd
    last element takes the passes below.

    The same rounding in 11 passes instead of 15 (``|x|`` shared with the
    tameness test: :meth:`_Scratch.magnitude`), the sign's last two over 16-bit
    data. With no inf to produce, the 2**112 overflow scaling goes, and
    ``|x|`` is rounded where the full kernel rounds ``4|x|``: the bias is a
    quarter of that kernel's, so the float16 exponent would come out 2 below,
    and the ``0x800`` in the bias's mantissa (2 << 10, on the rounding grid, and
    even, so ties still go to even) adds the 2 back when the mantissa bits are
    added to the exponent's. For float32 zeros and subnormals ``|x|`` is far
    below the bias's half ulp, so they still round to 0. The rounded sum ``v``
    is ``E << 23 | (0x800 + k)`` with ``k``, the float16 significand, at most
    2048, so bits 13-22 of ``v`` are zero and the float16 bits are the low 16
    of ``v + (v >> 13)``: ``E << 10`` carries the exponent (``E << 23`` and
    the ``128 << 10`` in ``E`` lie above bit 15), ``0x800 + k`` the mantissa.
    """
    if complex32 is True:
        complex32 = _fast_ml_dtype("float16")
    if complex32 is not None and src.size >= 2:
        even = src.size - src.size % 2
        np.copyto(out[:even].view(complex32), src[:even].view(np.complex64), casting="unsafe")
        if even == src.size:
            return
        src, out = src[even:], out[even:]
    n = src.size
    bits = src.view(np.uint32)
    value = scratch.take_magnitude(src)  # |x|
    bias = scratch.f32(n).view(np.uint32)
    # 2**(e + 13) for the value's exponent e, at least 2**-1 (float16 subnormals), with 0x800 in its
    # mantissa: 2 in the exponent that the float16 one comes out 2 below (it is 4|x|'s in the full kernel).
    np.maximum(value, _filled(0x38800000, max(n, BLOCK_ELEMENTS))[:n], out=bias)
    np.bitwise_and(bias, np.uint32(0x7F800000), out=bias)
    np.add(bias, np.uint32(0x06800800), out=bias)
    np.add(value.view(np.float32), bias.view(np.float32), out=value.view(np.float32))
    np.right_shift(value, 13, out=bias)
    np.add(bias, value, out=bias)
    half = out.view(np.uint16)
    np.copyto(half, bias, casting="unsafe")
    # The sign in 16 bits: one shift that narrows as it goes, then two passes
    # over half the bytes (a fifth of the kernel's time less than in 32 bits).
    sign = value.view(np.uint16)[:n]
    np.right_shift(bits, 16, out=sign, casting="unsafe")
    np.bitwise_and(sign, np.uint16(0x8000), out=sign)
    np.bitwise_or(half, sign, out=half)


def _ml_dtype(target: str) -> np.dtype[Any] | None:
    """ml_dtypes' dtype whose cast from float32 (complex64 for float16) rounds to ``target``, or None."""
    return _ml_bfloat16() if target == "bfloat16" else _ml_complex32() if target == "float16" else None


def _fast_ml_dtype(target: str) -> np.dtype[Any] | None:
    """:func:`_ml_dtype` where its cast is the faster here (:func:`_ml_faster`), else None: the numpy passes."""
    return _ml_dtype(target) if _ml_faster(target) else None


def _sample_weights(n: int) -> Array:
    """``n`` float32 values spread like a layer's weights (uniform in +-0.08, random signs and
    mantissas, a few below float16's normal range), made without ``numpy.random``'s import."""
    bits = np.arange(1, n + 1, dtype=np.uint32)
    for shift, factor in ((16, 0x45D9F3B), (16, 0x45D9F3B), (16, 1)):  # a 32-bit integer hash
        np.bitwise_xor(bits, bits >> np.uint32(shift), out=bits)
        np.multiply(bits, np.uint32(factor), out=bits)
    values = bits.astype(np.float32)
    values *= np.float32(0.16 / 2**32)
    values -= np.float32(0.08)
    return values


def _seconds(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


@cache
def _ml_faster(target: str) -> bool:
    """Whether ml_dtypes' float32 -> ``target`` cast (bfloat16, or float16 through complex32) beats
    the numpy passes on this machine, as the tame path runs each; measured once per process.

    Both are exact, so the choice moves only the speed, and which is faster depends on the
    ml_dtypes release: on the 2-core VM a 4 MiB piece cast to float16 at 3.0 GB/s through
    ml_dtypes 0.6.0 and at 2.0-2.1 through 0.7.0, against 2.6-2.9 through the numpy passes; to
    bfloat16 at 6.9-7.4 and 3.9-4.1 against 4.4-6.6. False without ml_dtypes at hand. Each
    way is timed on one block of weight-like values (:func:`_sample_weights`), best of three runs
    taken in turn (about 2 ms in all).
    """
    dtype = _ml_dtype(target)
    if dtype is None:
        return False
    values = _sample_weights(BLOCK_ELEMENTS)
    out = np.empty(values.size, _STORAGE[target])
    scratch = _Scratch(values.size)
    scratch.tame = True
    bits = out.view(np.uint16)
    if target == "float16":

        def ml_way() -> object:
            np.copyto(out.view(dtype), values.view(np.complex64), casting="unsafe")
            return bits.view(np.int16).max() < 0x7C00 and bits.max() < 0xFC00

        def numpy_way() -> object:
            tame = values.max() < 65520 and values.min() > -65520
            _f32_to_f16_tame(values, out, scratch, complex32=None)
            return tame

    else:

        def ml_way() -> object:
            np.copyto(out.view(dtype), values, casting="unsafe")
            return bits.view(np.int16).max() < 0x7F80 and bits.max() < 0xFF80

        def numpy_way() -> object:
            tame = values.max() < 3e38 and values.min() > -3e38
            _f32_to_bf16(values, out, scratch, _BF16_NAN_VECTOR, bfloat16=None)
            return tame

    ml_way(), numpy_way()  # first runs: page faults, caches
    ml_best = numpy_best = float("inf")
    for _ in range(3):
        ml_best = min(ml_best, _seconds(ml_way))
        numpy_best = min(numpy_best, _seconds(numpy_way))
    return ml_best <= numpy_best


def _k_f64_f16(src: Array, out: Array, scratch: _Scratch) -> None:
    # Twice rounded, like torch: float64 -> float32 -> float16.
    f32 = scratch.mid(src.size)
    np.copyto(f32, src, casting="unsafe")
    _f32_to_f16(f32, out, scratch)


def _k_bf16_f16(src: Array, out: Array, scratch: _Scratch) -> None:
    f32 = scratch.mid(src.size)
    _k_bf16_f32(src, f32, scratch)
    _f32_to_f16(f32, out, scratch)


# -- to float32 / float64 ---------------------------------------------------------


def _k_f16_f32(src: Array, out: Array, scratch: _Scratch) -> None:
    """Widen float16 exactly; infinities and NaNs (quieted) as F16C's ``vcvtph2ps`` gives them.

    Faster than numpy's scalar cast: the sign-extended bits shifted into
    place are a float32 2**112 times too small (subnormals included), which
    one exact multiply fixes. Only inf and NaN (exponent all ones) need more.
    """
    wide = scratch.u32(src.size)
    np.copyto(wide.view(np.int32), src.view(np.int16))  # sign-extends
    np.left_shift(wide, 13, out=wide)
    np.bitwise_and(wide, np.uint32(0x8FFFFFFF), out=wide)  # sign, then exponent and mantissa
    np.multiply(wide.view(np.float32), np.float32(2.0**112), out=out)
    magnitude = wide.view(np.uint16)[: src.size]
    np.bitwise_and(src.view(np.uint16), np.uint16(0x7FFF), out=magnitude)
    if magnitude.max(initial=0) < 0x7C00:
        return
    special = np.flatnonzero(magnitude >= 0x7C00)
    half = src.view(np.uint16)[special].astype(np.uint32)
    mantissa = half & 0x03FF
    quiet = np.where(mantissa != 0, np.uint32(0x00400000), np.uint32(0))
    out.view(np.uint32)[special] = ((half & 0x8000) << 16) | 0x7F800000 | quiet | (mantissa << 13)


def _k_bf16_f32(src: Array, out: Array, scratch: _Scratch) -> None:
    """Widen bfloat16: its bits are the high half of the float32 (NaNs kept as they are)."""
    wide = out.view(np.uint32)
    np.copyto(wide, src)
    np.left_shift(wide, 16, out=wide)


def _k_f16_f64(src: Array, out: Array, scratch: _Scratch) -> None:
    f32 = scratch.mid(src.size)
    _k_f16_f32(src, f32, scratch)
    np.copyto(out, f32)


def _k_bf16_f64(src: Array, out: Array, scratch: _Scratch) -> None:
    # Through float32, so that signalling NaNs are quieted by the hardware widening, as in torch.
    f32 = scratch.mid(src.size)
    _k_bf16_f32(src, f32, scratch)
    np.copyto(out, f32)


def _k_numpy(src: Array, out: Array, scratch: _Scratch) -> None:
    """float32 <-> float64: numpy uses the same hardware conversion as torch."""
    np.copyto(out, src, casting="unsafe")


# -- from float8 (lookup tables) ------------------------------------------------


def _e4m3fn_to_f32_table() -> Array:
    """float32 bits of all 256 float8_e4m3fn patterns (bias 7, no inf, NaN = S.1111.111)."""
    code = np.arange(256, dtype=np.uint32)
    exponent = (code >> 3) & 0xF
    mantissa = (code & 0x7).astype(np.float64)
    magnitude = np.where(
        exponent == 0,
        mantissa * 2.0**-9,  # subnormal: m/8 * 2**-6
        (8.0 + mantissa) * np.exp2(exponent.astype(np.float64) - 10.0),  # (1 + m/8) * 2**(e-7)
    )
    value = np.where(code >= 0x80, -magnitude, magnitude).astype(np.float32)
    bits = value.view(np.uint32).copy()
    nan = (code & 0x7F) == 0x7F
    # torch widens the NaN like the other codes: exponent all ones, mantissa 0b111 shifted up.
    bits[nan] = ((code[nan] & 0x80) << 24) | 0x7FF00000
    return bits


def _e5m2_to_f32_table() -> Array:
    """float32 bits of all 256 float8_e5m2 patterns: each is the top byte of a float16."""
    half = (np.arange(256, dtype=np.uint16) << 8).view(np.float16)
    out = np.empty(256, np.float32)
    _k_f16_f32(half, out, _Scratch(256))
    return out.view(np.uint32)


def _fnuz_to_f32_table(exponent_bits: int, bias: int) -> Array:
    """float32 bits of all 256 patterns of a "fnuz" float8 (no inf, no -0: 0x80 is the one NaN)."""
    code = np.arange(256, dtype=np.uint32)
    mantissa_bits = 7 - exponent_bits
    exponent = ((code >> mantissa_bits) & ((1 << exponent_bits) - 1)).astype(np.float64)
    mantissa = (code & ((1 << mantissa_bits) - 1)).astype(np.float64)
    scale = float(1 << mantissa_bits)
    magnitude = np.where(
        exponent == 0,
        mantissa / scale * 2.0 ** (1 - bias),  # subnormal
        (1.0 + mantissa / scale) * np.exp2(exponent - bias),
    )
    value = np.where(code >= 0x80, -magnitude, magnitude).astype(np.float32)
    bits = value.view(np.uint32).copy()
    bits[0x80] = _FLOAT8_NAN_F32
    return bits


def _e8m0_to_f32_table() -> Array:
    """float32 bits of all 256 float8_e8m0fnu patterns: 2**(code - 127), 0xFF is NaN (no sign, no zero)."""
    code = np.arange(255, dtype=np.float64)
    bits = np.empty(256, np.uint32)
    bits[:255] = np.exp2(code - 127.0).astype(np.float32).view(np.uint32)
    bits[0xFF] = _FLOAT8_NAN_F32
    return bits


# What torch widens the NaN of the fnuz and e8m0 float8 types to: a signalling NaN
# (c10's fp8_fnuz/e8m0 conversions build it from bits), as the tests check against torch.
_FLOAT8_NAN_F32 = 0x7F800001


def _float8_to_f32_table(source: str) -> Array:
    if source == "float8_e4m3fn":
        return _e4m3fn_to_f32_table()
    if source == "float8_e5m2":
        return _e5m2_to_f32_table()
    if source == "float8_e4m3fnuz":
        return _fnuz_to_f32_table(4, 8)
    if source == "float8_e5m2fnuz":
        return _fnuz_to_f32_table(5, 16)
    return _e8m0_to_f32_table()


@cache
def _float8_overflows(source: str, target: str) -> Array:
    """For each of the 256 patterns: True when a finite value becomes inf in ``target``."""
    wide = _float8_to_f32_table(source).view(np.float32)
    narrow = _float8_table(source, target)
    uint = _UINT[narrow.dtype.itemsize]
    magnitude = narrow.view(uint) & uint.type((1 << (8 * uint.itemsize - 1)) - 1)
    hits: Array = np.isfinite(wide) & (magnitude == uint.type(_INF_BITS[target]))
    return hits


@cache
def _float8_table(source: str, target: str) -> Array:
    """Result of casting every float8 pattern, in ``target``'s storage dtype.

    torch widens float8 to float32 and casts that; bfloat16 NaNs come out as
    ``0x7FC0`` (its scalar path), float16 NaNs as F16C gives them.
    """
    wide = _float8_to_f32_table(source).view(np.float32)
    out = np.empty(256, _STORAGE[target])
    scratch = _Scratch(256)
    with np.errstate(all="ignore"):
        if target == "float32":
            out[:] = wide
        elif target == "bfloat16":
            _f32_to_bf16(wide, out, scratch, _BF16_NAN_SCALAR)
        elif target == "float16":
            _f32_to_f16(wide, out, scratch)
        else:
            np.copyto(out, wide)
    out.flags.writeable = False
    return out


def _table_kernel(source: str, target: str) -> _Kernel:
    def kernel(src: Array, out: Array, scratch: _Scratch) -> None:
        np.take(_float8_table(source, target), src, out=out, mode="clip")

    return kernel


_KERNELS: dict[tuple[str, str], _Kernel] = {
    ("float64", "float32"): _k_numpy,
    ("float64", "float16"): _k_f64_f16,
    ("float64", "bfloat16"): _k_f64_bf16,
    ("float32", "float64"): _k_numpy,
    ("float32", "float16"): _f32_to_f16,
    ("float32", "bfloat16"): _k_f32_bf16,
    ("float16", "float64"): _k_f16_f64,
    ("float16", "float32"): _k_f16_f32,
    ("float16", "bfloat16"): _k_f16_bf16,
    ("bfloat16", "float64"): _k_bf16_f64,
    ("bfloat16", "float32"): _k_bf16_f32,
    ("bfloat16", "float16"): _k_bf16_f16,
}
for _source in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
    for _target in ("float64", "float32", "float16", "bfloat16"):
        _KERNELS[(_source, _target)] = _table_kernel(_source, _target)

#: Every ``(source, target)`` pair :func:`cast_array` handles, besides ``source == target``.
CAST_PAIRS = frozenset(_KERNELS)


def _kernel(source: str, target: str) -> _Kernel:
    storage_dtype(source)
    storage_dtype(target)
    try:
        return _KERNELS[(source, target)]
    except KeyError:
        raise ValueError(f"ckptconv cannot cast {source} to {target}") from None


def _as_storage(values: Array, source: str) -> Array:
    """``values`` viewed as ``source``'s native storage dtype, contiguous (copied only if it must be)."""
    dtype = storage_dtype(source)
    if values.dtype.itemsize != dtype.itemsize or values.dtype.kind not in "uif":
        raise TypeError(f"{source} values must be a {dtype.itemsize}-byte numeric array, not {values.dtype}")
    if not values.dtype.isnative:
        values = values.astype(values.dtype.newbyteorder("="))
    return np.ascontiguousarray(values).view(dtype)


def cast_array(values: Array, source: str, target: str, *, out: Array | None = None) -> Array:
    """Cast an array in ``source``'s storage representation to ``target``'s, bit-exact with torch CPU.

    ``values`` may be any array of ``source``'s width (a uint16 view of
    float16 is fine; read-only inputs too); the result has ``values``'s shape
    and ``target``'s :func:`storage_dtype`. When ``source == target`` the input
    itself comes back (viewed, not copied), as ``Tensor.to`` returns ``self``.

    ``out``, if given, receives the result and is returned; reusing one lets
    a streaming caller convert chunk after chunk without allocating.
    """
    return _cast_blocks(values, source, target, out, count=False)[0]


def cast_counting_overflows(values: Array, source: str, target: str, *, out: Array | None = None) -> tuple[Array, int]:
    """:func:`cast_array` and :func:`count_overflows` in one pass over the data.

    Each block is counted while it is still in cache from its cast, which is
    what the streaming writer needs for every chunk it casts.
    """
    return _cast_blocks(values, source, target, out, count=True)


# The pairs whose kernels run faster on a tame block (see _Scratch.tame).
_TAME_KERNELS = frozenset(
    {("float32", "float16"), ("float64", "float16"), ("float32", "bfloat16"), ("float64", "bfloat16")}
)


@cache
def _tame_bound(source: str, target: str) -> Any:
    """The smallest ``source`` magnitude whose cast to ``target`` overflows, as a numpy scalar, or None.

    A block whose max is below it and whose min is above its negative is
    tame: finite (a NaN fails both comparisons) and nothing overflows. Two
    reductions decide that for the overflow count, the NaN patching and the
    float16 kernel's fast form at once. None when the source has no numpy
    float type or nothing can overflow.
    """
    stored = storage_dtype(source)
    threshold = _overflow_threshold(source, target) if stored.kind == "f" else None
    if threshold is None:
        return None
    return np.array([threshold], _UINT[stored.itemsize]).view(stored)[0]


# float32 bit patterns that are never tame: NaNs (quiet, signalling, both signs, payloads),
# infinities and the largest finite values (with each target's first overflowing value).
_UNTAME_F32 = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA12345, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F810000]
_UNTAME_F32 += [0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF]


@cache
def _output_checked(source: str, target: str) -> tuple[Callable[[Array, Array], None], int] | None:
    """``(cast, inf_bits)`` for float32 -> bfloat16 / float16 through ml_dtypes, whose output tells tameness.

    ml_dtypes' casts (:func:`_ml_bfloat16`, :func:`_ml_complex32`) turn every
    value that is not tame (NaN, inf, or rounding to inf) into a 16-bit pattern
    of magnitude at least inf's, and every tame one into torch's finite result
    (both checked against all float32 patterns with ml_dtypes 0.6.0, and here
    on NaNs, infinities and the overflow thresholds before use). So a block is
    cast first and is tame when two reductions over its 16-bit output find no
    such magnitude: that replaces the two float32 reductions, and the first
    read of the input happens in the cast. A block that is not tame is cast
    again by the full kernel, which also counts its overflows.
    """
    if source != "float32":
        return None
    inf = _INF_BITS[target] if target in ("bfloat16", "float16") else None
    dtype = _fast_ml_dtype(target)
    if inf is None or dtype is None:
        return None
    if target == "bfloat16":

        def cast(block: Array, out: Array) -> None:
            np.copyto(out.view(dtype), block, casting="unsafe")

    else:

        def cast(block: Array, out: Array) -> None:
            np.copyto(out.view(dtype), block.view(np.complex64), casting="unsafe")

    first = _overflow_threshold(source, target) or 0x7F800000
    probes = np.array([*_UNTAME_F32, first, first | 0x80000000], dtype=np.uint32).view(np.float32)
    result = np.empty(probes.size, _STORAGE[target])
    with np.errstate(all="ignore"):
        cast(probes, result)
    return (cast, inf) if bool(np.all(result.view(np.uint16) & 0x7FFF >= inf)) else None


def _magnitude_bound(bound: Any) -> Any:
    """A float32 bound's bits: ``|x|``'s bits are below them exactly when ``|x| < bound``, and
    never for a NaN or inf (their bits are the largest)."""
    return None if bound is None else np.array([bound], np.float32).view(np.uint32)[0]


def _within(block: Array, bound: Any, scratch: _Scratch, magnitude_bound: Any) -> bool:
    """Whether every value of ``block`` lies strictly between ``-bound`` and ``bound`` (no NaN)."""
    if magnitude_bound is not None:
        return bool(scratch.magnitude(block).max() < magnitude_bound)
    return bool(block.max() < bound and block.min() > -bound)


def _cast_blocks(
    values: Array, source: str, target: str, out: Array | None, *, count: bool, tame: bool = True
) -> tuple[Array, int]:
    kernel = None if source == target else _kernel(source, target)
    src = _as_storage(values, source).reshape(-1)
    if kernel is None:
        if out is None:
            return src.reshape(values.shape), 0
        kernel = _k_numpy
    dtype = storage_dtype(target)
    if out is None:
        result = np.empty(src.size, dtype)
    else:
        if out.dtype != dtype or out.size != src.size or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous {dtype} array of {src.size} elements")
        result = out.reshape(-1)
    n = src.size
    counter = _OverflowCounter(source, target, min(n, BLOCK_ELEMENTS)) if count and source != target else None
    bound = _tame_bound(source, target) if tame and (counter is not None or (source, target) in _TAME_KERNELS) else None
    checked = _output_checked(source, target) if tame else None
    # The float16 kernels start from |x|: the test takes its max, and they reuse it.
    by_magnitude = _magnitude_bound(bound) if (source, target) == ("float32", "float16") else None
    overflows = 0
    # Overflow to inf and NaN inputs are expected here, not worth a warning.
    with _thread_scratch() as scratch, np.errstate(all="ignore"):
        for start in range(0, n, BLOCK_ELEMENTS):
            block = src[start : start + BLOCK_ELEMENTS]
            dest = result[start : start + BLOCK_ELEMENTS]
            if checked is not None and block.size % 2 == 0:
                cast, inf = checked
                cast(block, dest)
                bits = dest.view(np.uint16)
                if bits.view(np.int16).max() < inf and bits.max() < 0x8000 + inf:
                    continue  # tame: nothing to patch, nothing overflowed
            scratch.tame = bound is not None and _within(block, bound, scratch, by_magnitude)
            kernel(block, dest, scratch)
            if counter is not None and not scratch.tame:
                overflows += counter.count(block)
    return (result.reshape(values.shape) if out is None else out), overflows


@cache
def _overflow_threshold(source: str, target: str) -> int | None:
    """Smallest magnitude bit pattern of ``source`` whose cast to ``target`` is inf, or None.

    Found by bisection through :func:`cast_array` itself (rounding is
    monotonic), so the count can never disagree with the cast, even for the
    twice-rounded float64 casts where the threshold is awkward to derive.
    """
    uint = _UINT[storage_dtype(source).itemsize]
    target_uint = _UINT[storage_dtype(target).itemsize]
    target_inf = _INF_BITS[target]

    def overflows(pattern: int) -> bool:
        bits = np.array([pattern], dtype=uint)
        # Without the tame test, which needs this threshold.
        result = _cast_blocks(bits, source, target, None, count=False, tame=False)[0].view(target_uint)
        return int(result[0]) == target_inf

    low, high = 0, _INF_BITS[source] - 1  # the largest finite magnitude
    if not overflows(high):
        return None
    while low < high:  # invariant: high overflows
        mid = (low + high) // 2
        if overflows(mid):
            high = mid
        else:
            low = mid + 1
    return high


class _OverflowCounter:
    """Counts, block by block, the finite ``source`` values whose cast to ``target`` is ±inf."""

    def __init__(self, source: str, target: str, size: int) -> None:
        stored = storage_dtype(source)
        # float8: all 256 patterns are looked up (the fnuz and e8m0 layouts have no
        # sign-magnitude threshold to compare with).
        self.table = _float8_overflows(source, target) if stored.itemsize == 1 else None
        if self.table is not None:
            return
        self.threshold = _overflow_threshold(source, target)
        self.uint = _UINT[stored.itemsize]
        self.magnitude_mask = self.uint.type((1 << (8 * self.uint.itemsize - 1)) - 1)
        threshold = self.threshold or 0
        self.span = self.uint.type(_INF_BITS[source] - threshold)
        self.low = self.uint.type(threshold)
        # For numpy float sources, a block whose min and max lie strictly inside
        # (-threshold, threshold) has no overflow: two read-only reductions
        # instead of four passes. A NaN makes both comparisons false, so such
        # blocks (and those holding infs or large values) take the exact count.
        self.bound = np.array([threshold], self.uint).view(stored)[0] if stored.kind == "f" else None
        self.size = size
        self._tmp: Array | None = None
        self._hit: Array | None = None

    def count(self, block: Array) -> int:
        """Overflows in ``block`` (at most ``size`` elements in the source's storage dtype)."""
        if self.table is not None:
            return int(np.count_nonzero(np.take(self.table, block)))
        if self.threshold is None or block.size == 0:
            return 0
        if self.bound is not None and block.max() < self.bound and block.min() > -self.bound:
            return 0
        if self._tmp is None or self._hit is None:
            self._tmp = np.empty(self.size, self.uint)
            self._hit = np.empty(self.size, np.bool_)
        t = self._tmp[: block.size]
        h = self._hit[: block.size]
        np.bitwise_and(block.view(self.uint), self.magnitude_mask, out=t)
        # threshold <= |x| < inf, as one unsigned compare after shifting by threshold.
        np.subtract(t, self.low, out=t)
        np.less(t, self.span, out=h)
        return int(np.count_nonzero(h))


def count_overflows(values: Array, source: str, target: str) -> int:
    """How many finite source values become ±inf in target (e.g. fp32 70000.0 -> fp16 inf).

    ckptconv refuses such casts unless asked, since they silently destroy
    weights. Computed on the bits (magnitudes at or above a per-pair
    threshold), without casting.
    """
    if source == target:
        return 0
    _kernel(source, target)
    stored = _as_storage(values, source).reshape(-1)
    n = stored.size
    counter = _OverflowCounter(source, target, min(n, BLOCK_ELEMENTS))
    total = 0
    with np.errstate(all="ignore"):
        for start in range(0, n, BLOCK_ELEMENTS):
            total += counter.count(stored[start : start + BLOCK_ELEMENTS])
    return total


def cast_bytes(data: bytes | bytearray | memoryview, source: str, target: str) -> Array:
    """Cast raw little-endian ``source`` bytes to a little-endian ``target`` array.

    Each element is cast on its own, so splitting ``data`` anywhere on an
    element boundary and concatenating the results gives the same bytes.
    The result supports the buffer protocol (``file.write(result)`` works);
    ``.tobytes()`` gives ``bytes``.
    """
    dtype = storage_dtype(source)
    view = memoryview(data).cast("B")
    if view.nbytes % dtype.itemsize:
        raise ValueError(f"{view.nbytes} bytes is not a whole number of {source} elements")
    values = np.frombuffer(view, dtype=dtype.newbyteorder("<"))
    result = cast_array(values, source, target)
    if _BIG_ENDIAN:
        result = result.astype(result.dtype.newbyteorder("<"))
    return result
