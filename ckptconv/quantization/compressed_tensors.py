"""compressed-tensors checkpoints: ``quant_method: "compressed-tensors"``, one ``format`` per config group.

Each config group names its ``targets`` (module names, ``re:`` regexes, or ``Linear`` for all),
its ``weights`` quantization args and its ``format`` (else the config's ``format``); a module
takes the first group that targets it, as compressed-tensors' model-free
``CompressedTensorsDequantizer`` does, and modules matching ``ignore`` are left as they are.
Formats and their tensors (per module ``X``):

* ``float-quantized`` / ``int-quantized`` / ``naive-quantized``: ``X.weight`` (float8 or int8),
  ``X.weight_scale``, ``X.weight_zero_point`` when asymmetric;
* ``pack-quantized``: ``X.weight_packed`` (int32: ``num_bits``-bit values, offset by
  ``2 ** (num_bits - 1)``, packed densely along each row, low bits first), ``X.weight_scale``,
  ``X.weight_shape``, and ``X.weight_zero_point`` packed the same way down its columns (dim 0)
  for group/channel;
* ``nvfp4-pack-quantized``: ``X.weight_packed`` (uint8, two float4 e2m1 a byte, low nibble
  first), ``X.weight_scale`` (float8_e4m3fn, one per 16 values), ``X.weight_global_scale``.

Strategies place the scale (and zero point): ``tensor`` (one value), ``channel`` (one per row),
``group``/``tensor_group`` (one per ``group_size`` columns of a row), ``block``
(``block_structure`` tiles, the ragged last ones cut short, as the compressor pads).

Order of operations, as compressed-tensors 0.20's ``decompress`` (``NaiveQuantizationCompressor``,
``PackedQuantizationCompressor``, ``NVFP4PackedCompressor``) calls ``forward.dequantize`` ->
``_dequantize``, all in the scale's dtype ``S`` (bfloat16 / float16 products are one float32
product rounded once to ``S``, as torch's CPU kernels compute them):

1. (pack) unpack the integers, subtract the offset; unpack the zero point the same way;
2. ``x = x_q.to(S)``; with a zero point ``x = x - zero_point.to(S)`` (rounded to ``S``);
3. ``x = x * scale`` (rounded to ``S``), the scale broadcast over its tensor/row/group/block;
4. the result is ``S``; ``.to(target)`` (``CompressedTensorsDequantizer``'s last step) rounds once more.

nvfp4: ``x_q`` is the unpacked float4 values as bfloat16 (exact), the scale ``weight_scale.to(bfloat16)``
(exact); ``scale = scale / global_scale`` promotes to float32 (the global scale is a float32 tensor
of one element): one float32 division; ``x = x_q.to(float32) * scale`` (one float32 rounding); then
``.to(bfloat16)`` (``_process_group``'s ``output_dtype``, the unpacked dtype), then ``.to(target)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from ckptconv.dtypes import DType
from ckptconv.quantization._exact import COMPUTE_DTYPES, Array, cast, rounded, widen
from ckptconv.quantization.declaration import CT_FORMATS, Names, WeightArgs
from ckptconv.quantization.schemes import Scheme, refuse
from ckptconv.reading.sources import computed_tensor
from ckptconv.values.tensor import TensorRef

__all__ = [
    "FORMATS",
    "dequantize_mxfp4",
    "dequantize_naive",
    "dequantize_nvfp4",
    "dequantize_packed",
    "plan",
    "unpack_int32",
]

_SCHEME = "compressed-tensors"

#: Formats dequantized here, with the tensor that holds each quantized weight.
FORMATS = CT_FORMATS
_PACKED = ("pack-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized")

# Every quantization parameter a compressed-tensors module can carry (QuantizationMetadata.all_qparam_names,
# and the packed weight and its shape), dropped from the output of every dequantized module.
_QPARAMS = frozenset(
    {f"{base}_{suffix}" for base in ("input", "weight", "output") for suffix in ("global_scale", "scale", "zero_point")}
    | {"weight_shape", "weight_packed", "weight_g_idx"}
)
_KV_CACHE_SCALES = frozenset({"k_scale", "v_scale"})
_ACTIVATION_QPARAMS = frozenset(
    {f"{base}_{suffix}" for base in ("input", "output") for suffix in ("global_scale", "scale", "zero_point")}
)
# The dtypes only a quantized weight is stored in: one without its weight_scale is refused, not cast.
_QUANTIZED_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "int8", "uint8"})
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


_Args = WeightArgs


def check_placement(found: tuple[int, ...], args: _Args, shape: tuple[int, ...], key: str) -> None:
    """Refuse a scale (or zero point) of shape ``found`` that ``args``'s strategy cannot place on ``shape``."""
    rows, cols = shape
    count = math.prod(found)
    if args.strategy == "tensor" and count != 1:
        raise refuse(_SCHEME, key, f"has {count} values for a tensor-wise scale")
    if args.strategy == "channel" and count != rows:
        raise refuse(_SCHEME, key, f"has shape {list(found)} for {rows} channels")
    if args.strategy in ("group", "tensor_group"):
        size = args.group_size or 0
        if size <= 0 or cols % size or found != (rows, cols // size):
            raise refuse(_SCHEME, key, f"has shape {list(found)} for {cols} columns in groups of {size}")
    if args.strategy == "block":
        if args.block is None:
            raise refuse(_SCHEME, key, "has a block strategy but no block_structure")
        bh, bw = args.block
        if found != (math.ceil(rows / bh), math.ceil(cols / bw)):
            raise refuse(_SCHEME, key, f"has shape {list(found)} for a {rows} x {cols} weight in {bh} x {bw} blocks")


def _expand(values: Array, args: _Args, shape: tuple[int, ...], key: str) -> Array:
    """Scale (or zero point) values repeated over the elements they apply to, shaped ``shape``."""
    check_placement(tuple(values.shape), args, shape, key)
    rows, cols = shape
    if args.strategy == "tensor":
        return values.reshape(1, 1)
    if args.strategy == "channel":
        return values.reshape(rows, 1)
    if args.strategy in ("group", "tensor_group"):
        return np.repeat(values, args.group_size or 1, axis=1)
    bh, bw = args.block or (1, 1)  # a block larger than the weight is the weight: repeat no further
    return np.repeat(np.repeat(values, min(bh, rows), axis=0)[:rows], min(bw, cols), axis=1)[:, :cols]


def _in_s(values: Array, dtype: str) -> Array:
    """``values.to(S)`` as float32: floats cast exactly as torch does, small integers exactly."""
    return widen(values, dtype) if dtype.startswith("float") or dtype == "bfloat16" else widen(values, "int")


def _apply(x: Array, scale: Array, zero_point: Array | None, s: str) -> Array:
    """Steps 2-3: ``(x - zero_point) * scale``, each result rounded to ``s``; float32 arrays in, float32 out."""
    with np.errstate(all="ignore"):
        if zero_point is not None:
            x = rounded(x - rounded(zero_point, s), s)
        return rounded(x * scale, s)


def dequantize_naive(
    weight: Array, weight_dtype: str, scale: Array, s: str, zero_point: Array | None, zp_dtype: str, args: _Args
) -> Array:
    """float-/int-/naive-quantized: the dequantized weight in ``s``'s storage representation."""
    x = rounded(_in_s(weight, weight_dtype), s)
    zp = None if zero_point is None else _expand(_in_s(zero_point, zp_dtype), args, weight.shape, "weight_zero_point")
    out = _apply(x, _expand(widen(scale, s), args, weight.shape, "weight_scale"), zp, s)
    return cast(out, "float32", s) if s != "float32" else out


def unpack_int32(packed: Array, num_bits: int, count: int) -> Array:
    """compressed-tensors' ``unpack_from_int32`` along rows: ``count`` signed values a row, as int16."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    rows = words.shape[0]
    starts = np.arange(count, dtype=np.int64) * num_bits
    first, shift = starts // 32, (starts % 32).astype(np.uint64)
    mask = np.uint64((1 << num_bits) - 1)
    out = np.empty((rows, count), np.int16)
    step = max(1, (1 << 20) // max(count, 1))  # rows a pass, so the uint64 temporaries stay small
    for r0 in range(0, rows, step):
        chunk = np.zeros((min(step, rows - r0), words.shape[1] + 1), np.uint64)
        chunk[:, :-1] = words[r0 : r0 + step]
        pairs = chunk[:, first] | (chunk[:, first + 1] << np.uint64(32))
        out[r0 : r0 + step] = ((pairs >> shift) & mask).astype(np.int16) - (1 << (num_bits - 1))
    return out


def dequantize_packed(
    packed: Array, shape: tuple[int, int], scale: Array, s: str, zero_point: Array | None, args: _Args
) -> Array:
    """pack-quantized: the dequantized weight in ``s``'s storage representation."""
    rows, cols = shape
    x = unpack_int32(packed, args.num_bits, cols).astype(np.float32)
    zp = None
    if zero_point is not None:
        if args.strategy in ("group", "channel"):
            groups = scale.shape[-1] if scale.ndim else 1
            zero_point = unpack_int32(np.ascontiguousarray(zero_point.T), args.num_bits, rows).T[:, :groups]
        zp = _expand(zero_point.astype(np.float32), args, shape, "weight_zero_point")
    out = _apply(rounded(x, s), _expand(widen(scale, s), args, shape, "weight_scale"), zp, s)
    return cast(out, "float32", s) if s != "float32" else out


def dequantize_nvfp4(packed: Array, scale: Array, global_scale: Array, args: _Args) -> Array:
    """nvfp4-pack-quantized: the dequantized weight as bfloat16 storage (uint16)."""
    rows, half = packed.shape
    values = np.empty((rows, half * 2), np.float32)
    values[:, 0::2] = _E2M1[packed & 0x0F]
    values[:, 1::2] = _E2M1[packed >> 4]
    local = widen(cast(scale, "float8_e4m3fn", "bfloat16"), "bfloat16")
    with np.errstate(all="ignore"):
        effective = local / global_scale.reshape(()).astype(np.float32)
        out = values * _expand(effective, args, values.shape, "weight_scale")
    return cast(out, "float32", "bfloat16")


def dequantize_mxfp4(packed: Array, scale: Array, args: _Args) -> Array:
    """mxfp4-pack-quantized: the dequantized weight as bfloat16 storage (uint16).

    ``MXFP4PackedCompressor.decompress``: the float4 values as bfloat16 (exact); the scale
    ``2.0 ** (byte - 127)`` in bfloat16 (exact: from ``2 ** -127``, a bfloat16 subnormal, to ``2 ** 127``;
    byte 255 is ``inf``); one bfloat16 product (a float32 product rounded once).
    """
    rows, half = packed.shape
    values = np.empty((rows, half * 2), np.float32)
    values[:, 0::2] = _E2M1[packed & 0x0F]
    values[:, 1::2] = _E2M1[packed >> 4]
    with np.errstate(all="ignore"):
        powers = rounded(np.ldexp(np.float32(1.0), scale.astype(np.int32) - 127).astype(np.float32), "bfloat16")
        out = rounded(values * _expand(powers, args, values.shape, "weight_scale"), "bfloat16")
    return cast(out, "float32", "bfloat16")


def _module_args(module: str, groups: tuple[_Args, ...]) -> _Args | None:
    """The first config group that targets ``module`` (``ignore`` aside: the tensors decide whether it is quantized)."""
    if module.endswith("norm"):
        return None
    for args in groups:
        if not args.targets or "Linear" in args.targets or (args.matcher is not None and args.matcher.match(module)):
            return args
    return None


def _ref(tensors: Mapping[str, TensorRef], key: str) -> TensorRef:
    if key not in tensors:
        raise refuse(_SCHEME, key, "is missing; the config declares its module quantized")
    return tensors[key]


def _compute_dtype(scale: TensorRef, key: str) -> str:
    if scale.dtype.name not in COMPUTE_DTYPES:
        raise refuse(
            _SCHEME, key, f"is {scale.dtype.name}; ckptconv dequantizes with float32, float16 or bfloat16 scales"
        )
    return scale.dtype.name


def _plan_module(module: str, tensors: Mapping[str, TensorRef], args: _Args, target: DType) -> TensorRef:
    prefix = f"{module}." if module else ""
    scale = _ref(tensors, prefix + "weight_scale")
    zp_key = prefix + "weight_zero_point"
    zero_point = tensors.get(zp_key) if not args.symmetric else None
    inputs: dict[str, TensorRef] = {"scale": scale}
    if zero_point is not None:
        inputs["zero_point"] = zero_point
    out = target.name
    shape: tuple[int, ...]
    if args.format == "mxfp4-pack-quantized":
        packed = _ref(tensors, prefix + "weight_packed")
        if packed.dtype.name != "uint8" or len(packed.shape) != 2 or scale.dtype.name != "uint8":
            raise refuse(_SCHEME, prefix + "weight_packed", "is not uint8 [rows, cols / 2] with uint8 e8m0 scales")
        if prefix + "weight_global_scale" in tensors:
            raise refuse(_SCHEME, prefix + "weight_global_scale", "is an nvfp4 global scale; its group declares mxfp4")
        if zp_key in tensors:
            raise refuse(_SCHEME, zp_key, "is an mxfp4 zero point, which ckptconv does not dequantize")
        shape = (packed.shape[0], packed.shape[1] * 2)
        inputs["packed"] = packed

        def compute(a: Mapping[str, Array]) -> Array:
            return cast(dequantize_mxfp4(a["packed"], a["scale"], args), "bfloat16", out)

    elif args.format == "nvfp4-pack-quantized":
        packed = _ref(tensors, prefix + "weight_packed")
        gs = _ref(tensors, prefix + "weight_global_scale")
        if packed.dtype.name != "uint8" or len(packed.shape) != 2 or scale.dtype.name != "float8_e4m3fn":
            raise refuse(_SCHEME, prefix + "weight_packed", "is not uint8 [rows, cols / 2] with float8_e4m3fn scales")
        if gs.dtype.name != "float32" or gs.numel != 1 or not gs.shape:
            raise refuse(_SCHEME, prefix + "weight_global_scale", "is not a float32 tensor of one element")
        if zero_point is not None or zp_key in tensors:
            raise refuse(_SCHEME, zp_key, "is an nvfp4 zero point, which compressed-tensors never writes")
        shape = (packed.shape[0], packed.shape[1] * 2)
        inputs.update(packed=packed, global_scale=gs)

        def compute(a: Mapping[str, Array]) -> Array:
            bf16 = dequantize_nvfp4(a["packed"], a["scale"], a["global_scale"], args)
            return cast(bf16, "bfloat16", out)

    elif args.format == "pack-quantized":
        packed = _ref(tensors, prefix + "weight_packed")
        shape_ref = _ref(tensors, prefix + "weight_shape")
        s = _compute_dtype(scale, prefix + "weight_scale")
        if shape_ref.numel != 2 or shape_ref.dtype.kind != "int":
            raise refuse(
                _SCHEME, prefix + "weight_shape", f"is {shape_ref.dtype.name}{list(shape_ref.shape)}, not 2 sizes"
            )
        shape = tuple(int(v) for v in shape_ref.numpy().reshape(-1))
        if packed.dtype.name != "int32" or len(packed.shape) != 2 or len(shape) != 2 or shape[0] != packed.shape[0]:
            raise refuse(_SCHEME, prefix + "weight_packed", f"is not int32 packing a 2-d weight of shape {list(shape)}")
        if packed.shape[1] != math.ceil(shape[1] * args.num_bits / 32) or not 1 <= args.num_bits <= 8:
            raise refuse(
                _SCHEME, prefix + "weight_packed", f"does not pack {shape[1]} {args.num_bits}-bit values a row"
            )
        inputs["packed"] = packed
        dims = (shape[0], shape[1])

        def compute(a: Mapping[str, Array]) -> Array:
            return cast(dequantize_packed(a["packed"], dims, a["scale"], s, a.get("zero_point"), args), s, out)

    else:
        weight = _ref(tensors, prefix + "weight")
        s = _compute_dtype(scale, prefix + "weight_scale")
        if len(weight.shape) != 2 or weight.dtype.kind not in ("float", "int"):
            raise refuse(
                _SCHEME, prefix + "weight", f"is {weight.dtype.name}{list(weight.shape)}, not a quantized matrix"
            )
        shape = weight.shape
        inputs["weight"] = weight
        names = (weight.dtype.name, zero_point.dtype.name if zero_point is not None else "")

        def compute(a: Mapping[str, Array]) -> Array:
            result = dequantize_naive(a["weight"], names[0], a["scale"], s, a.get("zero_point"), names[1], args)
            return cast(result, s, out)

    check_placement(scale.shape, args, shape, prefix + "weight_scale")
    if zero_point is not None and args.format != "pack-quantized":
        check_placement(zero_point.shape, args, shape, zp_key)
    return computed_tensor(prefix + "weight", compute, inputs, target, shape)


def _planned_modules(tensors: Mapping[str, TensorRef], scheme: Scheme, target: DType) -> dict[str, TensorRef]:
    """Each module quantized on disk (a ``weight_scale`` or ``weight_packed`` beside its weight), dequantized."""
    declared = scheme.declared
    ignore = declared.ignore or Names((), "ignore")
    planned: dict[str, TensorRef] = {}
    for key, ref in tensors.items():
        module, _, leaf = key.rpartition(".")
        prefix = f"{module}." if module else ""
        if leaf not in ("weight", "weight_packed"):
            continue
        args = _module_args(module, declared.groups)
        on_disk = leaf == "weight_packed" or prefix + "weight_scale" in tensors
        if on_disk:
            if prefix + "weight" in tensors and prefix + "weight_packed" in tensors:
                raise refuse(_SCHEME, key, f"and {prefix}weight both exist; the dequantized weight would replace it")
            if args is None:
                listed = " (its module is in ignore)" if ignore.match(module) else ""
                raise refuse(
                    _SCHEME, key, f"is quantized on disk{listed}, but no config group targets its module, so "
                    "ckptconv cannot tell its strategy",
                )  # fmt: skip
            if FORMATS[args.format] != leaf:
                layout = "packed (weight_packed)" if leaf == "weight_packed" else "unpacked (weight, weight_scale)"
                raise refuse(
                    _SCHEME, key, f"is {layout} on disk, but its config group {args.name!r} declares format "
                    f"{args.format!r}; the config and the tensors disagree",
                )  # fmt: skip
            planned[prefix + "weight"] = _plan_module(module, tensors, args, target)
        elif args is not None and ref.dtype.name in _QUANTIZED_DTYPES and not ignore.match(module):
            raise refuse(
                _SCHEME, prefix + "weight_scale", f"is missing: {key!r} is {ref.dtype.name}, quantized by config "
                f"group {args.name!r}, and a plain cast would write its raw values",
            )  # fmt: skip
    return planned


def plan(tensors: Mapping[str, TensorRef], scheme: Scheme, target: DType) -> dict[str, TensorRef]:
    """The state dict with every compressed-tensors weight dequantized to ``target`` and its qparams gone.

    The tensors decide: a module with a ``weight_scale`` or ``weight_packed`` is dequantized by the config group
    that targets it even when ``ignore`` names it (refused when no group does, or its format is another layout);
    a float8 or int8 weight a group targets without its ``weight_scale`` is refused, never written raw.
    """
    planned = _planned_modules(tensors, scheme, target)
    ignore = scheme.declared.ignore or Names((), "ignore")
    result: dict[str, TensorRef] = {}
    for key, ref in tensors.items():
        module, _, leaf = key.rpartition(".")
        prefix = f"{module}." if module else ""
        if prefix + "weight" in planned and (leaf in _QPARAMS or leaf == "weight"):
            if leaf in ("weight", "weight_packed"):
                result[prefix + "weight"] = planned[prefix + "weight"]
        elif leaf in _KV_CACHE_SCALES:
            continue  # CompressedTensorsDequantizer drops kv-cache scales too
        elif leaf in _ACTIVATION_QPARAMS and ignore.match(module):
            result[key] = ref  # an ignored module's activation scale: no weight of it is quantized
        elif leaf in _QPARAMS:
            raise refuse(_SCHEME, key, "belongs to no module the config declares quantized")
        else:
            result[key] = ref
    return result
