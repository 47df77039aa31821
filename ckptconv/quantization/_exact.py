"""Exact float arithmetic on storage representations: the one place that uses ckptconv's casts.

torch's CPU kernels compute a bfloat16 or float16 product (or difference) in float32 and round
the result once to 16 bits; :func:`rounded` does that rounding, :func:`narrow` and :func:`cast`
are the float32 -> target and any-float -> target conversions of ``Tensor.to``, bit-exact
(:mod:`ckptconv.transforms.casts`). Every value here travels as float32 between steps: float16, bfloat16
and float8 widen to float32 exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckptconv.transforms.casts import cast_array

__all__ = ["COMPUTE_DTYPES", "Array", "cast", "narrow", "rounded", "widen"]

Array = Any  # numpy arrays (ckptconv.transforms.casts.Array); kept loose so mypy needs no numpy stubs per shape

#: The dtypes a reference implementation computes in here: those a float32 holds exactly.
COMPUTE_DTYPES = frozenset({"float32", "float16", "bfloat16"})

_FLOAT_SOURCES = frozenset(
    {
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    }
)


def widen(values: Array, source: str) -> Array:
    """``values`` (``source``'s storage representation, or integers) as float32, exactly."""
    if source in _FLOAT_SOURCES:
        return np.asarray(cast_array(np.asarray(values), source, "float32")).view(np.float32)
    array = np.asarray(values)
    if array.dtype.kind not in "iub" or array.dtype.itemsize > 2:
        raise TypeError(f"cannot widen {source} ({array.dtype}) to float32 exactly")
    return array.astype(np.float32)


def narrow(values: Array, target: str) -> Array:
    """float32 ``values`` rounded to ``target``'s storage representation, as ``Tensor.to`` rounds."""
    return cast_array(np.ascontiguousarray(values, dtype=np.float32), "float32", target)


def rounded(values: Array, dtype: str) -> Array:
    """float32 ``values`` rounded to ``dtype`` (a :data:`COMPUTE_DTYPES` member), kept as float32."""
    if dtype == "float32":
        return values
    return widen(narrow(values, dtype), dtype)


def cast(values: Array, source: str, target: str) -> Array:
    """``Tensor.to(target)`` on ``source`` storage values, bit-exact."""
    return cast_array(np.ascontiguousarray(values), source, target)
