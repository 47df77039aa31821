"""A pickle machine that never runs code from the file.

``pickle`` is a small stack language whose GLOBAL opcode names any importable
callable and whose REDUCE opcode calls it: that is how a checkpoint can run
``os.system``. This module interprets every opcode of protocols 0-5 itself and
gives GLOBAL three possible meanings, none of which imports anything:

* **known and harmless** (``collections.OrderedDict``, torch's tensor rebuild
  functions, numpy's array reconstructor, ...): resolved to ckptconv's own
  re-implementation, which builds plain data or a lazy :class:`TensorRef`;
* **made to run code** (``os.system``, ``builtins.eval``, ``subprocess``,
  ``importlib``, ``pickle.loads``, ...): the file is refused with
  :class:`UnsafeCheckpointError` naming the global;
* **anything else** (a model class from code the user does not have,
  ``argparse.Namespace``, ``omegaconf.DictConfig``): an inert
  :class:`ForeignGlobal`. "Calling" it records the arguments in a
  :class:`ForeignObject`; BUILD, SETITEMS and APPENDS store their data in it.
  Nothing is ever called or imported.

The stand-ins are the safety boundary; the refusal list is a warning about
intent. torch's own ``weights_only`` unpickler refuses every unknown global
instead, which is why checkpoints holding an ``argparse.Namespace`` stopped
loading in torch 2.6 and people reached for ``weights_only=False``.
"""

from __future__ import annotations

import codecs
import reprlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .dtypes import DType, dtype_by_name, dtype_by_storage_class
from .errors import MalformedCheckpointError, UnsafeCheckpointError, UnsupportedFormatError
from .tensor import InMemory, Storage, TensorRef, contiguous_strides

__all__ = [
    "ForeignGlobal",
    "ForeignObject",
    "NumpyArray",
    "TypedStorage",
    "Unpickler",
    "classify_global",
    "short_repr",
]

# A pickle may make at most this many objects. Every opcode counts as one
# (most make at most one object of ~50-70 bytes), and so do every container
# item and memo entry; an empty set counts 4, a stand-in object 4, and a known
# callable such as builtins.set counts the items it is given and returns.
# Without the weights one byte of pickle could build 235 bytes of empty sets, or
# copy a memoised million-item list again and again. 20 million caps memory
# near 2 GB and time near 30 s (tests/test_limits.py measures it); torch.save
# writes ~30 opcodes per tensor, which leaves room for 600,000 tensors.
DEFAULT_MAX_ITEMS = 20_000_000
# Bytes made by copying (bytearray(), _codecs.encode, numpy array data) may
# exceed the pickle's own size by at most this much.
_EXTRA_BYTES = 64 << 20
# Check the opcode count every this many opcodes (a local counter, cheap).
_OPCODE_BATCH = 1 << 16


# ---------------------------------------------------------------------------------------
# Stand-ins
# ---------------------------------------------------------------------------------------


class ForeignGlobal:
    """An inert stand-in for a global (class or function) ckptconv does not resolve.

    It is never imported and never called; "calling" it in the pickle creates a
    :class:`ForeignObject` that records the arguments.
    """

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    def __repr__(self) -> str:
        return f"<foreign {self.qualname}>"


class ForeignObject:
    """An inert stand-in for an object of a :class:`ForeignGlobal` class.

    Attributes:
        cls: the stand-in class (or function) that would have built the object.
        args: positional arguments the pickle passed to it.
        kwargs: keyword arguments (``NEWOBJ_EX`` only).
        state: what ``BUILD`` passed to ``__setstate__`` (usually the ``__dict__``).
        items: key/value pairs from ``SETITEMS`` (dict subclasses).
        list_items: items from ``APPENDS`` (list subclasses).
    """

    __slots__ = ("args", "cls", "items", "kwargs", "list_items", "state")

    def __init__(self, cls: Any, args: tuple[Any, ...] = (), kwargs: dict[Any, Any] | None = None) -> None:
        self.cls = cls
        self.args = args
        self.kwargs = kwargs or {}
        self.state: Any = None
        self.items: dict[Any, Any] = {}
        self.list_items: list[Any] = []

    @property
    def qualname(self) -> str:
        return self.cls.qualname if isinstance(self.cls, ForeignGlobal) else repr(self.cls)

    def attributes(self) -> dict[str, Any]:
        """The object's attributes as pickled: the ``__dict__`` plus any ``__slots__`` state."""
        state = self.state
        merged: dict[str, Any] = {}
        if (
            isinstance(state, tuple)
            and len(state) == 2
            and all(part is None or isinstance(part, dict) for part in state)
        ):
            for part in state:
                if part:
                    merged.update({k: v for k, v in part.items() if isinstance(k, str)})
        elif isinstance(state, dict):
            merged.update({k: v for k, v in state.items() if isinstance(k, str)})
        if self.kwargs and not merged:
            merged.update({k: v for k, v in self.kwargs.items() if isinstance(k, str)})
        return merged

    def __repr__(self) -> str:
        return f"<foreign {self.qualname} object>"


@dataclass(frozen=True)
class StorageType:
    """What ``torch.FloatStorage`` and friends resolve to: just a dtype."""

    dtype: DType
    untyped: bool = False


@dataclass(frozen=True)
class TypedStorage:
    """A storage as the pickle sees it: bytes plus the dtype they were saved as."""

    storage: Storage
    dtype: DType
    element_offset: int = 0


