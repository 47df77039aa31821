"""optimum-quanto weights: ``X.weight._data`` with ``X.weight._scale`` (qfloat8, qint8).

A frozen quanto module saves its ``WeightQBytesTensor`` as two tensors: ``X.weight._data``
(float8_e4m3fn, float8_e5m2 or int8) and ``X.weight._scale`` (float32, float16 or bfloat16, one value
per output channel: shape ``(rows, 1)``, or any shape that broadcasts to the data's), beside
``X.input_scale`` / ``X.output_scale`` (activation scales, dropped with the dequantized weight).

Order of operations, as optimum-quanto 0.2's ``QBytesDequantizer.forward`` (what
``WeightQBytesTensor.dequantize()`` runs) computes it, all in the scale's dtype ``S``:

1. qfloat8: ``t._scale * t._data.to(S)``; qint8: ``t._scale * t._data`` (torch promotes the int8 data to
   ``S``; int8 values are exact in every ``S``);
2. one product, rounded to ``S`` (bfloat16 / float16 products are one float32 product rounded once);
3. ``.to(target)``: one more rounding.

qint4 / qint2 (``X.weight._data._data`` packed uint8, with ``X.weight._shift``) are refused: quanto
groups them as ``(rows * cols / group_size, group_size)`` and keeps the weight's own shape in the module,
not in the state dict, so the tensors alone do not say how the groups go back into a matrix.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ckptconv.dtypes import DType
from ckptconv.quantization._exact import COMPUTE_DTYPES, Array, cast, rounded, widen
from ckptconv.quantization.schemes import Scheme, refuse
from ckptconv.reading.sources import computed_tensor
from ckptconv.values.tensor import TensorRef

__all__ = ["dequantize_array", "plan"]

_SCHEME = "optimum-quanto"
_DATA_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2", "int8"})
_ACTIVATION_SCALES = frozenset({"input_scale", "output_scale"})


def dequantize_array(data: Array, data_dtype: str, scale: Array, scale_dtype: str) -> Array:
    """The dequantized weight in the scale dtype's storage representation (steps 1-2)."""
    values = widen(data, data_dtype) if data_dtype != "int8" else np.asarray(data).astype(np.float32)
    with np.errstate(all="ignore"):
        product = rounded(widen(scale, scale_dtype) * values, scale_dtype)
    return product if scale_dtype == "float32" else cast(product, "float32", scale_dtype)


def _broadcasts(scale: tuple[int, ...], data: tuple[int, ...]) -> bool:
    return len(scale) <= len(data) and all(s in (1, d) for s, d in zip(reversed(scale), reversed(data)))


def _dequantized(name: str, data: TensorRef, scale: TensorRef, target: DType) -> TensorRef:
    if data.dtype.name not in _DATA_DTYPES:
        raise refuse(_SCHEME, name + "._data", f"is {data.dtype.name}; ckptconv dequantizes float8 or int8 data")
    if scale.dtype.name not in COMPUTE_DTYPES:
        raise refuse(_SCHEME, name + "._scale", f"is {scale.dtype.name}, not a float32, float16 or bfloat16 scale")
    if not _broadcasts(scale.shape, data.shape):
        raise refuse(_SCHEME, name + "._scale", f"has shape {list(scale.shape)}; it does not scale {list(data.shape)}")
    names = (data.dtype.name, scale.dtype.name, target.name)

    def compute(arrays: Mapping[str, Array]) -> Array:
        product = dequantize_array(arrays["data"], names[0], arrays["scale"], names[1])  # the data's shape
        return product if names[1] == names[2] else cast(product, names[1], names[2])

    return computed_tensor(name, compute, {"data": data, "scale": scale}, target, data.shape)


def plan(tensors: Mapping[str, TensorRef], scheme: Scheme, target: DType) -> dict[str, TensorRef]:
    """The state dict with every quanto ``_data``/``_scale`` pair dequantized to ``target``."""
    del scheme  # the pairs show the whole layout
    weights = {key[: -len("._data")] for key in tensors if key.endswith("._data") and not key.endswith("._data._data")}
    modules = {name.rpartition(".")[0] for name in weights}
    result: dict[str, TensorRef] = {}
    for key, ref in tensors.items():
        base, _, leaf = key.rpartition(".")
        if key.endswith("._data._data") or leaf == "_shift":
            raise refuse(
                _SCHEME, key, "is a packed qint4/qint2 tensor, whose weight shape the checkpoint does not hold "
                "(quanto keeps it in the module); load it with optimum-quanto and save it dequantized first",
            )  # fmt: skip
        if leaf == "_data" and base in weights:
            if base in tensors:
                raise refuse(_SCHEME, key, f"and {base!r} both exist; the dequantized weight would replace it")
            if base + "._scale" not in tensors:
                raise refuse(_SCHEME, key, f"has no {base}._scale beside it")
            result[base] = _dequantized(base, ref, tensors[base + "._scale"], target)
        elif leaf == "_scale" and base:
            if base not in weights:
                raise refuse(_SCHEME, key, f"scales no tensor: there is no {base}._data")
        elif leaf in _ACTIVATION_SCALES and base in modules:
            continue  # the activation scales of a dequantized module
        else:
            result[key] = ref
    return result
