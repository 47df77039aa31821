"""fp8 block-scaled weights: ``quant_method: "fp8"`` with ``weight_block_size`` (DeepSeek-V3's layout).

A quantized weight ``X.weight`` (float8_e4m3fn, shape ``(..., rows, cols)``) comes with
``X.weight_scale_inv`` (float32, or bfloat16, or float8_e8m0fnu when ``scale_fmt`` is
``ue8m0``) of shape ``(..., ceil(rows / bm), ceil(cols / bn))`` for ``weight_block_size: [bm, bn]``;
scale ``[i, j]`` multiplies the block of rows ``i*bm ...`` and columns ``j*bn ...``, the last block
of a ragged edge included (cut short). Experts stored whole as ``experts.gate_up_proj`` pair with
``experts.gate_up_proj_scale_inv`` the same way. Without ``weight_block_size`` the scale is one
value for the whole tensor.

Order of operations, as transformers' ``Fp8Dequantize._dequantize_one``
(``transformers/integrations/finegrained_fp8.py``) and DeepSeek-V3's ``weight_dequant`` kernel
compute it:

1. ``q = weight.to(float32)`` (exact);
2. ``s = weight_scale_inv.to(float32)`` (exact for float32, bfloat16, float16, e8m0);
3. ``p = q * s`` in float32, each scale broadcast over its block: one rounding;
4. ``p.to(target)``: one rounding, to nearest even, as ``Tensor.to``.

transformers derives the block size from the scale grid (``rows // scale_rows``), which is right
for whole blocks only (for a 200 x 300 weight and a 2 x 3 grid it would take 100-blocks); here the
declared ``weight_block_size`` places the blocks, as the checkpoint's quantizer did, with the same
arithmetic. ``activation_scale``/``input_scale`` tensors (static activation scales) are dropped.

The tensors decide: a weight with a ``_scale_inv`` beside it is dequantized by it even when its module is
named in ``modules_to_not_convert`` (the list says what the quantizer meant to skip; the scale says what it
did), and a float8 weight with no scale is refused wherever it is (a plain cast would write its raw codes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from ckptconv.dtypes import DType
from ckptconv.quantization._exact import Array, cast, widen
from ckptconv.quantization.schemes import Scheme, refuse
from ckptconv.reading.sources import computed_tensor
from ckptconv.transforms.casts import storage_dtype
from ckptconv.values.tensor import TensorRef

__all__ = ["plan"]

_SCHEME = "fp8 block-scaled"
_WEIGHT_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2"})
_SCALE_DTYPES = frozenset({"float32", "bfloat16", "float16", "float8_e8m0fnu"})
_ACTIVATION_SCALES = frozenset({"activation_scale", "input_scale"})

#: The most gather indices held at once (8 bytes each): 4 MiB, a few rows of the widest weights.
_INDEX_BUFFER_ELEMENTS = 1 << 19


def dequantize_array(
    weight: Array, weight_dtype: str, scale: Array, scale_dtype: str, block: tuple[int, int] | None, target: str
) -> Array:
    """The dequantized weight, in ``target``'s storage representation (steps 1-4 of the module docstring).

    Each output element depends only on its float8 byte and its block's scale, so each block is
    dequantized through a 256-entry table: the 256 float8 values times the block's scale (step 3),
    rounded to the target (step 4), the same arithmetic on each value as element by element, then
    gathered by the weight's bytes, a band of ``bm`` rows at a time.
    """
    codes = np.ascontiguousarray(weight).view(np.uint8)
    values = widen(np.arange(256, dtype=np.uint8), weight_dtype)  # every float8 value, exactly
    s = widen(scale, scale_dtype)
    rows, cols = codes.shape[-2:]
    bm, bn = block if block is not None else (rows, cols)
    grid = s.reshape(-1, -(-rows // bm), -(-cols // bn)) if block is not None else s.reshape(1, 1, 1)
    storage = storage_dtype(target)
    out = np.empty(codes.shape, storage)
    flat_codes = codes.reshape(-1, rows, cols)
    flat_out = out.reshape(-1, rows, cols)
    # Which block each column is in, as an offset into the band's tables.
    column_table = (np.arange(cols) // bn).astype(np.intp) * 256
    # The gather's indices, a few rows at a time into one buffer: numpy's take converts any other
    # index type to intp in a new array, and checks bounds through a copy of its output unless told
    # how to treat indices out of range ("wrap"; none is: codes < 256 and column offsets < the tables).
    # 45 ms against 150-170 ms for a 4096 x 11008 weight on the 2-core VM.
    step = max(1, min(bm, _INDEX_BUFFER_ELEMENTS // max(cols, 1)))
    indices = np.empty((step, cols), np.intp)
    with np.errstate(all="ignore"):
        for index in range(flat_codes.shape[0]):
            scales = grid[index if grid.shape[0] > 1 else 0]
            for band in range(scales.shape[0]):
                products = values[None, :] * scales[band][:, None]  # (column blocks, 256), float32: one rounding
                tables = products.reshape(-1) if target == "float32" else cast(products.reshape(-1), "float32", target)
                tables = np.ascontiguousarray(tables).view(storage)
                for start in range(band * bm, min((band + 1) * bm, rows), step):
                    stop = min(start + step, (band + 1) * bm, rows)
                    part = indices[: stop - start]
                    np.add(flat_codes[index, start:stop], column_table, out=part)
                    np.take(tables, part, out=flat_out[index, start:stop], mode="wrap")
    return out


def _dequantized(
    key: str, weight: TensorRef, scale: TensorRef, block: tuple[int, int] | None, target: DType
) -> TensorRef:
    if weight.dtype.name not in _WEIGHT_DTYPES or len(weight.shape) < 2:
        raise refuse(
            _SCHEME, key, f"is {weight.dtype.name}{list(weight.shape)}; ckptconv dequantizes float8 matrices only"
        )
    if scale.dtype.name not in _SCALE_DTYPES:
        raise refuse(
            _SCHEME, key + "_scale_inv", f"is {scale.dtype.name}; ckptconv reads float32, bfloat16 or e8m0 scales"
        )
    rows, cols = weight.shape[-2:]
    if block is None:
        if scale.numel != 1:
            raise refuse(_SCHEME, key + "_scale_inv", f"has {scale.numel} values but no weight_block_size is declared")
    else:
        grid = (*weight.shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))
        if scale.shape != grid:
            raise refuse(
                _SCHEME,
                key + "_scale_inv",
                f"has shape {list(scale.shape)}; {list(grid)} scales a {list(weight.shape)} "
                f"weight in {block[0]} x {block[1]} blocks",
            )
    names = (weight.dtype.name, scale.dtype.name, target.name)

    def compute(arrays: Mapping[str, Array]) -> Array:
        return dequantize_array(arrays["weight"], names[0], arrays["scale"], names[1], block, names[2])

    return computed_tensor(key, compute, {"weight": weight, "scale": scale}, target, weight.shape)


def plan(tensors: Mapping[str, TensorRef], scheme: Scheme, target: DType) -> dict[str, TensorRef]:
    """The state dict with every fp8 weight dequantized to ``target`` and its scales gone."""
    block = scheme.declared.block
    scales: set[str] = set()
    result: dict[str, TensorRef] = {}
    for key, ref in tensors.items():
        leaf = key.rpartition(".")[2]
        if key + "_scale_inv" in tensors:
            result[key] = _dequantized(key, ref, tensors[key + "_scale_inv"], block, target)
            scales.add(key + "_scale_inv")
        elif leaf in _ACTIVATION_SCALES or key.endswith("_scale_inv"):
            continue  # a scale: consumed above, checked below
        elif ref.dtype.name.startswith("float8"):
            raise refuse(_SCHEME, key, f"is {ref.dtype.name} with no {key}_scale_inv beside it")
        else:
            result[key] = ref
    for key in tensors:
        if key.endswith("_scale_inv") and key not in scales:
            raise refuse(_SCHEME, key, f"scales no tensor: there is no {key[: -len('_scale_inv')]!r}")
    return result
