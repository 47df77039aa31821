"""Casts to float16 (and ml_dtypes' complex32, where it is the faster), bit-exact with torch.

The rounding and NaN rules are in :mod:`ckptconv.transforms.casts`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np

from ckptconv.transforms.casts import ml_support
from ckptconv.transforms.casts.buffers import BLOCK_ELEMENTS, Array, _filled, _nan_positions, _Scratch
from ckptconv.transforms.casts.ml_support import _ml_dtypes_module
from ckptconv.transforms.casts.widening import _k_bf16_f32


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
        complex32 = _ml_complex32() if ml_support.faster("float16") else None
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


def _k_f64_f16(src: Array, out: Array, scratch: _Scratch) -> None:
    # Twice rounded, like torch: float64 -> float32 -> float16.
    f32 = scratch.mid(src.size)
    np.copyto(f32, src, casting="unsafe")
    _f32_to_f16(f32, out, scratch)


def _k_bf16_f16(src: Array, out: Array, scratch: _Scratch) -> None:
    f32 = scratch.mid(src.size)
    _k_bf16_f32(src, f32, scratch)
    _f32_to_f16(f32, out, scratch)


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
