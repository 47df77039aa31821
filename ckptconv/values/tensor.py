"""Lazy tensors: where a tensor's bytes are, not the bytes themselves.

Loading a checkpoint produces :class:`TensorRef` objects. Each one points into a
:class:`Storage` (a run of bytes in the input file, or in memory) with an
offset, shape and stride, exactly like a torch tensor points into its storage.
Nothing is read until a writer asks for the bytes, so peak memory is bounded by
the largest tensor, never by the checkpoint. Tensors that share a storage in the
file share one :class:`Storage` object here, which is how tied weights and views
survive a conversion.

This is the value layer: it imports no I/O and no torch. Where bytes come from (files, zip
members, memory) is :mod:`ckptconv.reading.sources`; reading them, whole or streamed, is
:mod:`ckptconv.reading.streaming`, reached through the storage's source.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ckptconv.dtypes import DType
from ckptconv.errors import MalformedCheckpointError

if TYPE_CHECKING:
    from numpy.typing import NDArray

    Array = NDArray[Any]

__all__ = ["ByteSource", "ReadInto", "Storage", "StoredRegion", "TensorRef"]


# Every byte source has one interface: ``opened()`` yields a ``read_into(start, out)``
# that fills a buffer from ``start`` (in the source's own numbering), keeping
# whatever must stay open (a file, a decompressor) open for many reads; and
# ``paths()`` names the files it reads, so a writer never overwrites them.
ReadInto = Callable[[int, memoryview], None]


class ByteSource(Protocol):
    """Where a storage's bytes are: a file region, a zip member, memory, or chunks to assemble.

    A source also reads the tensors that view it (:meth:`tensor_array`, :meth:`tensor_bytes`, :meth:`torch_tensor`),
    so this module, the value layer, imports no I/O and no torch: every source derives from
    :class:`ckptconv.reading.sources.Source`, which does that work in the reading stage.
    """

    def opened(self) -> contextlib.AbstractContextManager[ReadInto]: ...

    def paths(self) -> frozenset[str]: ...

    def tensor_array(self, ref: TensorRef) -> Array: ...

    def tensor_bytes(
        self, ref: TensorRef, chunk_bytes: int | None, record_crcs: dict[Storage, int] | None
    ) -> Iterator[memoryview]: ...

    def torch_tensor(self, ref: TensorRef) -> Any: ...

    @property
    def crc32(self) -> int | None:
        """The CRC-32 the file records for the storage's bytes (zip records), or None."""

    @property
    def in_order(self) -> bool:
        """True when reads must go front to back (a compressed stream cannot jump)."""

    def stored_region(self) -> StoredRegion | None:
        """The uncompressed run of a file the bytes are, when they are one (writers copy it in the kernel)."""


class StoredRegion(Protocol):
    """Bytes stored uncompressed at ``offset`` in the file at ``path`` (a file region of the reading stage)."""

    @property
    def path(self) -> str: ...

    @property
    def offset(self) -> int: ...

    @property
    def crc32(self) -> int | None: ...


@dataclass(frozen=True, eq=False, slots=True)
class Storage:
    """One storage record: ``nbytes`` bytes shared by every tensor that views them.

    Storages compare by identity: two tensors share memory exactly when they
    hold the same ``Storage`` object.

    Attributes:
        nbytes: size of the record in bytes.
        source: where the bytes are.
        location: the device the storage was saved from (``"cuda:1"``); only
            reported, since ckptconv always loads on the CPU.
        byteorder: ``"little"`` or ``"big"``; big-endian files are swapped on read.
        name: the record's name in the source, for messages.
    """

    nbytes: int
    source: ByteSource
    location: str = "cpu"
    byteorder: str = "little"
    name: str = ""

    def __repr__(self) -> str:
        return f"<Storage {self.name or '?'} {self.nbytes} bytes from {self.location}>"

    def _check(self, start: int, length: int) -> None:
        if start < 0 or length < 0 or start + length > self.nbytes:
            raise ValueError(f"byte range {start}+{length} outside storage of {self.nbytes} bytes")

    @contextlib.contextmanager
    def reader(self) -> Iterator[ReadInto]:
        """A ``read_into(start, out)`` that keeps the source open for many reads."""
        with self.source.opened() as read_into:

            def checked(start: int, out: memoryview) -> None:
                self._check(start, out.nbytes)
                if out.nbytes:
                    read_into(start, out)

            yield checked

    def read_into(self, start: int, out: memoryview) -> None:
        """Fill ``out`` with the record's bytes from ``start`` (no intermediate copy for files)."""
        with self.reader() as read_into:
            read_into(start, out)

    def read(self, start: int = 0, length: int | None = None) -> bytearray:
        """Raw bytes ``[start, start + length)`` of the record, as stored."""
        if length is None:
            length = self.nbytes - start
        self._check(start, length)
        out = bytearray(length)
        self.read_into(start, memoryview(out))
        return out


