"""The way back: bf16/fp16/fp32 weights quantized to fp8 blocks, DeepSeek-V3's layout (``--quantize fp8-block``).

Each quantized weight ``X.weight`` becomes float8_e4m3fn with a float32 ``X.weight_scale_inv`` per
128 x 128 block, and the model's ``config.json`` gets ``quantization_config = {"quant_method": "fp8",
"fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "modules_to_not_convert":
[...]}``, which transformers' fine-grained fp8 integration loads.

Order of operations, as transformers' reference quantizer ``Fp8Quantize._quantize_one``
(``transformers/integrations/finegrained_fp8.py``) computes it, per block:

1. ``v = weight.to(float32)`` (exact);
2. ``m = max(|v|)`` over the block; ``s = (1 / m) * 448`` in float32 where ``m > 0``, else ``s = 1``
   (torch computes a number divided by a tensor as the tensor's reciprocal times it: two roundings);
3. ``weight_scale_inv = (1 / s)`` in float32 (one rounding);
4. ``q = clamp(v * s, -448, 448)`` (the product in float32, one rounding) ``.to(float8_e4m3fn)``:
   round to nearest even, as c10's ``fp8e4m3fn_from_fp32_value`` does it.

Which weights: floating-point tensors named ``*.weight`` of two or more dimensions whose last two
are multiples of the block (as the reference, which leaves others as they are), except embeddings,
``lm_head``, norms and whatever ``--keep-dtype`` matches, the rules casts keep. Every module left out
is named in ``modules_to_not_convert``, so that a loader keeps its plain linear layer.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ckptconv._text import plural
from ckptconv.dtypes import DType, dtype_by_name
from ckptconv.quantization._exact import Array, widen
from ckptconv.reading.sources import computed_tensor
from ckptconv.values.tensor import TensorRef

__all__ = ["BLOCK", "FP8_MAX", "quantization_config", "quantize", "quantize_array", "quantize_state", "to_e4m3fn"]

#: DeepSeek-V3's block, and transformers' default ``weight_block_size``.
BLOCK = (128, 128)
#: The largest finite float8_e4m3fn value.
FP8_MAX = 448.0
_F32 = np.dtype(np.float32)

# Keys that keep their dtype when a checkpoint is quantized: what a cast keeps too (integers, by dtype),
# plus the modules fp8 checkpoints leave in high precision (embeddings, the output head, norms).
_KEPT = re.compile(r"(^|\.)(embed\w*|wte|wpe|lm_head|output_layer|word_embeddings|\w*norm\w*|\w*ln\w*)(\.|$)")


def to_e4m3fn(values: Array) -> Array:
    """float32 to float8_e4m3fn bits (uint8), bit for bit as torch's CPU ``Tensor.to(torch.float8_e4m3fn)``:
    nearest even (c10's ``fp8e4m3fn_from_fp32_value``, subnormals through a float32 add of 2^14), magnitudes
    from 464 up and infinities saturated to 448, NaN to 0x7F, each with its sign."""
    bits = np.ascontiguousarray(values, dtype=_F32).view(np.uint32)
    sign = bits & np.uint32(0x80000000)
    magnitude = bits ^ sign
    out = np.empty(bits.shape, np.uint8)
    big = magnitude >= np.uint32(0x43E80000)  # 464: rounds past 448
    nan = magnitude > np.uint32(0x7F800000)
    small = magnitude < np.uint32(121 << 23)
    denorm_mask = np.uint32(141 << 23)
    # Subnormal (and zero) results: the float32 sum with 2^14 leaves the rounded value in the low bits.
    with np.errstate(invalid="ignore"):
        shifted = (magnitude.view(_F32) + denorm_mask.view(_F32)).view(np.uint32) - denorm_mask
    # Normal results: rebias the exponent, round to nearest even on the 20 dropped mantissa bits.
    odd = (magnitude >> np.uint32(20)) & np.uint32(1)
    normal = (magnitude + np.uint32(((7 - 127) << 23) & 0xFFFFFFFF) + np.uint32(0x7FFFF) + odd) >> np.uint32(20)
    out[...] = np.where(small, shifted, normal).astype(np.uint8)
    out[big] = 0x7E
    out[nan] = 0x7F
    out |= (sign >> np.uint32(24)).astype(np.uint8)
    return out


def _tiles(values: Array, source: str, block: tuple[int, int]) -> Array:
    """The weight in float32 as ``(..., row blocks, bm, column blocks, bn)`` (step 1)."""
    v = widen(values, source).astype(_F32, copy=False)
    *lead, rows, cols = v.shape
    bm, bn = block
    return v.reshape(*lead, rows // bm, bm, cols // bn, bn)


def _scales(tiles: Array) -> tuple[Array, Array]:
    """``(s, weight_scale_inv)`` per block (steps 2 and 3)."""
    max_abs = np.abs(tiles).max(axis=(-3, -1))
    safe = np.where(max_abs > 0, max_abs, np.float32(1))
    # ``448 / t`` of a tensor is ``t.reciprocal() * 448`` in torch (Tensor.__rtruediv__): two roundings.
    scales = np.where(max_abs > 0, (np.float32(1) / safe) * np.float32(FP8_MAX), np.float32(1)).astype(_F32)
    return scales, (np.float32(1) / scales).astype(_F32)


def quantize_array(values: Array, source: str, block: tuple[int, int] = BLOCK) -> tuple[Array, Array]:
    """``(float8_e4m3fn bits, float32 weight_scale_inv)`` of a weight whose last two dims are whole blocks."""
    tiles = _tiles(values, source, block)
    scales, inverse = _scales(tiles)
    clamped = np.clip(tiles * scales[..., :, None, :, None], np.float32(-FP8_MAX), np.float32(FP8_MAX))
    return to_e4m3fn(clamped).reshape(values.shape), inverse


def _quantized_weight(source: str, block: tuple[int, int], arrays: Mapping[str, Array]) -> Array:
    return quantize_array(arrays["weight"], source, block)[0]


def _inverse_scales(source: str, block: tuple[int, int], arrays: Mapping[str, Array]) -> Array:
    """The scales alone: one max-abs pass over the weight, not a second quantization of it."""
    return _scales(_tiles(arrays["weight"], source, block))[1]


def _quantizable(key: str, ref: TensorRef, keep: Sequence[re.Pattern[str]], block: tuple[int, int]) -> bool:
    return (
        key.endswith(".weight")
        and ref.out_dtype.name in ("float32", "bfloat16", "float16")
        and len(ref.shape) >= 2
        and ref.shape[-2] % block[0] == 0
        and ref.shape[-1] % block[1] == 0
        and not _KEPT.search(key.removesuffix(".weight"))
        and not any(pattern.search(key) for pattern in keep)
    )


def quantize(
    tensors: Mapping[str, TensorRef], *, keep: Sequence[re.Pattern[str]] = (), block: tuple[int, int] = BLOCK
) -> tuple[dict[str, TensorRef], list[str]]:
    """``tensors`` with each quantizable weight as fp8 blocks and its ``weight_scale_inv`` beside it.

    Returns:
        The new state dict, and the modules whose weights were left as they were (for
        ``modules_to_not_convert``).
    """
    fp8, f32 = _dtype("float8_e4m3fn"), _dtype("float32")
    out: dict[str, TensorRef] = {}
    left: list[str] = []
    for key, ref in tensors.items():
        if not _quantizable(key, ref, keep, block):
            out[key] = ref
            if key.endswith(".weight") and len(ref.shape) >= 2 and ref.out_dtype.is_floating_point:
                left.append(key.removesuffix(".weight"))
            continue
        source = ref.out_dtype.name
        grid = (*ref.shape[:-2], ref.shape[-2] // block[0], ref.shape[-1] // block[1])
        out[key] = computed_tensor(
            key, functools.partial(_quantized_weight, source, block), {"weight": ref}, fp8, ref.shape
        )
        scale_key = key.removesuffix("weight") + "weight_scale_inv"
        out[scale_key] = computed_tensor(
            scale_key, functools.partial(_inverse_scales, source, block), {"weight": ref}, f32, grid
        )
    return out, left


def quantize_state(
    state: Mapping[str, TensorRef], keep: Sequence[re.Pattern[str]]
) -> tuple[dict[str, TensorRef], dict[str, Any], str]:
    """:func:`quantize`, the ``quantization_config`` its output declares, and the note that says what it did."""
    quantized, left_out = quantize(state, keep=keep)
    count = len(quantized) - len(state)  # one weight_scale_inv per quantized weight
    note = (
        f"quantized {plural(count, 'weight')} to float8_e4m3fn in 128x128 blocks, each with a float32 "
        f"weight_scale_inv; left {plural(len(left_out), 'module')} unquantized (modules_to_not_convert)"
    )
    return quantized, quantization_config(left_out), note


def quantization_config(left_out: Sequence[str], block: tuple[int, int] = BLOCK) -> dict[str, Any]:
    """The ``quantization_config`` a model folder of :func:`quantize`'s output declares."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": sorted(set(left_out)) or None,
    }


def _dtype(name: str) -> DType:
    dtype = dtype_by_name(name)
    if dtype is None:  # pragma: no cover - both are in ckptconv's dtype table
        raise RuntimeError(f"ckptconv's dtype table has no {name}")
    return dtype
