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

import time
from functools import cache
from typing import Any, Callable

import numpy as np

from ckptconv.transforms.casts import float16, ml_support
from ckptconv.transforms.casts.bfloat16 import _BF16_NAN_VECTOR, _f32_to_bf16, _k_f16_bf16, _k_f32_bf16, _k_f64_bf16
from ckptconv.transforms.casts.buffers import (
    _BIG_ENDIAN,
    _INF_BITS,
    _STORAGE,
    _UINT,
    ALIGNMENT,
    BLOCK_ELEMENTS,
    Array,
    _Kernel,
    _Scratch,
    _thread_scratch,
    aligned_empty,
    storage_dtype,
)
from ckptconv.transforms.casts.float8 import _float8_overflows, _table_kernel
from ckptconv.transforms.casts.float16 import _f32_to_f16, _f32_to_f16_tame, _k_bf16_f16, _k_f64_f16
from ckptconv.transforms.casts.widening import _k_bf16_f32, _k_bf16_f64, _k_f16_f32, _k_f16_f64

__all__ = [
    "ALIGNMENT",
    "BLOCK_ELEMENTS",
    "CAST_PAIRS",
    "Array",
    "aligned_empty",
    "cast_array",
    "cast_bytes",
    "cast_counting_overflows",
    "count_overflows",
    "storage_dtype",
]


# -- to bfloat16 ------------------------------------------------------------------


# -- to float16 -------------------------------------------------------------------


# -- to float32 / float64 ---------------------------------------------------------


def _k_numpy(src: Array, out: Array, scratch: _Scratch) -> None:
    """float32 <-> float64: numpy uses the same hardware conversion as torch."""
    np.copyto(out, src, casting="unsafe")


# -- from float8 (lookup tables) ------------------------------------------------


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


# The kernels ask ml_support whether ml_dtypes is the faster; it asks _ml_faster, looked up at each
# call so that a test or bench that replaces _ml_faster is heard.
ml_support.time_with(lambda target: _ml_faster(target))  # noqa: PLW0108 - looked up at each call, see above


def _ml_dtype(target: str) -> np.dtype[Any] | None:
    """ml_dtypes' dtype whose cast from float32 (complex64 for float16) rounds to ``target``, or None."""
    return (
        ml_support._ml_bfloat16() if target == "bfloat16" else float16._ml_complex32() if target == "float16" else None
    )


def _fast_ml_dtype(target: str) -> np.dtype[Any] | None:
    """:func:`_ml_dtype` where its cast is the faster here (:func:`_ml_faster`), else None: the numpy passes."""
    return _ml_dtype(target) if _ml_faster(target) else None