class NumpyDType:
    """A numpy dtype rebuilt from its pickle (``numpy.dtype`` REDUCE + BUILD)."""

    __slots__ = ("byteorder", "descr")

    def __init__(self, descr: str) -> None:
        self.descr = descr
        self.byteorder = "="

    def to_numpy(self) -> Any:
        """The real ``numpy.dtype``, for plain numeric kinds only (never object dtypes)."""
        import numpy as np

        if len(self.descr) < 2 or self.descr[0] not in "biufc?" or not self.descr[1:].isdigit():
            if self.descr not in ("?", "b1"):
                return None
        order = self.byteorder if self.byteorder in "<>" else "<"
        return np.dtype(self.descr if self.descr in ("?", "b1") else order + self.descr)


class NumpyArray:
    """A numpy array rebuilt from its pickle; its bytes are kept as a lazy tensor."""

    __slots__ = ("data", "dtype", "fortran", "shape", "tensor")

    def __init__(self) -> None:
        self.shape: tuple[int, ...] = ()
        self.dtype: NumpyDType | None = None
        self.fortran = False
        self.data: Any = None
        self.tensor: TensorRef | None = None

    def __repr__(self) -> str:
        dtype = self.dtype.descr if self.dtype else "?"
        return f"<numpy array {dtype} {list(self.shape)}>"

    def to_numpy(self) -> Any:
        """The real ``numpy.ndarray`` (numeric arrays only; object arrays give None)."""
        import numpy as np

        if self.tensor is None or self.dtype is None:
            return None
        np_dtype = self.dtype.to_numpy()
        raw = self.tensor.storage.read()
        array = np.frombuffer(raw, dtype=np_dtype).copy()
        return array.reshape(self.shape, order="F" if self.fortran else "C")


# ---------------------------------------------------------------------------------------
# Global classification
# ---------------------------------------------------------------------------------------

# Modules whose every member exists to run code, spawn processes, load more
# pickles or reach the network. Matched on the module and its submodules.
_DANGEROUS_MODULES = frozenset(
    [
        "os",
        "posix",
        "nt",
        "posixpath",
        "ntpath",
        "subprocess",
        "_posixsubprocess",
        "_winapi",
        "sys",
        "importlib",
        "imp",
        "pkgutil",
        "zipimport",
        "runpy",
        "ctypes",
        "_ctypes",
        "cffi",
        "pickle",
        "_pickle",
        "cPickle",
        "pickletools",
        "dill",
        "cloudpickle",
        "joblib",
        "marshal",
        "shelve",
        "code",
        "codeop",
        "pdb",
        "bdb",
        "pty",
        "tty",
        "socket",
        "_socket",
        "ssl",
        "select",
        "selectors",
        "http",
        "urllib",
        "urllib2",
        "urllib3",
        "requests",
        "httpx",
        "aiohttp",
        "ftplib",
        "smtplib",
        "telnetlib",
        "poplib",
        "imaplib",
        "webbrowser",
        "shutil",
        "multiprocessing",
        "concurrent",
        "threading",
        "_thread",
        "asyncio",
        "signal",
        "resource",
        "commands",
        "popen2",
        "timeit",
        "cProfile",
        "profile",
        "trace",
        "doctest",
        "site",
        "sysconfig",
        "distutils",
        "setuptools",
        "pip",
        "ensurepip",
        "venv",
        "idlelib",
        "lib2to3",
        "IPython",
        "gc",
        "inspect",
        "linecache",
        "tempfile",
        "glob",
        "fileinput",
        "mmap",
        "yaml",
        "jinja2",
        "xmlrpc",
        "logging.config",
        "tkinter",
        "turtle",
        "numpy.f2py",
        "numpy.distutils",
        "numpy.ctypeslib",
        "numpy.testing",
        "torch.hub",
        "torch.jit",
        "torch.package",
        "torch.utils.cpp_extension",
        "torch.ops",
        "torch._ops",
        "torch.distributed.rpc",
        "torch.serialization.load",
        "torch._dynamo",
        "torch._inductor",
        "torch.compiler",
        "torch.fx",
        "pydoc",
        "_osx_support",
        "_aix_support",
        "_pyrepl",
        "cgitb",
        "test.support",
        "torch.utils.collect_env",
        "torch.utils.bottleneck",
        "torch.utils.data.datapipes",
    ]
)

# Individual callables that run code, read files or resolve attributes by name.
_DANGEROUS_NAMES = frozenset(
    [
        "builtins.eval",
        "builtins.exec",
        "builtins.execfile",
        "builtins.compile",
        "builtins.open",
        "builtins.input",
        "builtins.raw_input",
        "builtins.__import__",
        "builtins.getattr",
        "builtins.setattr",
        "builtins.delattr",
        "builtins.globals",
        "builtins.locals",
        "builtins.vars",
        "builtins.breakpoint",
        "builtins.help",
        "builtins.exit",
        "builtins.quit",
        "builtins.reload",
        "builtins.file",
        "builtins.apply",
        "io.open",
        "io.open_code",
        "io.FileIO",
        "_io.open",
        "_io.open_code",
        "_io.FileIO",
        "types.FunctionType",
        "types.LambdaType",
        "types.CodeType",
        "types.MethodType",
        "types.ModuleType",
        "operator.attrgetter",
        "operator.methodcaller",
        "functools.reduce",
        "torch.load",
        "torch.save",
        "torch.serialization.load",
        "torch.serialization._load",
        "torch.serialization._legacy_load",
        "torch.classes",
        "torch.from_file",
        "torch.UntypedStorage.from_file",
        "numpy.load",
        "numpy.save",
        "numpy.fromfile",
        "numpy.memmap",
        "numpy.loadtxt",
        "numpy.genfromtxt",
        "numpy.lib.npyio.load",
        "numpy.lib._npyio_impl.load",
        "numpy.testing._private.utils.runstring",
        "numpy.lib.utils.safe_eval",
        "numpy.lib._utils_impl.safe_eval",
        "pandas.read_pickle",
        "pandas.io.pickle.read_pickle",
        "uuid._get_command_stdout",
        "platform._syscmd_file",
        "platform._syscmd_ver",
    ]
)

