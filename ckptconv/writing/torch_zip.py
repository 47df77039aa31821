"""Writing torch's zip checkpoint format (what torch.load reads since torch 1.6): storages planned, records aligned.

ckptconv writes the zip and the pickle itself (no torch import): :func:`plan_storages` decides which bytes
become which storage record (pure), :func:`write` streams them. The reading side is
:mod:`ckptconv.reading.formats.torch_zip`."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import struct
import zlib
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

from ckptconv.dtypes import DType
from ckptconv.reading.formats._base import MetadataValue, json_bytes, metadata_text
from ckptconv.reading.formats.torch_zip import METADATA_RECORD
from ckptconv.values.tensor import TensorRef, contiguous_strides

ALIGNMENT = 64


PAGE = 4096

# Records at least this big are placed at their source's page phase (see _local_header).
PHASE_MATCH_BYTES = 1 << 20

#: Records up to this size are filled in memory and written with their CRC-32 in the header,
#: instead of patching the header afterwards (two seeks, each a flush: per tensor, that was most
#: of the cost of writing 10^5 small ones). Fillers must not need a file descriptor for them.
BUFFERED_RECORD = 64 << 10

ROOT = "archive"

_ZIP64_LIMIT = 0xFFFFFFFF


# One of each a tensor (10^6 in a checkpoint of many small tensors): no __dict__ each (issue #31).
@dataclass(frozen=True, slots=True)
class PlannedStorage:
    """One storage record of the output, described as the tensor whose bytes fill it.

    ``tensor`` is either a 1-D range of a source storage (tensors overlapping
    there keep sharing it) or one strided view gathered into contiguous bytes
    (a sparse view of a big storage). Either way the record holds exactly
    ``tensor.iter_bytes()``, cast included.
    """

    tensor: TensorRef

    @property
    def dtype(self) -> DType:
        return self.tensor.out_dtype

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    key: str
    storage_index: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: DType


# A group of overlapping views is gathered into compact copies when the bytes
# its views span exceed the bytes they hold by this factor (pytorch/pytorch#53419).
SPARSE_SPAN_FACTOR = 2

#: What :func:`plan_storages` decides: the output storages, and each tensor as a view of one.
Plan = tuple[list[PlannedStorage], list[PlannedTensor]]


def plan_storages(entries: Sequence[tuple[str, TensorRef]]) -> Plan:
    """Decide which bytes become which output storage; pure, no I/O.

    Tensors that overlap in their source storage share one output storage
    (tied weights and views stay tied), and bytes no tensor touches are left
    out, so a small view of a huge tensor costs only its own bytes. When views
    are sparse (a column of a big matrix spans almost all of it), each distinct
    view is gathered into its own compact storage instead.
    """
    # Views share an output storage only when their bytes are written alike: the
    # same dtypes, cast and conj/neg bits (the bits are applied to the bytes).
    groups: dict[tuple[int, str, str, bool, bool, bool], list[tuple[int, str, TensorRef]]] = {}
    for index, (key, ref) in enumerate(entries):
        group_key = (id(ref.storage), ref.dtype.name, ref.out_dtype.name, ref.allow_overflow, ref.conj, ref.neg)
        groups.setdefault(group_key, []).append((index, key, ref))

    storages: list[PlannedStorage] = []
    planned: list[PlannedTensor | None] = [None] * len(entries)

    def add_range(members: list[tuple[int, str, TensorRef]]) -> None:
        first = members[0][2]
        itemsize = first.dtype.itemsize
        start = min(m[2].byte_span[0] for m in members)
        stop = max(m[2].byte_span[1] for m in members)
        whole = dataclasses.replace(first, shape=((stop - start) // itemsize,), stride=(1,), offset=start // itemsize)
        storages.append(PlannedStorage(whole))
        for index, key, ref in members:
            planned[index] = PlannedTensor(
                key, len(storages) - 1, ref.offset - start // itemsize, ref.shape, ref.stride, ref.out_dtype
            )

    def add_gathered(members: list[tuple[int, str, TensorRef]]) -> None:
        by_view: dict[TensorRef, int] = {}
        for index, key, ref in members:
            if ref not in by_view:
                storages.append(PlannedStorage(ref))
                by_view[ref] = len(storages) - 1
            planned[index] = PlannedTensor(
                key, by_view[ref], 0, ref.shape, contiguous_strides(ref.shape), ref.out_dtype
            )

    def flush(members: list[tuple[int, str, TensorRef]]) -> None:
        if not members:
            return
        start = min(m[2].byte_span[0] for m in members)
        stop = max(m[2].byte_span[1] for m in members)
        distinct = {m[2] for m in members}
        held = sum(ref.numel * ref.dtype.itemsize for ref in distinct)
        if stop - start > SPARSE_SPAN_FACTOR * held:
            add_gathered(members)
        else:
            add_range(members)

    for members in groups.values():
        members.sort(key=lambda m: m[2].byte_span)
        current: list[tuple[int, str, TensorRef]] = []
        current_stop = -1
        for member in members:
            span_start, span_stop = member[2].byte_span
            if span_start == span_stop:  # empty tensors share nothing
                flush([member])
                continue
            if current and span_start >= current_stop:
                flush(current)
                current = []
            current.append(member)
            current_stop = max(current_stop, span_stop)
        flush(current)
    return storages, [p for p in planned if p is not None]


class PickleWriter:
    """Writes the protocol-2 pickle torch.save would write for a dict of tensors, or for one tensor;
    :mod:`ckptconv.writing.dcp` builds a DCP ``.metadata`` with its opcodes too."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")
        self.memo: dict[object, int] = {}

    def memoized(self, key: object, emit: Callable[[], None]) -> None:
        """The object ``emit`` pushes, pushed once and fetched from the memo (BINGET) after that."""
        slot = self.memo.get(key)
        if slot is not None:
            self.out += b"h" + bytes([slot]) if slot < 256 else b"j" + struct.pack("<I", slot)
            return
        emit()
        slot = len(self.memo)
        self.memo[key] = slot
        self.out += b"q" + bytes([slot]) if slot < 256 else b"r" + struct.pack("<I", slot)

    def _int(self, value: int) -> None:
        if 0 <= value < 0x100:
            self.out += b"K" + bytes([value])
        elif 0 <= value < 0x10000:
            self.out += b"M" + struct.pack("<H", value)
        elif -0x80000000 <= value < 0x80000000:
            self.out += b"J" + struct.pack("<i", value)
        else:
            raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            self.out += b"\x8a" + bytes([len(raw)]) + raw

    def _str(self, value: str) -> None:
        raw = value.encode("utf-8", "surrogatepass")
        self.out += b"X" + struct.pack("<I", len(raw)) + raw

    def _global(self, module: str, name: str) -> None:
        full = f"{module}\n{name}\n"

        def emit() -> None:
            self.out += b"c" + full.encode("ascii")

        self.memoized(full, emit)

    def _int_tuple(self, values: tuple[int, ...]) -> None:
        if not values:
            self.out += b")"
            return
        if len(values) > 3:
            self.out += b"("
        for value in values:
            self._int(value)
        self.out += {1: b"\x85", 2: b"\x86", 3: b"\x87"}.get(len(values), b"t")

    def tensor(self, tensor: PlannedTensor, storage: PlannedStorage, storage_key: str) -> None:
        typed = tensor.dtype.storage_class is not None
        self._global("torch._utils", "_rebuild_tensor_v2" if typed else "_rebuild_tensor_v3")
        self.out += b"("  # MARK: rebuild arguments
        self.out += b"("  # MARK: persistent id
        self._str("storage")
        if typed:
            self._global("torch", tensor.dtype.storage_class or "")
            numel = storage.tensor.numel
        else:
            self._global("torch.storage", "UntypedStorage")
            numel = storage.nbytes
        self._str(storage_key)
        self._str("cpu")
        self._int(numel)
        self.out += b"tQ"  # TUPLE, BINPERSID
        self._int(tensor.offset)
        self._int_tuple(tensor.shape)
        self._int_tuple(tensor.stride)
        self.out += b"\x89"  # requires_grad=False
        self._global("collections", "OrderedDict")
        self.out += b")R"  # OrderedDict() for backward hooks
        if not typed:
            self._global("torch", tensor.dtype.name)
        self.out += b"tR"

    def value(self, value: Any) -> None:
        """Plain data, as torch.load(weights_only=True) gives it back: None, bool, numbers (complex too),
        str, bytes, bytearray, tuple, list, set, dict, OrderedDict, Counter."""
        if value is None:
            self.out += b"N"
        elif isinstance(value, bool):
            self.out += b"\x88" if value else b"\x89"
        elif isinstance(value, int):
            self._int(value)
        elif isinstance(value, float):
            self.out += b"G" + struct.pack(">d", value)
        elif isinstance(value, str):
            self._str(value)
        elif isinstance(value, tuple):
            self.out += b"("  # MARK
            for item in value:
                self.value(item)
            self.out += b"t"  # TUPLE
        elif isinstance(value, list):
            self.out += b"]("
            for item in value:
                self.value(item)
            self.out += b"e"  # APPENDS
        elif type(value) is set:
            self._global("builtins", "set")  # set(list), as weights_only allows
            self.value(list(value))
            self.out += b"\x85R"  # TUPLE1, REDUCE
        elif type(value) is complex:
            self._global("builtins", "complex")
            self.out += b"G" + struct.pack(">d", value.real) + b"G" + struct.pack(">d", value.imag) + b"\x86R"
        elif type(value) in (bytes, bytearray):
            if type(value) is bytearray:
                self._global("builtins", "bytearray")
            self._global("_codecs", "encode")  # bytes as protocol 2 writes them: encode(text, 'latin1')
            self._str(bytes(value).decode("latin-1"))
            self._str("latin1")
            self.out += b"\x86R"  # TUPLE2, REDUCE
            if type(value) is bytearray:
                self.out += b"\x85R"
        elif type(value) in (OrderedDict, Counter):
            self._global("collections", type(value).__name__)
            self.out += b")R("  # an empty one, then SETITEMS
            for key, item in value.items():
                self.value(key)
                self.value(item)
            self.out += b"u"
        elif isinstance(value, dict):
            self.out += b"}("
            for key, item in value.items():
                self.value(key)
                self.value(item)
            self.out += b"u"
        else:
            raise TypeError(f"cannot pickle {type(value).__name__} as plain data")

    def _tensors(self, tensors: Sequence[PlannedTensor], storages: Sequence[PlannedStorage]) -> None:
        self.out += b"}"  # EMPTY_DICT
        for batch_start in range(0, len(tensors), 1000):
            self.out += b"("
            for tensor in tensors[batch_start : batch_start + 1000]:
                self._str(tensor.key)
                self.tensor(tensor, storages[tensor.storage_index], str(tensor.storage_index))
            self.out += b"u"  # SETITEMS

    def single(self, tensor: PlannedTensor, storage: PlannedStorage) -> bytes:
        """One tensor, as ``torch.save(tensor)`` pickles it: the tensor itself, its storage record ``0``."""
        self.tensor(tensor, storage, "0")
        self.out += b"."
        return bytes(self.out)

    def checkpoint(
        self, tensors: Sequence[PlannedTensor], storages: Sequence[PlannedStorage], extra: Mapping[str, Any] | None
    ) -> bytearray:
        """A state dict, or ``{"state_dict": ..., **extra}`` when there is plain data to keep beside it."""
        if extra:
            self.out += b"}("
            self._str("state_dict")
            self._tensors(tensors, storages)
            for key, value in extra.items():
                self._str(key)
                self.value(value)
            self.out += b"u"
        else:
            self._tensors(tensors, storages)
        self.out += b"."
        return self.out  # not bytes(self.out): a second copy of a pickle of 10^6 tensors (86 MB)


