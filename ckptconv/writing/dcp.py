"""Writing DCP folders that ``torch.distributed.checkpoint.load`` reads on any number of ranks, without torch.

What torch's ``FileSystemWriter`` writes (``torch/distributed/checkpoint/filesystem.py``: ``_write_item``
and ``finish``; ``metadata.py``), and so what this module writes:

- ``__0_0.distcp``: each tensor whole, as ``torch.save(tensor)`` writes it, one record after the other
  (ckptconv's torch zip writer streams each, :func:`ckptconv.writing.torch_zip.write_tensor`); each
  record starts at a 64-byte boundary, so that big tensors keep their source's page phase.
- ``.metadata``: a pickle of ``Metadata(state_dict_metadata, planner_data, storage_data, version)``,
  written opcode by opcode (:class:`_MetadataWriter`), naming torch's classes as torch's own pickle of
  them does: ``torch.Size`` reduced from a tuple, a dtype as the global ``torch.float32``, the layout
  as ``torch.serialization._get_layout('torch.strided')``, ``TensorProperties`` by the 5-tuple its
  ``__getstate__`` returns (memory format as ``_MEM_FORMAT_ENCODING``), and every dataclass by
  ``cls.__new__`` and its ``__dict__`` (protocol 2's ``copyreg.__newobj__``).

``version`` is the ``"1.0.0"`` torch 2.8 and later write (``CURRENT_DCP_VERSION``); torch 2.4 to 2.7 have no
such field and unpickle it as a plain attribute of the instance, which nothing reads. ``storage_meta``
(the writer's checkpoint id and a random save id) is left out, as torch before 2.4 left it out: torch's
reader puts an empty one in its place. The reading side is :mod:`ckptconv.reading.formats.dcp`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

from ckptconv.dtypes import DType
from ckptconv.errors import CastOverflowError
from ckptconv.reading.formats.dcp import DATA_FILE, METADATA_FILE
from ckptconv.values.tensor import Storage, TensorRef
from ckptconv.writing import copying
from ckptconv.writing import torch_zip as zip_writer
from ckptconv.writing.copying import overflow_named
from ckptconv.writing.torch_zip import PickleWriter, PlannedStorage

#: What torch 2.8 and later write as ``Metadata.version`` (``filesystem.CURRENT_DCP_VERSION``).
DCP_VERSION = "1.0.0"

_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"


@dataclass(frozen=True)
class _Record:
    """One tensor of the output: what ``.metadata`` says of it and where its record lies."""

    key: str
    dtype: DType
    shape: tuple[int, ...]
    offset: int
    length: int


def write(
    entries: Sequence[tuple[str, TensorRef]],
    folder: str,
    *,
    open_output: Callable[[str], Any],
    on_bytes: Callable[[int], None],
    record_crcs: dict[Storage, int] | None = None,
) -> int:
    """Write ``entries`` as a DCP folder that ``torch.distributed.checkpoint.load`` reads on any number of ranks.

    Each tensor is saved whole (one chunk, at offset 0) into one data file, its bytes streamed from
    the source (a cast on the way); keys are the fully qualified names.

    Args:
        entries: ``(key, tensor)`` pairs.
        folder: the destination folder.
        open_output: opens a file of the folder for writing atomically (a context manager).
        on_bytes: called with byte counts as they are written, for progress.
        record_crcs: receives the CRC-32 of every zip record of the source read whole on the way, as the
            other writers do (:func:`ckptconv.writing.copying.write_planned_storage`).

    Returns:
        The number of tensor bytes written.

    Raises:
        CastOverflowError: a value does not fit the cast's dtype; the error names the tensor.
    """

    def write_storage(storage: PlannedStorage, out: BinaryIO) -> int:
        return copying.write_planned_storage(storage, out, on_bytes, record_crcs)

    records: list[_Record] = []
    total = 0
    with open_output(DATA_FILE) as data_file:
        for key, ref in entries:
            start = data_file.tell()
            padding = -start % zip_writer.ALIGNMENT
            if padding:
                data_file.write(bytes(padding))
                start += padding
            try:
                length = zip_writer.write_tensor(ref, data_file, write_storage=write_storage)
            except CastOverflowError as error:  # named as every other format's writer names it
                raise overflow_named(error, key) from None
            records.append(_Record(key, ref.out_dtype, ref.shape, start, length))
            total += ref.nbytes
    with open_output(METADATA_FILE) as metadata_file:
        metadata_file.write(_MetadataWriter().metadata(records))
    return total


class _MetadataWriter(PickleWriter):
    """The protocol-2 pickle of the ``Metadata`` torch's ``FileSystemWriter`` would write for these records.

    Strings (keys, field names) and the shared layout and memory-format objects are pushed once and
    fetched from the memo after that, as Python's pickler does.
    """

    def _name(self, text: str) -> None:
        self.memoized(("str", text), lambda: self._str(text))

    def _new(self, module: str, name: str) -> None:
        """``cls.__new__(cls)``, its state to follow and BUILD after it (``copyreg.__newobj__``)."""
        self._global(module, name)
        self.out += b")\x81"  # EMPTY_TUPLE, NEWOBJ

    def _size(self, values: tuple[int, ...]) -> None:
        """``torch.Size(values)``, as torch reduces it."""
        self._global("torch", "Size")
        self._int_tuple(values)
        self.out += b"\x85R"  # TUPLE1, REDUCE

    def _reduced(self, key: str, module: str, name: str, argument: Callable[[], None]) -> None:
        """``module.name(argument)``, made once and fetched from the memo after that."""

        def emit() -> None:
            self._global(module, name)
            argument()
            self.out += b"\x85R"  # TUPLE1, REDUCE

        self.memoized(key, emit)

    def _properties(self, dtype: DType) -> None:
        """``TensorProperties(dtype)``: its state the tuple its ``__getstate__`` returns."""
        self._new(_METADATA, "TensorProperties")
        self.out += b"("  # MARK: (dtype, layout, requires_grad, memory format, pin_memory)
        self._global("torch", dtype.name)
        self._reduced("layout", "torch.serialization", "_get_layout", lambda: self._str("torch.strided"))
        self.out += b"\x89"  # requires_grad=False
        self._reduced("contiguous", _METADATA, "_MEM_FORMAT_ENCODING", lambda: self._int(0))
        self.out += b"\x89tb"  # pin_memory=False, TUPLE, BUILD

    def _tensor_metadata(self, record: _Record) -> None:
        """``TensorStorageMetadata(properties, size, chunks=[ChunkStorageMetadata(zeros, size)])``."""
        self._new(_METADATA, "TensorStorageMetadata")
        self.out += b"}("  # its __dict__
        self._name("properties")
        self._properties(record.dtype)
        self._name("size")
        self._size(record.shape)
        self._name("chunks")
        self.out += b"]"
        self._new(_METADATA, "ChunkStorageMetadata")
        self.out += b"}("
        self._name("offsets")
        self._size((0,) * len(record.shape))
        self._name("sizes")
        self._size(record.shape)
        self.out += b"ub" + b"a"  # SETITEMS, BUILD (the chunk), APPEND
        self.out += b"ub"

    def _storage_entry(self, record: _Record) -> None:
        """``MetadataIndex(key, zeros, 0): _StorageInfo(DATA_FILE, offset, length)``."""
        self._new(_METADATA, "MetadataIndex")
        self.out += b"}("
        self._name("fqn")
        self._name(record.key)
        self._name("index")
        self._int(0)
        self._name("offset")
        self._size((0,) * len(record.shape))
        self.out += b"ub"
        self._new(_FILESYSTEM, "_StorageInfo")
        self.out += b"}("  # what its __getstate__ keeps: no transform_descriptors when there are none
        self._name("relative_path")
        self._name(DATA_FILE)
        self._name("offset")
        self._int(record.offset)
        self._name("length")
        self._int(record.length)
        self.out += b"ub"

    def _dict(self, records: Sequence[_Record], item: Callable[[_Record], None]) -> None:
        self.out += b"}"  # EMPTY_DICT, then SETITEMS in batches as Python's pickler writes them
        for batch_start in range(0, len(records), 1000):
            self.out += b"("
            for record in records[batch_start : batch_start + 1000]:
                item(record)
            self.out += b"u"

    def metadata(self, records: Sequence[_Record]) -> bytes:
        def tensor_item(record: _Record) -> None:
            self._name(record.key)
            self._tensor_metadata(record)

        def planner_item(record: _Record) -> None:
            self._name(record.key)
            self._name(record.key)
            self.out += b"\x85"  # (key,): the path of a top-level entry

        self._new(_METADATA, "Metadata")
        self.out += b"}("
        self._name("state_dict_metadata")
        self._dict(records, tensor_item)
        self._name("planner_data")
        self._dict(records, planner_item)
        self._name("storage_data")
        self._dict(records, self._storage_entry)
        self._name("version")
        self._str(DCP_VERSION)
        self.out += b"ub."  # SETITEMS, BUILD, STOP
        return bytes(self.out)
