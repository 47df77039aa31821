"""Dequantizing a state dict: each declared scheme's planner, chosen by the scheme.

The result is a new state dict with the unquantized model's names, in the input's order: each
quantized weight becomes one lazy :class:`~ckptconv.values.tensor.TensorRef` in the target dtype whose
bytes are computed when a writer reads them (:class:`ckptconv.reading.sources.Computed`); scales, zero
points, global scales, shapes and activation scales are gone; every other tensor passes
through untouched (a caller's ``--dtype`` cast applies to those separately).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ckptconv.dtypes import DType
from ckptconv.errors import TransformError
from ckptconv.quantization import compressed_tensors, fp8_block, mxfp4, quanto
from ckptconv.quantization.evidence import companions
from ckptconv.quantization.schemes import Scheme, refuse
from ckptconv.values.tensor import TensorRef

__all__ = ["TARGETS", "dequantize"]

#: The dtypes a dequantized weight can be written in.
TARGETS = frozenset({"float32", "float16", "bfloat16"})

_Planner = Callable[[Mapping[str, TensorRef], Scheme, DType], dict[str, TensorRef]]
_PLANNERS: dict[str, _Planner] = {
    "fp8": fp8_block.plan,
    "compressed-tensors": compressed_tensors.plan,
    "mxfp4": mxfp4.plan,
    "quanto": quanto.plan,
}


def dequantize(tensors: Mapping[str, TensorRef], scheme: Scheme, target: DType) -> dict[str, TensorRef]:
    """``tensors`` with every weight quantized under ``scheme`` dequantized, exactly, to ``target``.

    Args:
        tensors: the checkpoint's state dict, by name.
        scheme: what :func:`ckptconv.quantization.detect` found.
        target: float32, float16 or bfloat16.

    Returns:
        A new state dict; ``tensors`` is not changed.

    Raises:
        TransformError: ``target`` is not one of :data:`TARGETS`.
        UnsupportedQuantizationError: a tensor does not have the layout the scheme defines, or a tensor of a
            quantized weight (a scale, a packed weight ...) would remain beside the dequantized ones.

    Example:
        >>> sd = dequantize(state, detect(config, None, state), dtype_by_name("bfloat16"))  # doctest: +SKIP
    """
    if target.name not in TARGETS:
        raise TransformError(f"ckptconv dequantizes to float32, float16 or bfloat16, not {target.name}")
    result = _PLANNERS[scheme.method](tensors, scheme, target)
    left = companions(result)
    if left:  # every planner consumes what it dequantizes: a companion left is a weight it did not
        first = min(left, key=lambda companion: companion.key)
        raise refuse(str(scheme), first.key, f"({first.what}) would stay beside the dequantized weights")
    return result