_INT64_MAX = 2**63 - 1


def shape_overflows(shape: Iterable[int]) -> bool:
    """True when torch cannot hold a tensor of ``shape``: a size above int64's maximum, or an element count
    ``TensorImpl::safe_compute_numel`` refuses: it multiplies the sizes left to right in uint64 and refuses
    any product that wraps, even one a later zero would bring back to 0 (``(2**62, 2**62, 0)``), and a
    count above int64's maximum ("numel: integer multiplication overflow")."""
    product = 1
    for size in shape:
        if size > _INT64_MAX:
            return True
        product *= size
        if product >= 2**64:
            return True
    return product > _INT64_MAX


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides (in elements) for ``shape``."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


_UNSET = -1  # a cache slot not filled yet


# A checkpoint of 10^6 tensors holds 10^6 of each of these (and a source each), so they keep no
# ``__dict__``: with ``__slots__`` a TensorRef is 136 bytes, where its dict made it 208, and 888 once its cached
# properties were filled (issue #31, "Plain data that balloons").
@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor that has not been read: a view into a :class:`Storage`.

    Attributes:
        storage: the bytes this tensor views.
        dtype: the element type of the stored bytes.
        shape: sizes, as in ``torch.Tensor.shape``.
        stride: strides in elements, as in ``torch.Tensor.stride()``.
        offset: storage offset in elements of ``dtype``.
        cast_to: the dtype this tensor will have when written, if a cast is
            pending; see :meth:`cast`.
        origin: ``"torch"`` for tensors, ``"numpy"`` for numpy arrays found in a pickle.
        allow_overflow: under a cast, let finite values beyond the target's
            range become inf instead of raising :class:`CastOverflowError`.
        conj: the conjugate bit (``Tensor.is_conj()``): the tensor's values are
            the complex conjugates of the stored ones.
        neg: the negative bit (``Tensor.is_neg()``): the values are the stored
            ones negated. Readers apply both bits, so every byte a writer gets
            is a value torch would show.
    """

    storage: Storage
    dtype: DType
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int = 0
    cast_to: DType | None = None
    origin: str = "torch"
    allow_overflow: bool = False
    conj: bool = False
    neg: bool = False
    # Caches of the shape facts below, computed on first use (slots cannot hold a cached_property).
    _numel: int = field(default=_UNSET, init=False, repr=False, compare=False)
    _span: tuple[int, int] | None = field(default=None, init=False, repr=False, compare=False)
    _contiguous: bool | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def checked(
        cls,
        storage: Storage,
        dtype: DType,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
        offset: int = 0,
        *,
        origin: str = "torch",
        conj: bool = False,
        neg: bool = False,
    ) -> TensorRef:
        """A TensorRef after the bounds checks ``torch.Tensor.set_`` does.

        Raises:
            MalformedCheckpointError: the view reaches outside its storage, its
                sizes are not non-negative integers, or it carries a conj or neg
                bit its dtype cannot have.
        """
        if conj and dtype.kind != "complex":
            raise MalformedCheckpointError(
                f"a {dtype.name} tensor carries the conjugate bit, which only complex tensors have; "
                "the checkpoint is damaged"
            )
        if neg and not dtype.negatable:
            raise MalformedCheckpointError(
                f"a {dtype.name} tensor carries the negative bit, which torch cannot apply to {dtype.name}; "
                "the checkpoint is damaged"
            )
        ints_ok = all(type(v) is int and 0 <= v <= _INT64_MAX for v in (*shape, *stride, offset))
        if not ints_ok or len(shape) != len(stride) or len(shape) > 64:
            raise MalformedCheckpointError(
                f"tensor view (size {shape}, stride {stride}, offset {offset}) is invalid; the checkpoint is damaged"
            )
        if shape_overflows(shape):
            raise MalformedCheckpointError(
                f"tensor of size {list(shape)} has more elements than an int64 counts (torch.load refuses it: "
                "'numel: integer multiplication overflow'); the checkpoint is damaged"
            )
        ref = cls(storage, dtype, tuple(shape), tuple(stride), offset, origin=origin, conj=conj, neg=neg)
        end = ref.byte_span[1]
        if end > storage.nbytes:
            raise MalformedCheckpointError(
                f"tensor of size {list(shape)} and stride {list(stride)} at offset {offset} "
                f"needs {end} bytes but its storage {storage.name or ''!s} holds only "
                f"{storage.nbytes}; the checkpoint is damaged"
            )
        return ref

    def __repr__(self) -> str:
        cast = f" -> {self.cast_to.name}" if self.cast_to else ""
        bits = (" conj" if self.conj else "") + (" neg" if self.neg else "")
        return f"<TensorRef {self.dtype.name}{list(self.shape)}{bits}{cast} in {self.storage!r}>"

    # -- shape facts -----------------------------------------------------------------

    @property
    def numel(self) -> int:
        numel = self._numel
        if numel == _UNSET:
            numel = math.prod(self.shape)
            object.__setattr__(self, "_numel", numel)
        return numel

    @property
    def out_dtype(self) -> DType:
        """The dtype this tensor has once written (after any pending cast)."""
        return self.cast_to or self.dtype

    @property
    def nbytes(self) -> int:
        """Bytes this tensor occupies once written contiguously in ``out_dtype``."""
        return self.numel * self.out_dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        """True when the elements are laid out row-major with no gaps."""
        contiguous = self._contiguous
        if contiguous is None:
            contiguous = self._row_major()
            object.__setattr__(self, "_contiguous", contiguous)
        return contiguous

    def _row_major(self) -> bool:
        expected = 1
        for size, step in zip(reversed(self.shape), reversed(self.stride)):
            if size == 1:
                continue
            if step != expected:
                return False
            expected *= size
        return True

    @property
    def byte_span(self) -> tuple[int, int]:
        """``(start, end)`` bytes of the storage this tensor touches; ``(0, 0)`` if it is empty.

        An empty tensor touches no byte, so its offset may lie anywhere, past the
        storage's end included, as torch allows (``torch.empty(0, 6).chunk(3, dim=1)``
        gives offsets 2 and 4 into a storage of no bytes).
        """
        span = self._span
        if span is None:
            span = self._compute_span()
            object.__setattr__(self, "_span", span)
        return span

    def _compute_span(self) -> tuple[int, int]:
        if self.numel == 0:
            return 0, 0
        itemsize = self.dtype.itemsize
        start = self.offset * itemsize
        last = sum((size - 1) * step for size, step in zip(self.shape, self.stride))
        return start, start + (last + 1) * itemsize

    @property
    def is_stored_as_is(self) -> bool:
        """True when the stored bytes are the values: no conj or neg bit to apply, no cast."""
        return not (self.conj or self.neg) and self.cast_to is None

    @property
    def is_whole_storage(self) -> bool:
        """True when this tensor is contiguous and covers its storage exactly."""
        return self.is_contiguous and self.byte_span == (0, self.storage.nbytes)

    @property
    def verbatim_region(self) -> tuple[StoredRegion, int, int] | None:
        """``(region, start, length)`` when the bytes this tensor writes are a run of its file as stored.

        That is, a file-backed, contiguous, little-endian tensor with no cast
        and no conj or neg bit: writers move those bytes in the kernel instead
        of through Python.
        """
        source = self.storage.source.stored_region()
        if source is not None and self.is_stored_as_is and self.is_contiguous and self.storage.byteorder == "little":
            start, stop = self.byte_span
            return source, start, stop - start
        return None

    def cast(self, dtype: DType, *, allow_overflow: bool = False) -> TensorRef:
        """This tensor, to be converted to ``dtype`` when its bytes are read."""
        if dtype == self.dtype:
            return dataclasses.replace(self, cast_to=None, allow_overflow=False)
        return dataclasses.replace(self, cast_to=dtype, allow_overflow=allow_overflow)

    # -- reading (ckptconv.reading.streaming does the work) -------------------------------------

    def numpy(self) -> Array:
        """The tensor's elements, contiguous, in ``out_dtype``'s storage representation.

        bfloat16 and float8 come back as unsigned integers of the same width,
        since numpy has no such types; ``.tobytes()`` gives what a writer stores.
        """
        return self.storage.source.tensor_array(self)

    def torch(self) -> Any:
        """This tensor read into a CPU ``torch.Tensor`` (imports torch)."""
        return self.storage.source.torch_tensor(self)

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        """Let torch take a lazy tensor wherever it takes a tensor: its bytes are read then.

        So a lazy state dict composes with torch: ``model.load_state_dict(fitted)``
        after ``fitted, _ = ckptconv.fit(ckpt.select().weights, model)`` reads one
        tensor at a time as it copies it into the model.
        """

        def read(value: Any) -> Any:
            if isinstance(value, TensorRef):
                return value.torch()
            if isinstance(value, (list, tuple)):
                return type(value)(read(item) for item in value)
            return value

        return func(*read(tuple(args)), **{key: read(value) for key, value in (kwargs or {}).items()})

    def tobytes(self) -> bytes:
        """The tensor's bytes as a writer stores them: contiguous, little-endian, ``out_dtype``."""
        return self.numpy().tobytes()

    def iter_bytes(
        self, chunk_bytes: int | None = None, *, record_crcs: dict[Storage, int] | None = None
    ) -> Iterator[memoryview]:
        """The bytes of :meth:`tobytes` in pieces of about ``chunk_bytes``, through reused buffers.

        Each chunk is only valid until the next one is asked for; see
        :func:`ckptconv.reading.streaming.iter_bytes` (and for ``record_crcs``).
        """
        return self.storage.source.tensor_bytes(self, chunk_bytes, record_crcs)
