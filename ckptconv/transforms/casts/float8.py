"""Casts from the float8 formats (e4m3fn, e5m2, their fnuz variants, e8m0): a lookup table per source and target."""

from __future__ import annotations

from functools import cache

import numpy as np

from ckptconv.transforms.casts.bfloat16 import _BF16_NAN_SCALAR, _f32_to_bf16
from ckptconv.transforms.casts.buffers import _INF_BITS, _STORAGE, _UINT, Array, _Kernel, _Scratch
from ckptconv.transforms.casts.float16 import _f32_to_f16
from ckptconv.transforms.casts.widening import _k_f16_f32


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
        # Indices of our own, and "wrap" (codes are below 256, so nothing wraps): numpy's take
        # otherwise converts the codes into a new intp array and checks bounds through a copy of
        # its output; 3.7 ms against 8-13 ms per 4 MiB of float8 on the 2-core VM.
        indices = scratch.indices(src.size).reshape(src.shape)
        np.copyto(indices, src)
        np.take(_float8_table(source, target), indices, out=out, mode="wrap")

    return kernel


# What torch widens the NaN of the fnuz and e8m0 float8 types to: a signalling NaN
# (c10's fp8_fnuz/e8m0 conversions build it from bits), as the tests check against torch.
_FLOAT8_NAN_F32 = 0x7F800001
