"""Widening casts: float16 and bfloat16 up to float32 and float64, exact (only NaN encodings need care)."""

from __future__ import annotations

import numpy as np

from ckptconv.transforms.casts.buffers import Array, _Scratch


def _k_bf16_f32(src: Array, out: Array, scratch: _Scratch) -> None:
    """Widen bfloat16: its bits are the high half of the float32 (NaNs kept as they are)."""
    wide = out.view(np.uint32)
    np.copyto(wide, src)
    np.left_shift(wide, 16, out=wide)


def _k_bf16_f64(src: Array, out: Array, scratch: _Scratch) -> None:
    # Through float32, so that signalling NaNs are quieted by the hardware widening, as in torch.
    f32 = scratch.mid(src.size)
    _k_bf16_f32(src, f32, scratch)
    np.copyto(out, f32)


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


def _k_f16_f64(src: Array, out: Array, scratch: _Scratch) -> None:
    f32 = scratch.mid(src.size)
    _k_f16_f32(src, f32, scratch)
    np.copyto(out, f32)