class _ZipWriter:
    """A minimal zip writer with torch's 64-byte data alignment and ZIP64 support."""

    def __init__(self, file: BinaryIO, *, base: int = 0) -> None:
        self.file = file
        # Where the archive starts in the file: its offsets count from there (torch.save writing at a
        # file's current position counts from there too, and torch.load of that slice reads them so).
        self.base = base
        self.entries: list[tuple[bytes, int, int, int]] = []  # name, crc, size, header offset

    def _tell(self) -> int:
        return self.file.tell() - self.base

    def _local_header(self, name: bytes, size: int, crc: int, offset: int, phase: int | None = None) -> bytes:
        zip64 = size >= _ZIP64_LIMIT
        extra = struct.pack("<HHQQ", 0x0001, 16, size, size) if zip64 else b""
        data_start = offset + 30 + len(name) + len(extra)
        # torch aligns record data to 64 bytes. Copies run fastest when the
        # output offset has the same position within a page as the input's
        # (page-level copies, no 4K-aliasing in memcpy), so big records may ask
        # for a page phase, which is then also 64-aligned.
        # The phase is the file's, so an archive that starts inside the file (a DCP record) can take it
        # only from a 64-byte boundary, where its own offsets stay 64-aligned.
        paged = False
        padding = -data_start % ALIGNMENT
        if phase is not None and phase % ALIGNMENT == 0 and self.base % ALIGNMENT == 0:
            paged = True
            padding = (phase - self.base - data_start) % PAGE
        if padding:
            if padding < 4:
                padding += PAGE if paged else ALIGNMENT
            extra += struct.pack("<HH", 0x4246, padding - 4) + b"Z" * (padding - 4)  # torch's "FB" pad
        field_size = _ZIP64_LIMIT if zip64 else size
        version = 45 if zip64 else 20
        return (
            struct.pack(
                "<IHHHHHIIIHH", 0x04034B50, version, 0, 0, 0, 0x21, crc, field_size, field_size, len(name), len(extra)
            )
            + name
            + extra
        )

    def write_record(self, name: str, size: int, fill: Callable[[BinaryIO], int], *, phase: int | None = None) -> None:
        """Write one stored record; ``fill`` writes exactly ``size`` bytes and returns their CRC-32.

        ``phase``, if given, is the data's preferred offset modulo the page size.
        """
        encoded = name.encode("utf-8")
        offset = self._tell()
        if size <= BUFFERED_RECORD:
            buffer = io.BytesIO()
            crc = fill(buffer)
            if buffer.tell() != size:
                raise AssertionError(f"record {name} wrote {buffer.tell()} bytes, planned {size}")
            self.file.write(self._local_header(encoded, size, crc, offset, phase))
            self.file.write(buffer.getbuffer())
            self.entries.append((encoded, crc, size, offset))
            return
        self.file.write(self._local_header(encoded, size, 0, offset, phase))
        data_start = self.file.tell()
        crc = fill(self.file)
        end = self.file.tell()
        if end - data_start != size:
            raise AssertionError(f"record {name} wrote {end - data_start} bytes, planned {size}")
        # The CRC is known only now; patch it into the local header.
        self.file.seek(self.base + offset + 14)
        self.file.write(struct.pack("<I", crc))
        self.file.seek(end)
        self.entries.append((encoded, crc, size, offset))

    def content_id(self) -> str:
        """40 hex digits that name what was written so far (every record's name, size and CRC-32).

        torch.save draws its serialization id at random; deriving it from the content keeps
        ckptconv's outputs byte for byte reproducible (same input, same options, same file) while
        files with other content still get other ids.
        """
        digest = hashlib.blake2b(digest_size=20)
        for name, crc, size, _offset in self.entries:
            digest.update(struct.pack("<IQI", crc, size, len(name)) + name)
        return digest.hexdigest()

    def write_bytes(self, name: str, data: bytes | bytearray) -> None:
        def fill(file: BinaryIO) -> int:
            file.write(data)
            return zlib.crc32(data)

        self.write_record(name, len(data), fill)

    def close(self) -> None:
        directory_start = self._tell()
        for name, crc, size, offset in self.entries:
            extra_fields = []
            if size >= _ZIP64_LIMIT:
                extra_fields += [size, size]
            if offset >= _ZIP64_LIMIT:
                extra_fields.append(offset)
            extra = (
                struct.pack("<HH", 0x0001, 8 * len(extra_fields)) + struct.pack(f"<{len(extra_fields)}Q", *extra_fields)
                if extra_fields
                else b""
            )
            zip64 = bool(extra_fields)
            field_size = _ZIP64_LIMIT if size >= _ZIP64_LIMIT else size
            field_offset = _ZIP64_LIMIT if offset >= _ZIP64_LIMIT else offset
            self.file.write(
                struct.pack(
                    "<IHHHHHHIIIHHHHHII",
                    0x02014B50,
                    45 if zip64 else 20,
                    45 if zip64 else 20,
                    0,
                    0,
                    0,
                    0x21,
                    crc,
                    field_size,
                    field_size,
                    len(name),
                    len(extra),
                    0,
                    0,
                    0,
                    0,
                    field_offset,
                )
                + name
                + extra
            )
        directory_end = self._tell()
        directory_size = directory_end - directory_start
        count = len(self.entries)
        if count >= 0xFFFF or directory_start >= _ZIP64_LIMIT or directory_size >= _ZIP64_LIMIT:
            self.file.write(
                struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, directory_size, directory_start)
            )
            self.file.write(struct.pack("<IIQI", 0x07064B50, 0, directory_end, 1))
            self.file.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, _ZIP64_LIMIT, _ZIP64_LIMIT, 0))
        else:
            self.file.write(
                struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, directory_size, directory_start, 0)
            )


