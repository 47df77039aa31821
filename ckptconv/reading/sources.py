"""Byte sources: where a storage's bytes are, and how the tensors that view them are read.

:class:`~ckptconv.values.tensor.Storage` is a value; its ``source`` is one of these. Each source
opens what it reads through the read policy, and reads the tensors on it (:meth:`Source.tensor_array`,
:meth:`Source.tensor_bytes`, :meth:`Source.torch_tensor`) with :mod:`ckptconv.reading.streaming`, which is why
the value layer needs no I/O of its own.
"""

from __future__ import annotations

import contextlib
import math
import os
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ckptconv.dtypes import DType
from ckptconv.errors import MalformedCheckpointError, UnsupportedFormatError
from ckptconv.reading import read_policy, streaming, torch_views
from ckptconv.values.tensor import ReadInto, Storage, TensorRef, contiguous_strides

if TYPE_CHECKING:
    from ckptconv.transforms.casts import Array

__all__ = [
    "Computed",
    "FileRegion",
    "InMemory",
    "Source",
    "Unreadable",
    "ZipMember",
    "computed_tensor",
    "read_exactly_into",
]


class Source:
    """What every byte source shares: reading the tensors on it (the methods of :class:`TensorRef` call these)."""

    __slots__ = ()  # so a subclass with slots (FileRegion: one per safetensors tensor) keeps no __dict__

    #: The CRC-32 the file records for the whole storage (zip records); None where it records none.
    crc32: int | None = None
    #: Reads go front to back (a compressed stream): two threads reading out of order would rewind it.
    in_order = False

    def stored_region(self) -> FileRegion | None:
        """This source, when its bytes are an uncompressed run of a file."""
        return None

    def tensor_array(self, ref: TensorRef) -> Array:
        return streaming.read_array(ref)

    def tensor_bytes(
        self, ref: TensorRef, chunk_bytes: int | None, record_crcs: dict[Storage, int] | None
    ) -> Iterator[memoryview]:
        return streaming.iter_bytes(ref, chunk_bytes, record_crcs=record_crcs)

    def torch_tensor(self, ref: TensorRef) -> Any:
        return torch_views.cpu_tensor(ref)


@dataclass(frozen=True, slots=True)
class FileRegion(Source):
    """Bytes stored uncompressed at ``offset`` in the file at ``path``.

    ``crc32`` is the CRC-32 the source format recorded for the whole storage
    (zip records have one), which lets a verbatim copy skip recomputing it.
    """

    path: str
    offset: int
    crc32: int | None = None

    @contextlib.contextmanager
    def opened(self) -> Iterator[ReadInto]:
        with read_policy.descriptor(self.path) as fd:

            def read_into(start: int, out: memoryview) -> None:
                read_exactly_into(fd, self.offset + start, out, self.path)

            yield read_into

    def paths(self) -> frozenset[str]:
        return frozenset({self.path})

    def stored_region(self) -> FileRegion:
        return self


# What zipfile raises on a damaged compressed member: a corrupt deflate stream
# (zlib.error), a stream that ends early (EOFError), a wrong CRC-32 (BadZipFile).
_DECOMPRESS_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, KeyError, ValueError, RuntimeError)


@dataclass(frozen=True)
class ZipMember(Source):
    """A compressed zip member: read by decompressing from its start.

    ``crc32`` is the CRC-32 the archive records for the member's bytes.
    """

    path: str
    name: str
    crc32: int | None = None
    in_order = True

    @contextlib.contextmanager
    def opened(self) -> Iterator[ReadInto]:
        """Reads over one open member: chunk after chunk decompresses the member once
        (reopening it per chunk made a large record cost quadratic time)."""
        file = read_policy.open_file(self.path)
        try:
            archive = zipfile.ZipFile(file)
            member = archive.open(self.name)
        except _DECOMPRESS_ERRORS as error:
            file.close()
            raise self._damaged(error) from None
        except BaseException:
            file.close()
            raise

        def read_into(start: int, out: memoryview) -> None:
            try:
                if member.tell() != start:
                    member.seek(start)
                data = member.read(out.nbytes)
            except _DECOMPRESS_ERRORS as error:
                raise self._damaged(error) from None
            if len(data) != out.nbytes:
                raise MalformedCheckpointError(
                    f"{self.path!r} is truncated: record {self.name!r} ends early; the file is damaged",
                    path=self.path,
                )
            out.cast("B")[:] = data

        with file, archive, member:
            yield read_into

    def paths(self) -> frozenset[str]:
        return frozenset({self.path})

    def _damaged(self, error: BaseException) -> MalformedCheckpointError:
        return MalformedCheckpointError(
            f"{self.path!r} is a damaged zip checkpoint: record {self.name!r} cannot be decompressed ({error})",
            path=self.path,
        )


