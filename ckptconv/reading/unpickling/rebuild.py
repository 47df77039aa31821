"""ckptconv's own implementations of the harmless globals a checkpoint's pickle calls.

torch's tensor rebuild functions become lazy :class:`~ckptconv.values.tensor.TensorRef`
objects, ``collections``/``builtins`` constructors build plain containers (with
every key checked before it is hashed), numpy's reconstructors build
:class:`~ckptconv.values.standins.NumpyArray` objects. :func:`known_global` says what
a global resolves to; :func:`call` and :func:`instantiate` are what the pickle
machine's REDUCE and NEWOBJ opcodes do with it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptconv._text import short_repr
from ckptconv.dtypes import DType, dtype_by_name, dtype_by_storage_class
from ckptconv.errors import MalformedCheckpointError
from ckptconv.reading.sources import InMemory, Unreadable, computed_tensor
from ckptconv.reading.unpickling.torch_ao import per_channel, per_tensor
from ckptconv.values.standins import ForeignGlobal, ForeignObject, NumpyArray, NumpyDType, StorageType, TypedStorage
from ckptconv.values.tensor import Storage, TensorRef, contiguous_strides

__all__ = ["SafeCallable", "call", "check_hashable", "fill_numpy_array", "instantiate", "known_global", "malformed"]


@dataclass(frozen=True)
class SafeCallable:
    """A global the pickle may call, implemented by ckptconv itself."""

    qualname: str
    function: Callable[..., Any]
    min_args: int = 0
    max_args: int = 255

    def __repr__(self) -> str:
        return f"<known {self.qualname}>"


def malformed(what: str) -> MalformedCheckpointError:
    return MalformedCheckpointError(f"{what}; the checkpoint is damaged or was not written by torch.save")


_SCALAR_KEYS = frozenset({str, int, float, bytes, bool, type(None)})
_MAX_KEY_DEPTH = 64


def _check_key_depth(key: Any) -> None:
    pending = [(key, 0)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, (tuple, frozenset)):
            if depth >= _MAX_KEY_DEPTH:
                raise malformed(f"a dict key is nested more than {_MAX_KEY_DEPTH} levels deep")
            pending.extend((item, depth + 1) for item in value)


def check_hashable(items: Iterable[Any]) -> None:
    """Raise MalformedCheckpointError unless every item can be hashed safely.

    Hashing a tuple recurses in C without a recursion limit (CPython 3.11), so
    a key nested a million deep would crash the interpreter: look at its depth
    before hashing it. Every path that hashes pickle data must come through here.
    """
    for item in items:
        if type(item) in _SCALAR_KEYS:
            continue
        _check_key_depth(item)
        try:
            hash(item)
        except TypeError:
            raise malformed("a set or dict key is not hashable") from None


def _as_shape(value: Any, what: str) -> tuple[int, ...]:
    if isinstance(value, (tuple, list)) and all(type(v) is int for v in value):
        return tuple(value)
    raise malformed(f"tensor {what} {short_repr(value)} is not a tuple of integers")


def _typed_storage(value: Any) -> TypedStorage:
    if not isinstance(value, TypedStorage):
        raise malformed(f"a tensor is rebuilt from {short_repr(value)} instead of a storage")
    return value


def _tensor_bits(metadata: Any) -> tuple[bool, bool]:
    """The conj and neg bits of ``torch._utils.get_tensor_metadata``: ``{}``, ``{"conj": True}``, ``{"neg": True}``.

    Anything else torch.save never writes, and torch.load reads it in ways
    nobody would guess (``{"neg": False}`` sets the bit), so it is refused.
    """
    if metadata is None or metadata == {}:
        return False, False
    if not isinstance(metadata, dict) or not all(k in ("conj", "neg") and v is True for k, v in metadata.items()):
        raise malformed(f"tensor metadata {short_repr(metadata)} is not the conj/neg flags torch.save writes")
    return "conj" in metadata, "neg" in metadata


def _check_requires_grad(value: Any) -> None:
    """torch sets ``requires_grad`` from the pickle, and takes only a bool ("requires_grad must be a bool")."""
    if type(value) is not bool:
        raise malformed(f"tensor requires_grad {short_repr(value)} is not True or False")


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> TensorRef:
    # v2's rest: requires_grad, backward_hooks[, metadata]; the legacy _rebuild_tensor has none.
    if rest:
        _check_requires_grad(rest[0])
    typed = _typed_storage(storage)
    if type(offset) is not int:
        raise malformed(f"tensor storage offset {short_repr(offset)} is not an integer")
    return _on_storage(
        typed, typed.dtype, size, stride, typed.element_offset + offset, rest[2] if len(rest) > 2 else None
    )


def _swap_unit(dtype: DType) -> int:
    """The bytes torch.load swaps together in a storage of ``dtype`` from a big-endian file
    (``UntypedStorage.byteswap``: each half of a complex number apart)."""
    return dtype.itemsize // 2 if dtype.kind == "complex" else dtype.itemsize


def _unswapped(typed: TypedStorage, dtype: DType) -> str | None:
    """Why torch.load does not read a ``dtype`` tensor on ``typed`` as it was saved, or None.

    In a big-endian file torch.load swaps a storage's bytes by the dtype of its pickled storage
    class, not by the tensor's: the dtypes it saves through ``UntypedStorage`` (uint16, uint32,
    uint64, complex32) are swapped as single bytes, that is not at all, and come back in the
    writer's byte order. ckptconv reads the rest as torch does (by the storage's dtype) and
    refuses these rather than write either the values torch gives or the ones saved. Its
    complex32 is one 32-bit word, which a swap would also turn the wrong way (torch swaps each half).
    """
    if typed.storage.byteorder != "big" or dtype.itemsize == 1:
        return None
    if dtype.name != "complex32" and _swap_unit(typed.dtype) == _swap_unit(dtype):
        return None
    stored_as = "untyped bytes" if typed.dtype.itemsize == 1 else f"a {typed.dtype.name} storage"
    return (
        f"a {dtype.name} tensor of this big-endian checkpoint is stored as {stored_as}, whose bytes "
        "torch.load does not swap into this machine's order: the values it gives are not the saved ones, "
        "and ckptconv writes neither; leave the tensor out (--select, --drop), or, on the machine that "
        "saved it, save it as int32, int64, float or complex64 and convert again"
    )


def _on_storage(typed: TypedStorage, dtype: DType, size: Any, stride: Any, offset: int, metadata: Any) -> TensorRef:
    """The tensor a rebuild function describes, checked against its storage and, for a legacy
    storage view (``view_metadata``), against the view's bounds, which torch enforces."""
    conj, neg = _tensor_bits(metadata)
    ref = TensorRef.checked(
        typed.storage, dtype, _as_shape(size, "size"), _as_shape(stride, "stride"), offset, conj=conj, neg=neg
    )
    if typed.element_count is not None and ref.numel:
        end = (typed.element_offset + typed.element_count) * typed.dtype.itemsize
        if ref.byte_span[0] < typed.element_offset * typed.dtype.itemsize or ref.byte_span[1] > end:
            raise malformed(
                f"a tensor of size {list(ref.shape)} reaches past the end of its storage view "
                f"of {typed.element_count} elements"
            )
    reason = _unswapped(typed, dtype) if ref.numel else None  # an empty tensor has no bytes to misread
    if reason is not None:
        # Refused when read, so that a conversion leaving the tensor out (optimizer state) still runs.
        unreadable = dataclasses.replace(ref.storage, source=Unreadable(reason, ref.storage.source.paths()))
        ref = dataclasses.replace(ref, storage=unreadable)
    return ref