def write(
    entries: Sequence[tuple[str, TensorRef]],
    file: BinaryIO,
    *,
    write_storage: Callable[[PlannedStorage, BinaryIO], int],
    metadata: Mapping[str, MetadataValue] | None = None,
    extra: Mapping[str, Any] | None = None,
    plan: Plan | None = None,
) -> int:
    """Write ``entries`` as a torch zip checkpoint that ``torch.load(weights_only=True)`` reads.

    Args:
        entries: ``(key, tensor)`` pairs in output order.
        file: a seekable binary file opened for writing.
        write_storage: writes one planned storage's bytes (cast applied) to the
            file and returns their CRC-32; the caller owns the fast copy path.
        metadata: string metadata, stored as the JSON record ``<root>/ckptconv.json``
            (torch.load ignores records it does not know; ckptconv reads it back).
        extra: plain data to pickle beside the weights, which then sit under
            ``"state_dict"``.
        plan: :func:`plan_storages` of ``entries``, if the caller has made it already.

    Returns:
        The number of tensor bytes written.
    """
    storages, tensors = plan or plan_storages(entries)
    writer = _ZipWriter(file)
    _write_archive(writer, PickleWriter().checkpoint(tensors, storages, extra), storages, write_storage, metadata)
    return sum(storage.nbytes for storage in storages)