@dataclass(frozen=True, eq=False)
class InMemory(Source):
    """Bytes already in memory (numpy arrays inside a pickle, tensors handed to ``save``)."""

    data: bytes | bytearray | memoryview

    @contextlib.contextmanager
    def opened(self) -> Iterator[ReadInto]:
        def read_into(start: int, out: memoryview) -> None:
            out.cast("B")[:] = memoryview(self.data).cast("B")[start : start + out.nbytes]

        yield read_into

    def paths(self) -> frozenset[str]:
        return frozenset()


@dataclass(frozen=True, eq=False)
class Unreadable(Source):
    """A storage's bytes that ckptconv refuses to read: every read raises ``reason``.

    The tensors on it can still be listed and left out of a conversion; the refusal
    comes only when one of them is read (converted, verified, loaded).
    """

    reason: str
    files: frozenset[str]  # the source's files, which a writer must still never overwrite

    @contextlib.contextmanager
    def opened(self) -> Iterator[ReadInto]:
        raise UnsupportedFormatError(self.reason)
        yield  # pragma: no cover - a generator, for contextmanager

    def paths(self) -> frozenset[str]:
        return self.files


def read_exactly_into(fd: int, offset: int, out: memoryview, path: str) -> None:
    """Fill ``out`` from ``fd`` at ``offset`` without an intermediate copy; a short read means a truncated file."""
    out = out.cast("B")
    filled = 0
    while filled < len(out):
        count = os.preadv(fd, [out[filled : filled + (1 << 30)]], offset + filled)
        if count <= 0:
            raise MalformedCheckpointError(
                f"{path!r} is truncated: {len(out) - filled} bytes missing at offset {offset + filled}; "
                "the file is damaged or still being written",
                path=path,
            )
        filled += count


@dataclass(frozen=True, eq=False)
class Computed(Source):
    """Bytes of ``compute(inputs)``: a contiguous array in the output dtype's storage representation.

    A dequantized weight, a split of a fused one: computed whole once per ``opened()`` and served in
    byte ranges while it stays open, so a writer streams it with memory bounded by that one tensor,
    its inputs and the temporaries of its formula.

    Attributes:
        compute: takes the inputs' arrays (``TensorRef.numpy()``, by name) and returns the result.
        inputs: the quantized tensors the result is made of, by role (``"weight"``, ``"scale"``).
        nbytes: the size the result must have, checked on every computation.
    """

    compute: Callable[[Mapping[str, Array]], Array]
    inputs: Mapping[str, TensorRef]
    nbytes: int

    @contextlib.contextmanager
    def opened(self) -> Iterator[ReadInto]:
        arrays = {role: ref.numpy() for role, ref in self.inputs.items()}
        result = np.ascontiguousarray(self.compute(arrays))
        del arrays
        data = result.reshape(-1).data.cast("B")
        if data.nbytes != self.nbytes:
            raise RuntimeError(f"computed {data.nbytes} bytes where {self.nbytes} were planned")  # a bug

        def read_into(start: int, out: memoryview) -> None:
            out.cast("B")[:] = data[start : start + out.nbytes]

        try:
            yield read_into
        finally:
            data.release()

    def paths(self) -> frozenset[str]:
        files: frozenset[str] = frozenset()
        for ref in self.inputs.values():
            files |= ref.storage.source.paths()
        return files


def computed_tensor(
    name: str,
    compute: Callable[[Mapping[str, Array]], Array],
    inputs: Mapping[str, TensorRef],
    dtype: DType,
    shape: tuple[int, ...],
) -> TensorRef:
    """A lazy ``dtype`` tensor of ``shape`` whose bytes are ``compute``'s result on ``inputs``."""
    nbytes = math.prod(shape) * dtype.itemsize
    storage = Storage(nbytes, Computed(compute, dict(inputs), nbytes), name=name)
    return TensorRef(storage, dtype, tuple(shape), contiguous_strides(tuple(shape)))