# torch.ao's quantization schemes a saved quantized tensor names (``torch.qscheme`` values), as plain data.
_QSCHEMES = frozenset({"per_tensor_affine", "per_channel_affine", "per_channel_affine_float_qparams"})
_INTEGER_REPRS = frozenset({"qint8", "quint8", "qint32"})
#: The ``origin`` of a tensor read as a torch.ao quantized tensor's ``dequantize()``.
DEQUANTIZED_ORIGIN = "torch.ao quantized"


def _rebuild_qtensor(
    storage: Any, offset: Any, size: Any, stride: Any, params: Any, requires_grad: Any, hooks: Any
) -> TensorRef:
    """A torch.ao quantized tensor, read as its ``dequantize()``: float32, computed when its bytes are read."""
    _check_requires_grad(requires_grad)
    typed = _typed_storage(storage)
    if typed.dtype.name not in _INTEGER_REPRS:
        raise malformed(f"a quantized tensor is stored as {typed.dtype.name}, not qint8, quint8 or qint32")
    if type(offset) is not int:
        raise malformed(f"tensor storage offset {short_repr(offset)} is not an integer")
    values = _on_storage(typed, typed.dtype, size, stride, typed.element_offset + offset, None)
    float32 = dtype_by_name("float32")
    if float32 is None:  # pragma: no cover - in ckptconv's dtype table
        raise malformed("float32 is not a dtype")
    if not isinstance(params, tuple) or not params or params[0] not in {f"torch.{name}" for name in _QSCHEMES}:
        raise malformed(f"a quantized tensor's parameters {short_repr(params)} name no quantization scheme")
    scheme = params[0]
    if scheme == "torch.per_tensor_affine" and len(params) == 3:
        scale, zero_point = params[1], params[2]
        if type(scale) is not float or type(zero_point) is not int:
            raise malformed(f"per-tensor quantization parameters {short_repr(params[1:])} are not a float and an int")
        compute: Callable[[Mapping[str, Any]], Any] = functools.partial(per_tensor, scale, zero_point)
        inputs = {"values": values}
    elif scheme == "torch.per_channel_affine" and len(params) == 4:
        scales, zero_points, axis = params[1], params[2], params[3]
        if not (isinstance(scales, TensorRef) and isinstance(zero_points, TensorRef) and type(axis) is int) or not (
            scales.dtype.kind == "float" and zero_points.dtype.kind in ("int", "uint", "float")
        ):
            raise malformed(
                f"per-channel quantization parameters {short_repr(params[1:])} are not two tensors and an axis"
            )
        if not 0 <= axis < len(values.shape) or scales.numel != values.shape[axis] or zero_points.numel != scales.numel:
            raise malformed(
                f"per-channel quantization along axis {axis} has {scales.numel} scales for shape {list(values.shape)}"
            )
        compute = functools.partial(per_channel, axis)
        inputs = {"values": values, "scales": scales, "zero_points": zero_points}
    else:
        why = f"torch.ao's {scheme.removeprefix('torch.')} quantization is not read by ckptconv; dequantize the tensors"
        unreadable = Storage(values.numel * 4, Unreadable(why + " (tensor.dequantize()) and save them", frozenset()))
        return TensorRef.checked(unreadable, float32, values.shape, contiguous_strides(values.shape), 0)
    ref = computed_tensor("dequantized", compute, inputs, float32, values.shape)
    return dataclasses.replace(ref, origin=DEQUANTIZED_ORIGIN)


