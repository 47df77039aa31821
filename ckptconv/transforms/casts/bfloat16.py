"""Casts to bfloat16, bit-exact with torch.

The rounding and NaN rules are in :mod:`ckptconv.transforms.casts`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckptconv.transforms.casts import ml_support
from ckptconv.transforms.casts.buffers import Array, _nan_positions, _Scratch
from ckptconv.transforms.casts.widening import _k_f16_f32

# What torch's bulk path writes for a NaN cast to bfloat16, per source (see
# the module docstring).
_BF16_NAN_VECTOR = 0xFFFF

_BF16_NAN_SCALAR = 0x7FC0


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
        bfloat16 = ml_support._ml_bfloat16() if ml_support.faster("bfloat16") else None
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
