"""MXFP4 experts: ``quant_method: "mxfp4"`` (gpt-oss's layout).

Each expert weight ``X`` is stored as ``X_blocks`` (uint8, shape ``(E, N, G, 16)``: 32 float4
e2m1 values a block, two a byte, the low nibble first) and ``X_scales`` (uint8, shape
``(E, N, G)``: one e8m0 exponent a block, ``2 ** (byte - 127)``). The unquantized ``X`` has
shape ``(E, G * 32, N)``: the blocks are unpacked along ``G`` and the last two axes swapped.

Order of operations, as transformers' ``convert_moe_packed_tensors``
(``transformers/integrations/mxfp4.py``, which ``Mxfp4Dequantize`` runs) computes it:

1. ``exp = scales.to(int32) - 127``;
2. each nibble looks up ``FP4_VALUES`` (``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and their negatives) in the
   target dtype, exactly: low nibble at even positions, high nibble at odd ones;
3. ``torch.ldexp(values, exp, out=values)``: on the CPU a true float32 ldexp (no power of two is
   formed, so byte 255 takes ``0.5`` to ``2 ** 127`` and ``0`` stays ``0``; measured against torch
   2.13 for every scale byte), one rounding in float32 (subnormals only), then stored in the target
   dtype (one rounding, as ``Tensor.to``). numpy's ``ldexp`` on float32 is that ldexp;
4. ``reshape(E, N, G * 32).transpose(1, 2).contiguous()``.

The tensors decide: a blocks/scales pair is dequantized even when its module is named in
``modules_to_not_convert``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ckptconv.dtypes import DType
from ckptconv.quantization._exact import Array, narrow
from ckptconv.quantization.schemes import Scheme, refuse
from ckptconv.reading.sources import computed_tensor
from ckptconv.values.tensor import TensorRef

__all__ = ["FP4_VALUES", "dequantize_array", "plan"]

_SCHEME = "mxfp4"

#: float4 e2m1 by nibble: the sign is the nibble's top bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_array(blocks: Array, scales: Array, target: str) -> Array:
    """The dequantized weight in ``target``'s storage representation (steps 1-4 of the module docstring)."""
    *prefix, groups, width = blocks.shape
    lut = np.array(FP4_VALUES, dtype=np.float32)
    packed = blocks.reshape(-1, width)
    values = np.empty((packed.shape[0], width * 2), dtype=np.float32)
    values[:, 0::2] = lut[packed & 0x0F]
    values[:, 1::2] = lut[packed >> 4]
    exponents = scales.reshape(-1, 1).astype(np.int32) - 127
    with np.errstate(all="ignore"):
        np.ldexp(values, exponents, out=values)
    out = values if target == "float32" else narrow(values, target)
    out = out.reshape(*prefix, groups * width * 2)
    return np.ascontiguousarray(np.swapaxes(out, 1, 2))


def _dequantized(key: str, blocks: TensorRef, scales: TensorRef, target: DType) -> TensorRef:
    if blocks.dtype.name != "uint8" or scales.dtype.name != "uint8" or len(blocks.shape) < 4:
        raise refuse(
            _SCHEME,
            key + "_blocks",
            f"is {blocks.dtype.name}{list(blocks.shape)} with {scales.dtype.name} scales; "
            "ckptconv dequantizes uint8 blocks (experts, N, groups, 16) with uint8 e8m0 scales",
        )
    if scales.shape != blocks.shape[:-1]:
        raise refuse(_SCHEME, key + "_scales", f"has shape {list(scales.shape)}, not {list(blocks.shape[:-1])}")
    *prefix, groups, width = blocks.shape
    shape = [*prefix, groups * width * 2]
    shape[1], shape[2] = shape[2], shape[1]
    name = target.name

    def compute(arrays: Mapping[str, Array]) -> Array:
        return dequantize_array(arrays["blocks"], arrays["scales"], name)

    return computed_tensor(key, compute, {"blocks": blocks, "scales": scales}, target, tuple(shape))


def plan(tensors: Mapping[str, TensorRef], scheme: Scheme, target: DType) -> dict[str, TensorRef]:
    """The state dict with every ``X_blocks``/``X_scales`` pair dequantized to ``X`` in ``target``."""
    result: dict[str, TensorRef] = {}
    for key, ref in tensors.items():
        if key.endswith("_blocks") and key[: -len("_blocks")] + "_scales" in tensors:
            name = key[: -len("_blocks")]
            if name in tensors:
                raise refuse(_SCHEME, key, f"and {name!r} both exist; the dequantized weight would replace it")
            result[name] = _dequantized(name, ref, tensors[name + "_scales"], target)
        elif key.endswith("_scales") and key[: -len("_scales")] + "_blocks" in tensors:
            continue
        elif key.endswith(("_blocks", "_scales")):
            raise refuse(_SCHEME, key, "has no blocks/scales partner beside it")
        else:
            result[key] = ref
    return result