def _rebuild_tensor_v3(
    storage: Any,
    offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> TensorRef:
    # v3 carries the dtype separately: the storage is untyped bytes.
    _check_requires_grad(requires_grad)
    typed = _typed_storage(storage)
    if not isinstance(dtype, DType):
        raise malformed(f"tensor dtype {short_repr(dtype)} is not a torch dtype")
    if type(offset) is not int:
        raise malformed(f"tensor storage offset {short_repr(offset)} is not an integer")
    base = typed.element_offset * typed.dtype.itemsize
    if base % dtype.itemsize:
        raise malformed("tensor storage offset is not aligned to its dtype")
    return _on_storage(typed, dtype, size, stride, base // dtype.itemsize + offset, metadata)


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    # A Parameter is its data as far as a state dict is concerned; rest: requires_grad[, hooks[, state]].
    if rest:
        _check_requires_grad(rest[0])
    return data


def _rebuild_device_tensor(data: Any, dtype: Any, device: Any, requires_grad: Any) -> Any:
    _check_requires_grad(requires_grad)
    return data


def _rebuild_from_type_v2(function: Any, new_type: Any, args: Any, state: Any) -> Any:
    # Tensor subclasses: rebuild the plain tensor; the subclass is not ours to create.
    # Wrapper subclasses (DTensor) keep their data in `state` (`_local_tensor`), so
    # a stand-in result carries the state and the subclass's name.
    if not isinstance(args, tuple):
        raise malformed("tensor subclass arguments are not a tuple")
    result = call(function, args)
    if isinstance(result, ForeignObject):
        if isinstance(new_type, ForeignGlobal):
            result.cls = new_type
        result.state = state
    return result


def _torch_size(values: Any = ()) -> tuple[Any, ...]:
    if not isinstance(values, (tuple, list)):
        raise malformed(f"torch.Size({short_repr(values)}) is not a sequence")
    return tuple(values)


def _torch_device(kind: Any, index: Any = None) -> str:
    if not isinstance(kind, str):
        raise malformed(f"torch.device({short_repr(kind)}) is not a device name")
    return kind if index is None else f"{kind}:{index}"


def _ordered_dict(items: Any = ()) -> OrderedDict[Any, Any]:
    return OrderedDict(_pairs(items))


def _counter(items: Any = ()) -> Counter[Any]:
    if isinstance(items, dict):
        return Counter(items)
    return Counter(dict(_pairs(items)))


def _plain_dict_ignoring_factory(*_factory: Any) -> dict[Any, Any]:
    # defaultdict(factory): the factory is a global we must not call later, so
    # the result is a plain dict filled by SETITEMS.
    return {}


def _pairs(items: Any) -> list[tuple[Any, Any]]:
    if isinstance(items, dict):
        return list(items.items())
    if isinstance(items, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in items):
        # The keys are hashed by the OrderedDict/Counter built from them: check them first.
        check_hashable([p[0] for p in items])
        return [tuple(p) for p in items]
    raise malformed("a mapping is built from something that is not key/value pairs")


def _materialised(value: Any) -> Any:
    # pickle writes set(x) and frozenset(x) with a list; text (set("abc")) never
    # occurs, and a memoised megabyte of it would cost a megabyte of work per call.
    if isinstance(value, (set, frozenset, dict)):
        return value
    if isinstance(value, (list, tuple)):
        # set(value) hashes every item: a tuple nested a million deep would crash the interpreter.
        check_hashable(value)
        return value
    raise malformed(f"a container is built from {type(value).__name__}")


def _set(items: Any = ()) -> set[Any]:
    return set(_materialised(items))


def _frozenset(items: Any = ()) -> frozenset[Any]:
    return frozenset(_materialised(items))


def _bytes_like(value: Any = b"", *encoding: Any) -> bytes:
    # bytes(int) / bytearray(int) would allocate whatever the file asks for.
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str) and encoding:
        return _codecs_encode(value, *encoding)
    if isinstance(value, list) and all(type(v) is int and 0 <= v < 256 for v in value):
        return bytes(value)
    raise malformed(f"bytes are built from {type(value).__name__}")


def _bytearray(value: Any = b"", *encoding: Any) -> bytearray:
    return bytearray(_bytes_like(value, *encoding))


def _codecs_encode(text: Any, encoding: Any = "utf-8", *_: Any) -> bytes:
    # Protocol 2 writes bytes as _codecs.encode(str, "latin1").
    if not isinstance(text, str) or not isinstance(encoding, str):
        raise malformed("_codecs.encode is given something other than text")
    if encoding.lower().replace("_", "-") not in ("latin1", "latin-1", "iso-8859-1", "utf-8", "utf8", "ascii"):
        raise malformed(f"_codecs.encode asks for encoding {short_repr(encoding)}")
    try:
        return text.encode(encoding)
    except UnicodeEncodeError as error:
        raise malformed(f"text cannot be encoded as {encoding}") from error


def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if not all(isinstance(v, (int, float)) for v in (real, imag)):
        raise malformed("complex() is given something other than numbers")
    return complex(real, imag)


def _slice(*args: Any) -> slice:
    return slice(*args)


def _newobj(cls: Any, *args: Any) -> Any:
    return instantiate(cls, args, None)


def _newobj_ex(cls: Any, args: Any, kwargs: Any) -> Any:
    # dict(kwargs) of key/value pairs would hash unchecked keys: accept what pickle writes only.
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
        raise malformed("copyreg.__newobj_ex__ is given something other than a tuple and a dict")
    return instantiate(cls, tuple(args), dict(kwargs))


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:
    # copyreg._reconstructor: protocols 0/1 spelling of "object of class cls";
    # for dict and list subclasses `state` is the initial content.
    result = instantiate(cls, (), None)
    if isinstance(result, ForeignObject):
        if isinstance(state, dict):
            result.items.update(state)
        elif isinstance(state, list):
            result.list_items.extend(state)
    return result


def _numpy_reconstruct(subtype: Any, shape: Any, dtype: Any) -> NumpyArray:
    return NumpyArray()


def _numpy_dtype(descr: Any, align: Any = False, copy: Any = False) -> NumpyDType:
    if not isinstance(descr, str):
        raise malformed(f"numpy dtype {short_repr(descr)} is not a type string")
    return NumpyDType(descr)


def _numpy_scalar(dtype: Any, data: Any = None) -> Any:
    import numpy as np

    if not isinstance(dtype, NumpyDType) or not isinstance(data, bytes):
        return ForeignObject(_NUMPY_SCALAR_STANDIN, (dtype, data))
    np_dtype = dtype.to_numpy()
    if np_dtype is None or np_dtype.itemsize != len(data):
        return ForeignObject(_NUMPY_SCALAR_STANDIN, (dtype, data))
    return np.frombuffer(data, dtype=np_dtype)[0]


def _numpy_frombuffer(buffer: Any, dtype: Any, shape: Any, order: Any = "C") -> NumpyArray:
    # numpy's protocol-5 path: numpy.core.numeric._frombuffer(buf, dtype, shape, order)
    array = NumpyArray()
    if isinstance(dtype, NumpyDType):
        np_dtype = dtype
    else:
        raise malformed("numpy array dtype is not a dtype")
    fill_numpy_array(array, (1, _as_shape(shape, "shape"), np_dtype, order == "F", buffer))
    return array


_NUMPY_SCALAR_STANDIN = ForeignGlobal("numpy", "scalar")


def fill_numpy_array(array: NumpyArray, state: Any) -> None:
    if not (isinstance(state, tuple) and len(state) == 5):
        raise malformed("numpy array state is not (version, shape, dtype, fortran, data)")
    _version, shape, dtype, fortran, data = state
    array.shape = _as_shape(shape, "shape")
    array.dtype = dtype if isinstance(dtype, NumpyDType) else None
    array.fortran = bool(fortran)
    array.data = data
    if isinstance(data, str):
        data = data.encode("latin1", errors="strict") if data.isascii() else None
    if array.dtype is None or not isinstance(data, (bytes, bytearray)):
        return  # object arrays and exotic dtypes stay opaque
    descr = array.dtype.descr
    kind_size = {
        "f2": "float16",
        "f4": "float32",
        "f8": "float64",
        "i1": "int8",
        "i2": "int16",
        "i4": "int32",
        "i8": "int64",
        "u1": "uint8",
        "u2": "uint16",
        "u4": "uint32",
        "u8": "uint64",
        "b1": "bool",
        "?": "bool",
        "c8": "complex64",
        "c16": "complex128",
    }
    name = kind_size.get(descr)
    if name is None:
        return
    dtype_ = dtype_by_name(name)
    assert dtype_ is not None
    numel = 1
    for size in array.shape:
        numel *= size
    if numel * dtype_.itemsize != len(data):
        raise malformed(f"numpy array of shape {list(array.shape)} holds {len(data)} bytes")
    storage = Storage(len(data), InMemory(bytes(data)), byteorder="big" if array.dtype.byteorder == ">" else "little")
    if array.fortran and len(array.shape) > 1:
        stride = tuple(reversed(contiguous_strides(tuple(reversed(array.shape)))))
    else:
        stride = contiguous_strides(array.shape)
    array.tensor = TensorRef.checked(storage, dtype_, array.shape, stride, 0, origin="numpy")


_SAFE_CALLABLES: dict[str, SafeCallable] = {}


def _register(names: Iterable[str], function: Callable[..., Any], min_args: int = 0, max_args: int = 255) -> None:
    for name in names:
        _SAFE_CALLABLES[name] = SafeCallable(name, function, min_args, max_args)


_register(["torch._utils._rebuild_tensor"], _rebuild_tensor, 4, 4)
_register(["torch._utils._rebuild_tensor_v2"], _rebuild_tensor, 6, 7)
_register(["torch._utils._rebuild_tensor_v3"], _rebuild_tensor_v3, 7, 8)
_register(["torch._utils._rebuild_parameter", "torch.nn.parameter.Parameter"], _rebuild_parameter, 1, 3)
_register(["torch._utils._rebuild_parameter_with_state"], _rebuild_parameter, 4, 4)
_register(["torch._tensor._rebuild_from_type_v2", "torch._tensor._rebuild_from_type"], _rebuild_from_type_v2, 4, 4)
_register(["torch._utils._rebuild_device_tensor_from_cpu_tensor"], _rebuild_device_tensor, 4, 4)
_register(["torch._utils._rebuild_qtensor"], _rebuild_qtensor, 7, 7)
_register(["torch.Size"], _torch_size, 0, 1)
_register(["torch.device"], _torch_device, 1, 2)
_register(["collections.OrderedDict"], _ordered_dict, 0, 1)
_register(["collections.Counter"], _counter, 0, 1)
_register(["collections.defaultdict"], _plain_dict_ignoring_factory, 0, 1)
_register(["builtins.set"], _set, 0, 1)
_register(["builtins.frozenset"], _frozenset, 0, 1)
_register(["builtins.bytes"], _bytes_like, 0, 2)
_register(["builtins.bytearray"], _bytearray, 0, 2)
_register(["_codecs.encode"], _codecs_encode, 1, 2)
_register(["builtins.complex"], _complex, 0, 2)
_register(["builtins.slice"], _slice, 1, 3)
_register(["copyreg.__newobj__"], _newobj, 1)
_register(["copyreg.__newobj_ex__"], _newobj_ex, 3, 3)
_register(["copyreg._reconstructor"], _reconstructor, 3, 3)
for _numpy_core in ("numpy.core", "numpy._core"):
    _register([f"{_numpy_core}.multiarray._reconstruct"], _numpy_reconstruct, 3, 3)
    _register([f"{_numpy_core}.multiarray.scalar"], _numpy_scalar, 1, 2)
    _register([f"{_numpy_core}.numeric._frombuffer"], _numpy_frombuffer, 3, 4)
_register(["numpy.dtype"], _numpy_dtype, 1, 3)
_register(["numpy.ndarray"], _numpy_reconstruct, 0, 3)  # named as the subtype argument of _reconstruct

# Classes the pickle may instantiate through NEWOBJ / copyreg, mapped to what we build.
_SAFE_CLASSES: dict[str, Callable[..., Any]] = {
    "collections.OrderedDict": lambda *a, **k: OrderedDict(),
    "collections.Counter": lambda *a, **k: Counter(),
    "collections.defaultdict": lambda *a, **k: {},
    "builtins.set": lambda *a, **k: set(),
    "torch.nn.parameter.Parameter": lambda *a, **k: _rebuild_parameter(*a) if a else None,
}

_DTYPE_ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "long": "int64",
    "int": "int32",
    "short": "int16",
    "cfloat": "complex64",
    "cdouble": "complex128",
    "chalf": "complex32",
}


