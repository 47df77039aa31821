"""The element types ckptconv understands, and their names in each format.

torch, safetensors and numpy each spell dtypes differently, and a checkpoint
can hold dtypes numpy has no type for (bfloat16, float8). ckptconv therefore
keeps its own small table and never needs torch to describe a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DTYPES", "DType", "dtype_by_name", "parse_cast_target"]


@dataclass(frozen=True)
class DType:
    """One element type.

    Attributes:
        name: torch's name without the ``torch.`` prefix (``"bfloat16"``).
        itemsize: bytes per element.
        kind: ``"float"``, ``"int"``, ``"uint"``, ``"bool"``, ``"complex"``, ``"quantized"`` or
            ``"bits"`` (opaque: packed float4, ``bits8``).
        storage_class: torch's legacy typed-storage class (``"FloatStorage"``), or
            ``None`` for dtypes torch saves through ``UntypedStorage`` and
            ``_rebuild_tensor_v3``.
        safetensors: the safetensors header code (``"F32"``), or ``None`` when
            safetensors cannot hold the type.
        numpy: a numpy dtype string for the *storage* representation; bfloat16
            and float8 are kept as unsigned integers of the same width.
    """

    name: str
    itemsize: int
    kind: str
    storage_class: str | None
    safetensors: str | None
    numpy: str

    @property
    def negatable(self) -> bool:
        """True for the types torch can give a negative bit (``torch._neg_view``): signed
        ints, uint8, float, complex; not bool, float8 or the wider unsigned ints."""
        if self.kind == "float":
            return self.itemsize > 1
        return self.kind in ("int", "complex") or self.name == "uint8"

    @property
    def is_floating_point(self) -> bool:
        """True for the types a ``--dtype`` cast applies to (not ints, bools or complex)."""
        return self.kind == "float"

    def __str__(self) -> str:
        return self.name


DTYPES: tuple[DType, ...] = (
    DType("float64", 8, "float", "DoubleStorage", "F64", "<f8"),
    DType("float32", 4, "float", "FloatStorage", "F32", "<f4"),
    DType("float16", 2, "float", "HalfStorage", "F16", "<f2"),
    DType("bfloat16", 2, "float", "BFloat16Storage", "BF16", "<u2"),
    DType("float8_e4m3fn", 1, "float", None, "F8_E4M3", "u1"),
    DType("float8_e5m2", 1, "float", None, "F8_E5M2", "u1"),
    DType("float8_e4m3fnuz", 1, "float", None, "F8_E4M3FNUZ", "u1"),
    DType("float8_e5m2fnuz", 1, "float", None, "F8_E5M2FNUZ", "u1"),
    DType("float8_e8m0fnu", 1, "float", None, "F8_E8M0", "u1"),
    DType("int64", 8, "int", "LongStorage", "I64", "<i8"),
    DType("int32", 4, "int", "IntStorage", "I32", "<i4"),
    DType("int16", 2, "int", "ShortStorage", "I16", "<i2"),
    DType("int8", 1, "int", "CharStorage", "I8", "i1"),
    DType("uint64", 8, "uint", None, "U64", "<u8"),
    DType("uint32", 4, "uint", None, "U32", "<u4"),
    DType("uint16", 2, "uint", None, "U16", "<u2"),
    DType("uint8", 1, "uint", "ByteStorage", "U8", "u1"),
    DType("bool", 1, "bool", "BoolStorage", "BOOL", "?"),
    DType("complex64", 8, "complex", "ComplexFloatStorage", "C64", "<c8"),
    DType("complex128", 16, "complex", "ComplexDoubleStorage", None, "<c16"),
    DType("complex32", 4, "complex", None, None, "<u4"),
    # Opaque bit containers: copied as they are, never cast. safetensors' F4 counts 4-bit
    # elements, torch's float4_e2m1fn_x2 bytes of two (formats/safetensors.py converts the shape).
    DType("float4_e2m1fn_x2", 1, "bits", None, "F4", "u1"),
    DType("bits8", 1, "bits", None, None, "u1"),
    DType("bits16", 2, "bits", None, None, "<u2"),
    DType("bits1x8", 1, "bits", None, None, "u1"),
    DType("bits2x4", 1, "bits", None, None, "u1"),
    DType("bits4x2", 1, "bits", None, None, "u1"),
    DType("qint8", 1, "quantized", "QInt8Storage", None, "i1"),
    DType("quint8", 1, "quantized", "QUInt8Storage", None, "u1"),
    DType("qint32", 4, "quantized", "QInt32Storage", None, "<i4"),
    # Sub-byte integers packed two or four to a byte; torch counts bytes, as for float4_e2m1fn_x2.
    DType("quint4x2", 1, "quantized", "QUInt4x2Storage", None, "u1"),
    DType("quint2x4", 1, "quantized", "QUInt2x4Storage", None, "u1"),
)

_BY_NAME = {dtype.name: dtype for dtype in DTYPES}
_BY_STORAGE_CLASS = {dtype.storage_class: dtype for dtype in DTYPES if dtype.storage_class}
_BY_SAFETENSORS = {dtype.safetensors: dtype for dtype in DTYPES if dtype.safetensors}

# What users type after --dtype.
_CAST_ALIASES = {
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
    "fp64": "float64",
    "double": "float64",
    "float64": "float64",
}


def dtype_by_name(name: str) -> DType | None:
    """The dtype called ``name`` in torch (``"float32"`` or ``"torch.float32"``), else None."""
    return _BY_NAME.get(name[6:] if name.startswith("torch.") else name)


def dtype_by_storage_class(name: str) -> DType | None:
    """The dtype of a legacy typed storage class (``"FloatStorage"``), else None."""
    return _BY_STORAGE_CLASS.get(name)


#: Codes of the safetensors format that no torch dtype holds (six-bit floats, written packed), so a
#: file with them is valid but cannot become torch tensors (the safetensors library refuses them too).
SAFETENSORS_WITHOUT_TORCH = frozenset({"F6_E2M3", "F6_E3M2"})


def dtype_by_safetensors_code(code: str) -> DType | None:
    """The dtype of a safetensors header code (``"BF16"``), else None."""
    return _BY_SAFETENSORS.get(code)


def parse_cast_target(text: str) -> DType:
    """The floating-point dtype named by a ``--dtype`` value such as ``bf16``.

    Raises:
        ValueError: ``text`` names no floating-point dtype a cast can produce.
    """
    name = _CAST_ALIASES.get(text.strip().lower())
    if name is None:
        choices = ", ".join(sorted({"fp16", "bf16", "fp32", "fp64"}))
        raise ValueError(f"{text!r} is not a dtype ckptconv can cast to; choose one of {choices}")
    return _BY_NAME[name]