# Method names that, reached through a qualified global such as
# ``pathlib.Path.write_text``, do something no checkpoint needs.
_DANGEROUS_METHODS = frozenset(
    [
        "system",
        "popen",
        "spawn",
        "spawnv",
        "spawnl",
        "eval",
        "exec",
        "compile",
        "unlink",
        "remove",
        "rmtree",
        "rmdir",
        "write_text",
        "write_bytes",
        "extractall",
        "import_module",
        "load",
        "loads",
        "check_output",
        "check_call",
        "getoutput",
        "startfile",
        "fork",
        "kill",
    ]
)

# Dunder names a legitimate pickle uses; every other ``__x__`` component in a
# global is an attempt to walk from an object to its internals.
_ALLOWED_DUNDERS = frozenset({"__newobj__", "__newobj_ex__", "__main__", "__builtin__"})

# Python 2 module names that pickles written by Python 2 use.
_PY2_MODULES = {
    "__builtin__": "builtins",
    "copy_reg": "copyreg",
    "cPickle": "pickle",
    "exceptions": "builtins",
    "UserDict": "collections",
    "_abcoll": "collections.abc",
}


def _normalise(module: str, name: str) -> tuple[str, str]:
    return _PY2_MODULES.get(module, module), name


def classify_global(module: str, name: str) -> str:
    """``"dangerous"``, ``"known"`` or ``"foreign"``: what ckptconv does with a pickle global.

    ``known`` globals are re-implemented by ckptconv, ``foreign`` ones become
    inert stand-ins, ``dangerous`` ones make the file be refused.
    """
    module, name = _normalise(module, name)
    full = f"{module}.{name}"
    parts = full.split(".")
    name_parts = name.split(".")
    for part in name_parts:
        if part.startswith("__") and part.endswith("__") and part not in _ALLOWED_DUNDERS:
            return "dangerous"
    if len(name_parts) > 1 and name_parts[-1] in _DANGEROUS_METHODS:
        return "dangerous"
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix in _DANGEROUS_MODULES or prefix in _DANGEROUS_NAMES:
            return "dangerous"
    if full in _SAFE_CALLABLES or _known_torch_value(module, name) is not None:
        return "known"
    return "foreign"