def _known_torch_value(module: str, name: str) -> Any:
    """What a torch global resolves to when it is data rather than a function."""
    if module in ("torch", "torch.cuda", "torch.storage", "torch.cuda.storage"):
        if name in ("UntypedStorage", "ByteStorage") and module in ("torch", "torch.storage"):
            dtype = dtype_by_name("uint8")
            assert dtype is not None
            return StorageType(dtype, untyped=name == "UntypedStorage")
        if name in ("TypedStorage", "_LegacyStorage"):
            return None
        if name.endswith("Storage"):
            dtype = dtype_by_storage_class(name)
            if dtype is not None:
                return StorageType(dtype)
    if module == "torch" and name in _QSCHEMES:
        return f"torch.{name}"  # a qscheme, as plain data (see _rebuild_qtensor)
    if module == "torch":
        dtype = dtype_by_name(_DTYPE_ALIASES.get(name, name))
        if dtype is not None:
            return dtype
    return None


def instantiate(cls: Any, args: tuple[Any, ...], kwargs: dict[Any, Any] | None) -> Any:
    if isinstance(cls, ForeignGlobal):
        return ForeignObject(cls, args, kwargs)
    if isinstance(cls, SafeCallable) and cls.qualname in _SAFE_CLASSES:
        return _SAFE_CLASSES[cls.qualname](*args)
    if isinstance(cls, SafeCallable):
        return ForeignObject(ForeignGlobal(*cls.qualname.rsplit(".", 1)), args, kwargs)
    raise malformed(f"the pickle instantiates {short_repr(cls)}, which is not a class")


def call(function: Any, args: tuple[Any, ...]) -> Any:
    if isinstance(function, ForeignGlobal):
        return ForeignObject(function, args)
    if isinstance(function, SafeCallable):
        if not function.min_args <= len(args) <= function.max_args:
            raise malformed(f"{function.qualname} is called with {len(args)} arguments")
        return function.function(*args)
    if isinstance(function, StorageType):
        raise malformed("a storage class is called directly")
    raise malformed(f"the pickle calls {short_repr(function)}, which is not callable")


def known_global(module: str, name: str) -> Any:
    """What ckptconv resolves a (normalised) global to, or None when it is not one of ours."""
    known = _SAFE_CALLABLES.get(f"{module}.{name}")
    if known is not None:
        return known
    return _known_torch_value(module, name)
