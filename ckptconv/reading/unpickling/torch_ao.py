"""torch.ao's quantized tensors, dequantized as torch's own ``Tensor.dequantize()`` computes them (numpy only).

``_rebuild_qtensor`` in :mod:`ckptconv.reading.unpickling.rebuild` reads such a tensor as a float32 tensor whose
bytes these functions compute when a writer reads them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["per_channel", "per_tensor"]


def per_tensor(scale: float, zero_point: int, arrays: Mapping[str, Any]) -> Any:
    """torch's ``dequantize()`` of a per-tensor affine tensor: ``(float(q) - float(zero_point)) * float(scale)``,
    in float32 (checked against torch for qint8, quint8 and qint32)."""
    import numpy as np

    values = arrays["values"].astype(np.float32)
    return (values - np.float32(zero_point)) * np.float32(scale)


def per_channel(axis: int, arrays: Mapping[str, Any]) -> Any:
    """torch's ``dequantize()`` of a per-channel affine tensor: ``(q - zero_point[c]) * scale[c]`` in float64 (its
    scales are float64), rounded once to float32."""
    import numpy as np

    values = arrays["values"]
    shape = [1] * values.ndim
    shape[axis] = -1
    scales = arrays["scales"].astype(np.float64).reshape(shape)
    zero_points = arrays["zero_points"].astype(np.float64).reshape(shape)
    return ((values.astype(np.float64) - zero_points) * scales).astype(np.float32)