def write_tensor(ref: TensorRef, file: BinaryIO, *, write_storage: Callable[[PlannedStorage, BinaryIO], int]) -> int:
    """Write one tensor as ``torch.save(tensor, file)`` does, from ``file``'s position on: a record of a
    DCP data file, which torch's reader hands to ``torch.load`` as a slice of the file.

    The archive holds one storage: the tensor's bytes (a view keeps its strides over the part of its
    storage it spans, a sparse view is gathered, as :func:`plan_storages` decides). Offsets inside
    the archive count from its start. Records of big tensors keep their source's page phase only
    when the archive starts at a 64-byte boundary of the file (:class:`_ZipWriter`).

    Returns:
        The bytes the archive takes in ``file``.
    """
    storages, tensors = plan_storages([("", ref)])
    start = file.tell()
    writer = _ZipWriter(file, base=start)
    _write_archive(writer, PickleWriter().single(tensors[0], storages[0]), storages, write_storage, None)
    return file.tell() - start


def _write_archive(
    writer: _ZipWriter,
    pickled: bytes | bytearray,
    storages: Sequence[PlannedStorage],
    write_storage: Callable[[PlannedStorage, BinaryIO], int],
    metadata: Mapping[str, MetadataValue] | None,
) -> None:
    """The records torch.save writes, in its order, around ``pickled`` (data.pkl) and the storages."""
    writer.write_bytes(f"{ROOT}/data.pkl", pickled)
    writer.write_bytes(f"{ROOT}/.format_version", b"1")
    writer.write_bytes(f"{ROOT}/.storage_alignment", str(ALIGNMENT).encode())
    writer.write_bytes(f"{ROOT}/byteorder", b"little")
    for index, storage in enumerate(storages):
        phase = source_phase(storage.tensor) if storage.nbytes >= PHASE_MATCH_BYTES else None
        writer.write_record(
            f"{ROOT}/data/{index}", storage.nbytes, functools.partial(write_storage, storage), phase=phase
        )
    writer.write_bytes(f"{ROOT}/version", b"3\n")
    if metadata:
        resolved = {key: metadata_text(value) for key, value in metadata.items()}
        writer.write_bytes(f"{ROOT}/{METADATA_RECORD}", json_bytes(resolved))
    writer.write_bytes(f"{ROOT}/.data/serialization_id", writer.content_id().encode())
    writer.close()


def source_phase(ref: TensorRef) -> int | None:
    """Where a tensor's first byte sits within a page of its source file, if it is copied as is."""
    region = ref.verbatim_region
    return None if region is None else (region[0].offset + region[1]) % PAGE
