"""Inert stand-ins for what a pickle names: nothing here imports or calls anything.

The pickle machine (:mod:`ckptconv.reading.unpickling.unpickler`) builds these where ``pickle``
would import a class or call a function: a :class:`ForeignGlobal` for a global
ckptconv does not know, a :class:`ForeignObject` for an object of one,
:class:`StorageType`/:class:`TypedStorage` for torch storages,
:class:`NumpyDType`/:class:`NumpyArray` for numpy data. They hold the pickled
data as plain values, and :func:`ckptconv._text.short_repr` describes any of it in a bounded
number of characters for error messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptconv.dtypes import DType
from ckptconv.values.tensor import Storage, TensorRef

__all__ = [
    "ForeignGlobal",
    "ForeignObject",
    "NumpyArray",
    "NumpyDType",
    "StorageType",
    "TypedStorage",
]


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
    """A storage as the pickle sees it: bytes plus the dtype they were saved as.

    ``element_offset`` and ``element_count`` describe a storage *view* of the
    legacy format (``view_metadata``): the tensors built on it must lie inside
    those ``element_count`` elements, as torch's slice of the storage enforces.
    """

    storage: Storage
    dtype: DType
    element_offset: int = 0
    element_count: int | None = None


class NumpyDType:
    """A numpy dtype rebuilt from its pickle (``numpy.dtype`` REDUCE + BUILD)."""

    __slots__ = ("byteorder", "descr")

    def __init__(self, descr: str) -> None:
        self.descr = descr
        self.byteorder = "="

    def to_numpy(self) -> Any:
        """The real ``numpy.dtype``, for plain numeric kinds only (never object dtypes)."""
        import numpy as np

        plain = len(self.descr) >= 2 and self.descr[0] in "biufc?" and self.descr[1:].isdigit()
        if not plain and self.descr not in ("?", "b1"):
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