# ---------------------------------------------------------------------------------------
# ckptconv's own implementations of the harmless globals
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SafeCallable:
    """A global the pickle may call, implemented by ckptconv itself."""

    qualname: str
    function: Callable[..., Any]
    min_args: int = 0
    max_args: int = 255

    def __repr__(self) -> str:
        return f"<known {self.qualname}>"


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 6


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to a few dozen characters, for error messages.

    Values in messages come from the file: a plain ``repr`` of a ten-million-item
    list, or of a list nested a million deep, would take the memory or the
    recursion the limits exist to protect.
    """
    return _REPR.repr(value)


def _malformed(what: str) -> MalformedCheckpointError:
    return MalformedCheckpointError(f"{what}; the checkpoint is damaged or was not written by torch.save")


def _as_shape(value: Any, what: str) -> tuple[int, ...]:
    if isinstance(value, (tuple, list)) and all(type(v) is int for v in value):
        return tuple(value)
    raise _malformed(f"tensor {what} {short_repr(value)} is not a tuple of integers")


def _typed_storage(value: Any) -> TypedStorage:
    if not isinstance(value, TypedStorage):
        raise _malformed(f"a tensor is rebuilt from {short_repr(value)} instead of a storage")
    return value


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_ignored: Any) -> TensorRef:
    typed = _typed_storage(storage)
    if type(offset) is not int:
        raise _malformed(f"tensor storage offset {short_repr(offset)} is not an integer")
    return TensorRef.checked(
        typed.storage,
        typed.dtype,
        _as_shape(size, "size"),
        _as_shape(stride, "stride"),
        typed.element_offset + offset,
    )


def _rebuild_tensor_v3(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any, *_: Any
) -> TensorRef:
    # v3 carries the dtype separately: the storage is untyped bytes.
    typed = _typed_storage(storage)
    if not isinstance(dtype, DType):
        raise _malformed(f"tensor dtype {short_repr(dtype)} is not a torch dtype")
    if type(offset) is not int:
        raise _malformed(f"tensor storage offset {short_repr(offset)} is not an integer")
    base = typed.element_offset * typed.dtype.itemsize
    if base % dtype.itemsize:
        raise _malformed("tensor storage offset is not aligned to its dtype")
    return TensorRef.checked(
        typed.storage,
        dtype,
        _as_shape(size, "size"),
        _as_shape(stride, "stride"),
        base // dtype.itemsize + offset,
    )


def _rebuild_parameter(data: Any, *_ignored: Any) -> Any:
    # A Parameter is its data as far as a state dict is concerned.
    return data


def _rebuild_from_type_v2(function: Any, new_type: Any, args: Any, state: Any) -> Any:
    # Tensor subclasses: rebuild the plain tensor; the subclass is not ours to create.
    # Wrapper subclasses (DTensor) keep their data in `state` (`_local_tensor`), so
    # a stand-in result carries the state and the subclass's name.
    if not isinstance(args, tuple):
        raise _malformed("tensor subclass arguments are not a tuple")
    result = _call(function, args)
    if isinstance(result, ForeignObject):
        if isinstance(new_type, ForeignGlobal):
            result.cls = new_type
        result.state = state
    return result


def _torch_size(values: Any = ()) -> tuple[Any, ...]:
    if not isinstance(values, (tuple, list)):
        raise _malformed(f"torch.Size({short_repr(values)}) is not a sequence")
    return tuple(values)


def _torch_device(kind: Any, index: Any = None) -> str:
    if not isinstance(kind, str):
        raise _malformed(f"torch.device({short_repr(kind)}) is not a device name")
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
        _check_hashable([p[0] for p in items])
        return [tuple(p) for p in items]
    raise _malformed("a mapping is built from something that is not key/value pairs")


def _materialised(value: Any) -> Any:
    # pickle writes set(x) and frozenset(x) with a list; text (set("abc")) never
    # occurs, and a memoised megabyte of it would cost a megabyte of work per call.
    if isinstance(value, (set, frozenset, dict)):
        return value
    if isinstance(value, (list, tuple)):
        # set(value) hashes every item: a tuple nested a million deep would crash the interpreter.
        _check_hashable(value)
        return value
    raise _malformed(f"a container is built from {type(value).__name__}")


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
    raise _malformed(f"bytes are built from {type(value).__name__}")


def _bytearray(value: Any = b"", *encoding: Any) -> bytearray:
    return bytearray(_bytes_like(value, *encoding))


def _codecs_encode(text: Any, encoding: Any = "utf-8", *_: Any) -> bytes:
    # Protocol 2 writes bytes as _codecs.encode(str, "latin1").
    if not isinstance(text, str) or not isinstance(encoding, str):
        raise _malformed("_codecs.encode is given something other than text")
    if encoding.lower().replace("_", "-") not in ("latin1", "latin-1", "iso-8859-1", "utf-8", "utf8", "ascii"):
        raise _malformed(f"_codecs.encode asks for encoding {short_repr(encoding)}")
    try:
        return text.encode(encoding)
    except UnicodeEncodeError as error:
        raise _malformed(f"text cannot be encoded as {encoding}") from error


def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if not all(isinstance(v, (int, float)) for v in (real, imag)):
        raise _malformed("complex() is given something other than numbers")
    return complex(real, imag)


def _slice(*args: Any) -> slice:
    return slice(*args)


def _newobj(cls: Any, *args: Any) -> Any:
    return _instantiate(cls, args, None)


def _newobj_ex(cls: Any, args: Any, kwargs: Any) -> Any:
    # dict(kwargs) of key/value pairs would hash unchecked keys: accept what pickle writes only.
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
        raise _malformed("copyreg.__newobj_ex__ is given something other than a tuple and a dict")
    return _instantiate(cls, tuple(args), dict(kwargs))


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:
    # copyreg._reconstructor: protocols 0/1 spelling of "object of class cls";
    # for dict and list subclasses `state` is the initial content.
    result = _instantiate(cls, (), None)
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
        raise _malformed(f"numpy dtype {short_repr(descr)} is not a type string")
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
        raise _malformed("numpy array dtype is not a dtype")
    _fill_numpy_array(array, (1, _as_shape(shape, "shape"), np_dtype, order == "F", buffer))
    return array


_NUMPY_SCALAR_STANDIN = ForeignGlobal("numpy", "scalar")


def _fill_numpy_array(array: NumpyArray, state: Any) -> None:
    if not (isinstance(state, tuple) and len(state) == 5):
        raise _malformed("numpy array state is not (version, shape, dtype, fortran, data)")
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
        raise _malformed(f"numpy array of shape {list(array.shape)} holds {len(data)} bytes")
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
_register(["torch._utils._rebuild_device_tensor_from_cpu_tensor"], _rebuild_parameter, 4, 4)
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
        if name == "TypedStorage" or name == "_LegacyStorage":
            return None
        if name.endswith("Storage"):
            dtype = dtype_by_storage_class(name)
            if dtype is not None:
                return StorageType(dtype)
    if module == "torch":
        dtype = dtype_by_name(_DTYPE_ALIASES.get(name, name))
        if dtype is not None:
            return dtype
    return None


def _instantiate(cls: Any, args: tuple[Any, ...], kwargs: dict[Any, Any] | None) -> Any:
    if isinstance(cls, ForeignGlobal):
        return ForeignObject(cls, args, kwargs)
    if isinstance(cls, SafeCallable) and cls.qualname in _SAFE_CLASSES:
        return _SAFE_CLASSES[cls.qualname](*args)
    if isinstance(cls, SafeCallable):
        return ForeignObject(ForeignGlobal(*cls.qualname.rsplit(".", 1)), args, kwargs)
    raise _malformed(f"the pickle instantiates {short_repr(cls)}, which is not a class")


def _call(function: Any, args: tuple[Any, ...]) -> Any:
    if isinstance(function, ForeignGlobal):
        return ForeignObject(function, args)
    if isinstance(function, SafeCallable):
        if not function.min_args <= len(args) <= function.max_args:
            raise _malformed(f"{function.qualname} is called with {len(args)} arguments")
        return function.function(*args)
    if isinstance(function, StorageType):
        raise _malformed("a storage class is called directly")
    raise _malformed(f"the pickle calls {short_repr(function)}, which is not callable")


# ---------------------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------------------


class PickleTruncatedError(MalformedCheckpointError):
    """The pickle ran past the end of the bytes it was given."""


_SCALAR_KEYS = frozenset({str, int, float, bytes, bool, type(None)})
_CONTAINERS = (list, tuple, dict, set, frozenset)
_MAX_KEY_DEPTH = 64


def _check_key_depth(key: Any) -> None:
    pending = [(key, 0)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, (tuple, frozenset)):
            if depth >= _MAX_KEY_DEPTH:
                raise _malformed(f"a dict key is nested more than {_MAX_KEY_DEPTH} levels deep")
            pending.extend((item, depth + 1) for item in value)


def _check_hashable(items: Iterable[Any]) -> None:
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
            raise _malformed("a set or dict key is not hashable") from None


class Unpickler:
    """Interprets one pickle from ``data`` starting at ``start``.

    Args:
        data: the bytes holding the pickle (it may be followed by other data).
        start: offset of the pickle's first opcode.
        persistent_load: resolves persistent ids (torch's storage references);
            when None, a persistent id is an error.
        source: the file name, for messages.
        max_items: refuse pickles that build more container items than this.

    After :meth:`load`, ``end`` is the offset just past the STOP opcode and
    ``foreign_globals`` counts the stand-ins created per global.
    """

    def __init__(
        self,
        data: bytes,
        *,
        start: int = 0,
        persistent_load: Callable[[Any], Any] | None = None,
        source: str = "",
        max_items: int = DEFAULT_MAX_ITEMS,
    ) -> None:
        self.data = bytes(data)
        self.pos = start
        self.end = start
        self.persistent_load = persistent_load
        self.source = source
        self.max_items = max_items
        self.items_built = 0
        self.max_bytes = len(self.data) + _EXTRA_BYTES
        self.bytes_built = 0
        self.foreign_globals: Counter[str] = Counter()
        self._globals_cache: dict[tuple[str, str], Any] = {}

    # -- reading primitives ----------------------------------------------------------

    def _truncated(self) -> MalformedCheckpointError:
        return PickleTruncatedError(
            f"{self.source or 'the pickle'} is truncated: its pickle ends at byte {len(self.data)} "
            "before the STOP opcode; the file is incomplete or damaged",
            path=self.source or None,
        )

    def _read(self, n: int) -> bytes:
        pos = self.pos
        end = pos + n
        if n < 0 or end > len(self.data):
            raise self._truncated()
        self.pos = end
        return self.data[pos:end]

    def _readline(self) -> bytes:
        data = self.data
        pos = self.pos
        newline = data.find(b"\n", pos)
        if newline < 0:
            raise self._truncated()
        self.pos = newline + 1
        return bytes(data[pos:newline])

    def _count(self, n: int) -> None:
        self.items_built += n
        if self.items_built > self.max_items:
            raise MalformedCheckpointError(
                f"{self.source or 'the pickle'} builds more than {self.max_items:,} objects; "
                "refusing to exhaust memory on what looks like a hostile file",
                path=self.source or None,
            )

    def _count_bytes(self, n: int) -> None:
        self.bytes_built += n
        if self.bytes_built > self.max_bytes:
            raise MalformedCheckpointError(
                f"{self.source or 'the pickle'} builds more than {self.max_bytes:,} bytes of data from "
                f"{len(self.data):,} bytes of pickle; refusing to exhaust memory on what looks like a hostile file",
                path=self.source or None,
            )

    # -- globals ---------------------------------------------------------------------

    def _global(self, module: str, name: str) -> Any:
        key = (module, name)
        cached = self._globals_cache.get(key)
        if cached is not None:
            return cached
        module, name = _normalise(module, name)
        kind = classify_global(module, name)
        full = f"{module}.{name}"
        if kind == "dangerous":
            raise UnsafeCheckpointError(
                f"{self.source or 'the pickle'} calls {full}, which can run code; refusing a "
                "checkpoint built to attack whoever opens it (nothing was executed)",
                path=self.source or None,
                globals=[full],
            )
        value: Any
        if full in _SAFE_CALLABLES:
            value = _SAFE_CALLABLES[full]
        else:
            value = _known_torch_value(module, name)
            if value is None:
                value = ForeignGlobal(module, name)
                self.foreign_globals[full] += 0  # listed even if never instantiated
        self._globals_cache[key] = value
        return value

    # -- the loop --------------------------------------------------------------------

    def load(self) -> Any:
        """Run the pickle to its STOP opcode and return the object it builds.

        Raises:
            MalformedCheckpointError: truncated or inconsistent pickle.
            UnsafeCheckpointError: the pickle names a code-running global.
            UnsupportedFormatError: the pickle uses features torch never writes
                (extension registry, out-of-band buffers).
        """
        stack: list[Any] = []
        metastack: list[list[Any]] = []
        memo: dict[int, Any] = {}
        data = self.data
        size = len(data)
        read = self._read
        unpack_from = struct.unpack_from

        def pop_mark() -> list[Any]:
            nonlocal stack
            if not metastack:
                raise _malformed("pickle pops a MARK that was never set")
            items = stack
            stack = metastack.pop()
            return items

        def top() -> Any:
            if not stack:
                raise _malformed("pickle stack underflow")
            return stack[-1]

        def pop() -> Any:
            if not stack:
                raise _malformed("pickle stack underflow")
            return stack.pop()

        opcodes = memo_counted = 0
        next_check = _OPCODE_BATCH
        while True:
            if self.pos >= size:
                raise self._truncated()
            op = data[self.pos]
            self.pos += 1
            opcodes += 1
            if opcodes >= next_check:  # every opcode and memo entry counts as one object
                self._count(_OPCODE_BATCH + len(memo) - memo_counted)
                memo_counted = len(memo)
                next_check += _OPCODE_BATCH

            # ---- the most frequent opcodes in torch pickles first
            if op == 0x71:  # BINPUT
                if self.pos >= size:
                    raise self._truncated()
                memo[data[self.pos]] = top()
                self.pos += 1
            elif op == 0x68:  # BINGET
                if self.pos >= size:
                    raise self._truncated()
                stack.append(self._memo_get(memo, data[self.pos]))
                self.pos += 1
            elif op == 0x28:  # MARK
                metastack.append(stack)
                stack = []
            elif op == 0x4B:  # BININT1
                if self.pos >= size:
                    raise self._truncated()
                stack.append(data[self.pos])
                self.pos += 1
            elif op == 0x72:  # LONG_BINPUT
                memo[unpack_from("<I", read(4))[0]] = top()
            elif op == 0x6A:  # LONG_BINGET
                stack.append(self._memo_get(memo, unpack_from("<I", read(4))[0]))
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(())

            # ---- constants and scalars
            elif op == 0x80:  # PROTO
                proto = read(1)[0]
                if proto > 5:
                    raise UnsupportedFormatError(
                        f"{self.source or 'the pickle'} uses pickle protocol {proto}, newer than any "
                        "Python writes today; upgrade ckptconv",
                        path=self.source or None,
                    )
            elif op == 0x95:  # FRAME: an optimisation hint we can ignore
                read(8)
            elif op == 0x2E:  # STOP
                self.end = self.pos
                if len(stack) != 1 or metastack:
                    if not stack:
                        raise _malformed("pickle stops with an empty stack")
                return stack[-1]
            elif op == 0x4E:  # NONE
                stack.append(None)
            elif op == 0x88:  # NEWTRUE
                stack.append(True)
            elif op == 0x89:  # NEWFALSE
                stack.append(False)
            elif op == 0x4D:  # BININT2
                stack.append(unpack_from("<H", read(2))[0])
            elif op == 0x4A:  # BININT
                stack.append(unpack_from("<i", read(4))[0])
            elif op == 0x8A:  # LONG1
                n = read(1)[0]
                stack.append(int.from_bytes(read(n), "little", signed=True))
            elif op == 0x8B:  # LONG4
                n = unpack_from("<i", read(4))[0]
                if n < 0:
                    raise _malformed("LONG4 has a negative length")
                stack.append(int.from_bytes(read(n), "little", signed=True))
            elif op == 0x47:  # BINFLOAT
                stack.append(unpack_from(">d", read(8))[0])
            elif op == 0x49:  # INT (text)
                line = self._readline()
                if line == b"01":
                    stack.append(True)
                elif line == b"00":
                    stack.append(False)
                else:
                    stack.append(self._parse_int(line))
            elif op == 0x4C:  # LONG (text)
                line = self._readline()
                stack.append(self._parse_int(line[:-1] if line.endswith(b"L") else line))
            elif op == 0x46:  # FLOAT (text)
                try:
                    stack.append(float(self._readline()))
                except ValueError as error:
                    raise _malformed("FLOAT opcode holds no number") from error

            # ---- strings and bytes
            elif op == 0x58:  # BINUNICODE
                n = unpack_from("<I", read(4))[0]
                stack.append(self._decode_utf8(read(n)))
            elif op == 0x8C:  # SHORT_BINUNICODE
                stack.append(self._decode_utf8(read(read(1)[0])))
            elif op == 0x8D:  # BINUNICODE8
                n = unpack_from("<Q", read(8))[0]
                stack.append(self._decode_utf8(read(n)))
            elif op == 0x56:  # UNICODE (text, raw-unicode-escape)
                try:
                    stack.append(str(self._readline(), "raw-unicode-escape"))
                except UnicodeDecodeError as error:
                    raise _malformed("UNICODE opcode holds undecodable text") from error
            elif op == 0x55:  # SHORT_BINSTRING (Python 2 str)
                stack.append(self._decode_py2_string(read(read(1)[0])))
            elif op == 0x54:  # BINSTRING
                n = unpack_from("<i", read(4))[0]
                if n < 0:
                    raise _malformed("BINSTRING has a negative length")
                stack.append(self._decode_py2_string(read(n)))
            elif op == 0x53:  # STRING (text, quoted)
                stack.append(self._decode_py2_string(self._parse_quoted(self._readline())))
            elif op == 0x43:  # SHORT_BINBYTES
                stack.append(read(read(1)[0]))
            elif op == 0x42:  # BINBYTES
                stack.append(read(unpack_from("<I", read(4))[0]))
            elif op == 0x8E:  # BINBYTES8
                stack.append(read(unpack_from("<Q", read(8))[0]))
            elif op == 0x96:  # BYTEARRAY8
                stack.append(bytearray(read(unpack_from("<Q", read(8))[0])))

            # ---- containers
            elif op == 0x5D:  # EMPTY_LIST
                stack.append([])
            elif op == 0x7D:  # EMPTY_DICT
                stack.append({})
            elif op == 0x8F:  # EMPTY_SET
                self._count(3)  # an empty set is ~4 times the size of other objects
                stack.append(set())
            elif op == 0x85:  # TUPLE1
                stack.append((pop(),))
            elif op == 0x86:  # TUPLE2
                b = pop()
                a = pop()
                stack.append((a, b))
            elif op == 0x87:  # TUPLE3
                c = pop()
                b = pop()
                a = pop()
                stack.append((a, b, c))
            elif op == 0x74:  # TUPLE
                items = pop_mark()
                self._count(len(items))
                stack.append(tuple(items))
            elif op == 0x6C:  # LIST
                items = pop_mark()
                self._count(len(items))
                stack.append(items)
            elif op == 0x64:  # DICT
                items = pop_mark()
                self._count(len(items))
                mapping: dict[Any, Any] = {}
                self._set_items(mapping, items)
                stack.append(mapping)
            elif op == 0x91:  # FROZENSET
                items = pop_mark()
                self._count(len(items))
                stack.append(frozenset(self._hashable_all(items)))
            elif op == 0x61:  # APPEND
                item = pop()
                self._count(1)
                self._extend(top(), [item])
            elif op == 0x65:  # APPENDS
                items = pop_mark()
                self._count(len(items))
                self._extend(top(), items)
            elif op == 0x73:  # SETITEM
                value = pop()
                key = pop()
                self._count(1)
                self._set_items(top(), [key, value])
            elif op == 0x75:  # SETITEMS
                items = pop_mark()
                self._count(len(items))
                self._set_items(top(), items)
            elif op == 0x90:  # ADDITEMS
                items = pop_mark()
                self._count(len(items))
                target = top()
                if not isinstance(target, set):
                    raise _malformed("ADDITEMS targets something that is not a set")
                target.update(self._hashable_all(items))

            # ---- stack and memo
            elif op == 0x30:  # POP
                if stack:
                    stack.pop()
                else:
                    pop_mark()
            elif op == 0x31:  # POP_MARK
                pop_mark()
            elif op == 0x32:  # DUP
                stack.append(top())
            elif op == 0x94:  # MEMOIZE
                memo[len(memo)] = top()
            elif op == 0x70:  # PUT (text)
                memo[self._parse_int(self._readline())] = top()
            elif op == 0x67:  # GET (text)
                stack.append(self._memo_get(memo, self._parse_int(self._readline())))

            # ---- globals, calls and object building: where pickles normally run code
            elif op == 0x63:  # GLOBAL
                module = self._decode_utf8(self._readline())
                name = self._decode_utf8(self._readline())
                stack.append(self._global(module, name))
            elif op == 0x93:  # STACK_GLOBAL
                name = pop()
                module = pop()
                if not isinstance(module, str) or not isinstance(name, str):
                    raise _malformed("STACK_GLOBAL names are not strings")
                stack.append(self._global(module, name))
            elif op == 0x52:  # REDUCE
                args = pop()
                function = pop()
                if not isinstance(args, tuple):
                    raise _malformed("REDUCE arguments are not a tuple")
                stack.append(self._called(function, args))
            elif op == 0x81:  # NEWOBJ
                args = pop()
                cls = pop()
                if not isinstance(args, tuple):
                    raise _malformed("NEWOBJ arguments are not a tuple")
                stack.append(self._new(cls, args, None))
            elif op == 0x92:  # NEWOBJ_EX
                kwargs = pop()
                args = pop()
                cls = pop()
                if not isinstance(args, tuple) or not isinstance(kwargs, dict):
                    raise _malformed("NEWOBJ_EX arguments are not a tuple and a dict")
                stack.append(self._new(cls, args, kwargs))
            elif op == 0x69:  # INST (protocol 0)
                module = self._decode_utf8(self._readline())
                name = self._decode_utf8(self._readline())
                args = tuple(pop_mark())
                stack.append(self._new(self._global(module, name), args, None))
            elif op == 0x6F:  # OBJ (protocol 1)
                items = pop_mark()
                if not items:
                    raise _malformed("OBJ has no class")
                stack.append(self._new(items[0], tuple(items[1:]), None))
            elif op == 0x62:  # BUILD
                state = pop()
                self._build(top(), state)
            elif op == 0x51:  # BINPERSID
                stack.append(self._persistent(pop()))
            elif op == 0x50:  # PERSID (text)
                stack.append(self._persistent(self._decode_utf8(self._readline())))

            # ---- features torch never writes
            elif op in (0x82, 0x83, 0x84):  # EXT1 / EXT2 / EXT4
                raise UnsupportedFormatError(
                    f"{self.source or 'the pickle'} uses the copyreg extension registry, which "
                    "torch.save never writes and which would resolve globals behind ckptconv's back; "
                    "refusing it",
                    path=self.source or None,
                )
            elif op in (0x97, 0x98):  # NEXT_BUFFER / READONLY_BUFFER
                raise UnsupportedFormatError(
                    f"{self.source or 'the pickle'} expects out-of-band buffers (pickle protocol 5), "
                    "which a file cannot carry; it is not a checkpoint",
                    path=self.source or None,
                )
            else:
                raise _malformed(f"unknown pickle opcode 0x{op:02x} at byte {self.pos - 1}")

    # -- helpers ---------------------------------------------------------------------

    @staticmethod
    def _parse_int(line: bytes) -> int:
        try:
            return int(line)
        except ValueError as error:
            raise _malformed("an integer opcode holds no integer") from error

    @staticmethod
    def _parse_quoted(line: bytes) -> bytes:
        if len(line) >= 2 and line[0] == line[-1] and line[:1] in (b'"', b"'"):
            try:
                return codecs.escape_decode(line[1:-1])[0]
            except ValueError as error:
                raise _malformed("STRING opcode holds a bad escape") from error
        raise _malformed("STRING opcode is not quoted")

    @staticmethod
    def _decode_utf8(raw: bytes) -> str:
        try:
            return raw.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as error:
            raise _malformed("a pickle string is not valid UTF-8") from error

    @staticmethod
    def _decode_py2_string(raw: bytes) -> Any:
        # torch.load decodes Python 2 str as UTF-8; keep undecodable ones as bytes.
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw

    @staticmethod
    def _memo_get(memo: dict[int, Any], index: int) -> Any:
        try:
            return memo[index]
        except KeyError:
            raise _malformed(f"pickle reads memo slot {index}, which was never written") from None

    @staticmethod
    def _hashable_all(items: list[Any]) -> list[Any]:
        _check_hashable(items)
        return items

    def _set_items(self, target: Any, items: list[Any]) -> None:
        if len(items) % 2:
            raise _malformed("SETITEMS has an odd number of items")
        if isinstance(target, ForeignObject):
            target = target.items
        if not isinstance(target, dict):
            raise _malformed(f"SETITEMS targets {type(target).__name__}, not a dict")
        keys = items[0::2]
        self._hashable_all(keys)
        for key, value in zip(keys, items[1::2]):
            target[key] = value

    @staticmethod
    def _extend(target: Any, items: list[Any]) -> None:
        if isinstance(target, list):
            target.extend(items)
        elif isinstance(target, ForeignObject):
            target.list_items.extend(items)
        elif isinstance(target, set):
            target.update(Unpickler._hashable_all(items))
        else:
            raise _malformed(f"APPENDS targets {type(target).__name__}, not a list")

    def _record_foreign(self, value: Any) -> Any:
        if isinstance(value, ForeignObject):
            self.foreign_globals[value.qualname] += 1
        return value

    def _called(self, function: Any, args: tuple[Any, ...]) -> Any:
        self._count_arguments(args)
        return self._charged(self._record_foreign(_call(function, args)))

    def _new(self, cls: Any, args: tuple[Any, ...], kwargs: dict[Any, Any] | None) -> Any:
        self._count_arguments(args)
        return self._charged(self._record_foreign(_instantiate(cls, args, kwargs)))

    def _count_arguments(self, args: tuple[Any, ...]) -> None:
        # A known callable walks its container arguments (set(items), OrderedDict(pairs)):
        # a memoised million-item list passed again and again must cost each time.
        self._count(sum(len(arg) for arg in args if isinstance(arg, _CONTAINERS)))

    def _charged(self, result: Any) -> Any:
        """Count what a call built: its items, or the bytes it copied."""
        if isinstance(result, _CONTAINERS):
            self._count(len(result))
        elif isinstance(result, (bytes, bytearray)):
            self._count_bytes(len(result))
        elif isinstance(result, ForeignObject):
            self._count(3 + len(result.items) + len(result.list_items))
        elif isinstance(result, NumpyArray) and result.tensor is not None:
            self._count_bytes(result.tensor.storage.nbytes)
        return result

    def _build(self, target: Any, state: Any) -> None:
        if isinstance(target, ForeignObject):
            if target.state is None:
                target.state = state
            elif isinstance(target.state, dict) and isinstance(state, dict):
                target.state.update(state)
            else:
                target.state = state
        elif isinstance(target, NumpyArray):
            _fill_numpy_array(target, state)
            if target.tensor is not None:
                self._count_bytes(target.tensor.storage.nbytes)
        elif isinstance(target, NumpyDType):
            # (version, byteorder, subdescr, names, fields, elsize, alignment, flags)
            if isinstance(state, tuple) and len(state) >= 2 and isinstance(state[1], str):
                target.byteorder = state[1]
            if isinstance(state, tuple) and len(state) >= 4 and (state[2] is not None or state[3] is not None):
                target.descr = "V"  # structured dtype: keep opaque
        elif isinstance(target, OrderedDict):
            # torch's state_dict() carries `_metadata` (module versions) as an attribute.
            attrs = state[0] if isinstance(state, tuple) and len(state) == 2 else state
            if isinstance(attrs, dict) and all(isinstance(k, str) for k in attrs):
                target.__dict__.update(attrs)
            elif attrs is not None:
                raise _malformed("OrderedDict state is not a dict of attributes")
        elif isinstance(target, TensorRef):
            # Attributes of tensor subclasses: nothing a state dict needs.
            return
        elif isinstance(target, (dict, list, set)):
            if state:
                raise _malformed(f"BUILD sets attributes on a {type(target).__name__}")
        else:
            raise _malformed(f"BUILD targets {type(target).__name__}")

    def _persistent(self, pid: Any) -> Any:
        if self.persistent_load is None:
            raise _malformed("a plain pickle refers to external storage (persistent id)")
        return self.persistent_load(pid)
