"""torch's zip checkpoint format (torch.save since 1.6): reading and writing.

Layout (see ``torch/serialization.py``, ``_save`` and ``_load``)::

    <root>/data.pkl            pickle of the saved object; tensors refer to storages
                               through persistent ids ('storage', StorageType, key, location, numel)
    <root>/data/<key>          each storage's raw little-endian bytes, stored uncompressed,
                               64-byte aligned
    <root>/byteorder           "little" or "big" (absent in old files: little)
    <root>/version, .format_version, .storage_alignment, .data/serialization_id

``<root>`` is whatever the writer chose: ``archive`` for buffers, the file's
stem for paths in torch 1.6 - 2.x, anything in files made by other tools.
TorchScript archives use the same container plus ``constants.pkl`` and
``code/``; they are recognised and refused.

Reading never copies storage bytes: each storage becomes a
:class:`~ckptconv.tensor.FileRegion` at the record's offset in the file.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import re
import struct
import zipfile
import zlib
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

from .. import read_policy
from ..dtypes import DType
from ..errors import MalformedCheckpointError, UnsafeCheckpointError, UnsupportedFormatError
from ..standins import StorageType, TypedStorage, short_repr
from ..tensor import FileRegion, Storage, TensorRef, ZipMember, contiguous_strides
from ..unpickler import DEFAULT_MAX_ITEMS, Unpickler
from ._base import (
    MetadataValue,
    ReadResult,
    check_same_storage_type,
    check_storage_type,
    json_bytes,
    metadata_text,
    pickle_location,
    text_storage_reference,
)

__all__ = ["read", "write"]

FORMAT = "torch-zip"

# data.pkl holds structure, not tensor bytes; a larger one is not a checkpoint.
MAX_PICKLE_BYTES = 2 << 30

# The archive format versions torch.load reads (caffe2/serialize/versions.h, kMinSupportedFileFormatVersion
# and kMaxSupportedFileFormatVersion in torch 2.13); torch.save writes 3. Outside them torch.load refuses.
FORMAT_VERSIONS = range(1, 11)
_MAX_VERSION_BYTES = 4096

# Deflate cannot expand data more than 1032:1 (RFC 1951: 258 bytes per 2-bit
# code at best); a record that claims more is lying about its size, or a zip bomb.
MAX_DEFLATE_RATIO = 1032
# The records read whole into memory (data.pkl, byteorder, version, metadata) may inflate at most this
# much (plus INFLATION_SLACK bytes): torch.save never compresses them, and a re-zipped checkpoint's
# pickle deflates 2-6:1 (7,680 tensors with their Adam state: 4.3:1), where zeros padding a 300 KB
# data.pkl after its STOP took 300 MB to read.
MAX_INFLATION = 64
INFLATION_SLACK = 1 << 20
# torch.load accepts only "little" and "big".
_MAX_BYTEORDER_BYTES = 16

_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    ValueError,
    struct.error,
    EOFError,
    OverflowError,
    NotImplementedError,
    KeyError,
    IndexError,
    zlib.error,
)


def _damaged(path: str, detail: str) -> MalformedCheckpointError:
    return MalformedCheckpointError(f"{path!r} is a damaged zip checkpoint: {detail}", path=path)


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def fold_case(name: str) -> str:
    """A record name as torch's reader compares it: ASCII letters lowered, nothing else changed.

    torch finds records with miniz's ``mz_zip_reader_locate_file`` without
    ``MZ_ZIP_FLAG_CASE_SENSITIVE``, so ``archive/DATA.PKL`` is its ``data.pkl``.
    """
    return name.translate(_ASCII_LOWER)


def find_root(names: Iterable[str], path: str) -> str:
    """The archive's root folder (with trailing slash, case folded by :func:`fold_case`), e.g. ``"archive/"``.

    Raises:
        UnsupportedFormatError: a TorchScript archive, a numpy ``.npz``, or a zip
            that holds no ``<root>/data.pkl`` (in any case, as torch finds it).
    """
    names = list(names)
    folded = [fold_case(name) for name in names]
    roots = sorted({name[: -len("data.pkl")] for name in folded if name.endswith("/data.pkl") and name.count("/") == 1})
    if len(roots) > 1:
        raise _damaged(path, f"it has {len(roots)} root folders with data.pkl ({', '.join(roots)})")
    if not roots:
        if any(name.endswith(".npy") for name in folded):
            raise UnsupportedFormatError(
                f"{path!r} is a numpy .npz archive, not a PyTorch checkpoint; load it with numpy.load",
                path=path,
            )
        raise UnsupportedFormatError(
            f"{path!r} is a zip archive but not a PyTorch checkpoint (it has no <folder>/data.pkl)",
            path=path,
        )
    root = roots[0]
    if f"{root}constants.pkl" in folded or any(name.startswith(f"{root}code/") for name in folded):
        raise UnsupportedFormatError(
            f"{path!r} is a TorchScript archive (torch.jit.save), not a checkpoint; load it with "
            "torch.jit.load and save model.state_dict() with torch.save to convert it",
            path=path,
        )
    return root


def check_compression(info: zipfile.ZipInfo, path: str) -> None:
    """Refuse a member before decompressing it if its claimed size cannot be true.

    torch.save stores records uncompressed; archives repacked by other tools may
    deflate them. Nothing else is accepted (torch.load reads neither bzip2 nor
    LZMA), and a deflated member may not claim to expand beyond what deflate can
    produce, so a few kilobytes can never announce gigabytes.
    """
    if info.flag_bits & 0x1:
        # zipfile would raise RuntimeError("password required"); torch.load cannot read it either.
        raise UnsupportedFormatError(
            f"{path!r} has an encrypted member {info.filename!r}; decrypt the archive first", path=path
        )
    if info.compress_type == zipfile.ZIP_STORED:
        return
    if info.compress_type != zipfile.ZIP_DEFLATED:
        raise UnsupportedFormatError(
            f"{path!r} compresses {info.filename!r} with zip method {info.compress_type}, which torch.load "
            "cannot read either; re-save the checkpoint with torch.save",
            path=path,
        )
    if info.file_size > MAX_DEFLATE_RATIO * info.compress_size + 1024:
        raise _damaged(
            path,
            f"{info.filename!r} claims {info.file_size} bytes from {info.compress_size} compressed bytes, "
            "more than deflate can produce (a zip bomb?)",
        )


def record_data_offset(file: BinaryIO, info: zipfile.ZipInfo, path: str) -> int:
    """Offset of a member's first data byte, read from its local header."""
    file.seek(info.header_offset)
    header = file.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise _damaged(path, f"the local header of {info.filename!r} is missing")
    name_length: int
    extra_length: int
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    flags: int
    method: int
    flags, method = struct.unpack("<HH", header[6:10])
    local_name = file.read(name_length).decode("utf-8" if flags & 0x800 else "cp437", "replace")
    # The central directory and the local header must describe the same record:
    # readers that trust one or the other would otherwise read different bytes.
    if local_name != info.orig_filename or method != info.compress_type:
        raise _damaged(path, f"the local header of {info.filename!r} disagrees with its directory entry")
    return int(info.header_offset) + 30 + name_length + extra_length


class _Window(io.RawIOBase):
    """A read-only view of ``length`` bytes at ``offset`` of a file, for zips embedded in other files."""

    def __init__(self, file: BinaryIO, offset: int, length: int) -> None:
        super().__init__()
        self.file = file
        self.offset = offset
        self.length = length
        self.position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = max(0, min(self.length, base + position))
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self.length - self.position)
        if count <= 0:
            return 0
        data = os.pread(self.file.fileno(), count, self.offset + self.position)
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)


def read(path: str, *, max_items: int | None = None, region: tuple[int, int] | None = None) -> ReadResult:
    """Read a torch zip checkpoint lazily.

    Args:
        path: the file.
        max_items: the pickle's object budget (see ``ckptconv.unpickler.DEFAULT_MAX_ITEMS``).
        region: ``(offset, length)`` when the checkpoint is embedded in a larger
            file (a chunk of a DCP ``.distcp`` file); record offsets are then
            reported in the outer file.

    Raises:
        LoadError: the archive is not a torch checkpoint, is damaged, or is unsafe.
    """
    with read_policy.open_file(path) as outer:
        base = region[0] if region else 0
        source: Any = _Window(outer, region[0], region[1]) if region else outer
        try:
            archive = zipfile.ZipFile(source)
        except _ZIP_ERRORS as error:
            raise _damaged(path, f"its zip directory cannot be read ({error})") from None
        with archive:
            return _read_archive(path, archive, source, base, max_items)


def _bytes_before_archive(archive: zipfile.ZipFile, file: Any) -> int:
    """How far Python's zipfile shifted every offset the archive records: the bytes before the archive
    that its directory does not count (``concat`` in ``ZipFile._RealGetContents``), nonzero when the
    archive was appended to other data, another archive included."""
    # The end record ZipFile itself read; the module has parsed it this way since Python 2.
    end_record = zipfile._EndRecData(file)  # type: ignore[attr-defined]
    recorded: int = end_record[6]  # zipfile._ECD_OFFSET: the directory's offset, as recorded
    return archive.start_dir - recorded


def _read_archive(path: str, archive: zipfile.ZipFile, file: Any, base: int, max_items: int | None) -> ReadResult:
    size = file.seek(0, io.SEEK_END)
    shift = _bytes_before_archive(archive, file)
    if shift:
        # torch's reader (miniz) takes the recorded offsets as they are, from the start of the file, where
        # Python's shifts them past what comes first: appended to another archive, the file is one
        # checkpoint to torch and another to every Python tool, ckptconv's scan included.
        raise UnsafeCheckpointError(
            f"{path!r} has {shift} bytes before its zip archive that the archive's directory does not count "
            "(another archive?); torch reads the records at the offsets as recorded and other zip readers past "
            "those bytes, so refusing a file that can be read two ways (nothing was executed)",
            path=path,
        )
    # Keyed by fold_case(name): torch finds a record whatever the case of its name.
    infos: dict[str, zipfile.ZipInfo] = {}
    exact: set[str] = set()
    for info in archive.infolist():
        folded = fold_case(info.filename)
        other = infos.get(folded)
        if other is not None and other.filename != info.filename:
            other_name = other.filename
            # torch's reader (miniz, without MZ_ZIP_FLAG_CASE_SENSITIVE) finds a record whatever the case
            # of its name: which of the two it takes for 'data.pkl' is not Python's answer.
            raise UnsafeCheckpointError(
                f"{path!r} holds records named {short_repr(other_name)} and {short_repr(info.filename)}, one name to "
                "torch's reader (it ignores case), so refusing a file that can be read two ways (nothing was "
                "executed)",
                path=path,
            )
        if info.filename in exact:
            # torch 2.13's reader takes the first record of a name, torch 2.4's the last, Python's zipfile
            # the last: a benign copy can hide the pickle torch.load would run.
            raise UnsafeCheckpointError(
                f"{path!r} holds two records named {short_repr(info.filename)}; torch reads the first or the "
                "last by its version, so refusing a file that can be read two ways (nothing was executed)",
                path=path,
            )
        exact.add(info.filename)
        infos[folded] = info
    root = find_root(exact, path)
    # torch.save with torch.utils.serialization.config.save.compute_crc32 = False records 0 as every
    # member's CRC-32, and torch.load never checks them: such a file has no checksum to hold its bytes to.
    crc_recorded = any(info.CRC for info in infos.values() if info.file_size)
    # As torch.load: the format version first, before the pickle (up to MAX_PICKLE_BYTES) is read.
    _check_version(path, archive, file, infos, root, crc_recorded)
    pickle_info = infos[f"{root}data.pkl"]
    if pickle_info.file_size > MAX_PICKLE_BYTES:
        raise _damaged(path, f"data.pkl claims {pickle_info.file_size} bytes (the limit is {MAX_PICKLE_BYTES})")
    check_compression(pickle_info, path)
    try:
        data = member_bytes(archive, file, pickle_info, path, check_crc=crc_recorded)
        byteorder_info = infos.get(f"{root}byteorder")
        if byteorder_info:
            check_compression(byteorder_info, path)
            if byteorder_info.file_size > _MAX_BYTEORDER_BYTES:
                raise _damaged(
                    path, f"its byteorder record holds {byteorder_info.file_size} bytes, not 'little' or 'big'"
                )
        byteorder = (
            member_bytes(archive, file, byteorder_info, path, check_crc=crc_recorded).decode("ascii", "replace")
            if byteorder_info
            else "little"
        )
    except _ZIP_ERRORS as error:
        raise _damaged(path, f"data.pkl cannot be read ({error})") from None
    if byteorder not in ("little", "big"):
        raise _damaged(path, f"its byteorder record says {short_repr(byteorder)}")

    storages: dict[str, Storage] = {}
    types: dict[str, tuple[StorageType, int]] = {}
    devices: set[str] = set()

    def persistent_load(pid: Any) -> TypedStorage:
        refusal = text_storage_reference(path, pid, "torch")
        if refusal is not None:
            raise refusal
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")):
            raise _damaged(path, f"data.pkl refers to {short_repr(pid)} instead of a storage")
        _, storage_type, key, location, numel = pid
        storage_type = check_storage_type(path, storage_type, _damaged)
        if not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise _damaged(path, f"storage reference {short_repr(pid)} is malformed")
        dtype = storage_type.dtype
        storage = storages.get(key)
        if storage is not None:
            check_same_storage_type(path, key, types[key], (storage_type, numel))
        else:
            types[key] = (storage_type, numel)
            name = f"{root}data/{key}"
            info = infos.get(fold_case(name))
            if info is None:
                raise _damaged(path, f"storage record {name!r} is missing")
            name = info.filename  # as the archive spells it: the name zipfile opens it by
            nbytes = numel * dtype.itemsize
            if info.file_size != nbytes:
                raise _damaged(path, f"record {name!r} holds {info.file_size} bytes but data.pkl expects {nbytes}")
            check_compression(info, path)
            if info.compress_type == zipfile.ZIP_STORED:
                offset = record_data_offset(file, info, path)
                if offset + nbytes > size:
                    raise MalformedCheckpointError(
                        f"{path!r} is truncated: storage {name!r} ends past the end of the file",
                        path=path,
                    )
                source: Any = FileRegion(path, base + offset, crc32=info.CRC if crc_recorded else None)
            elif base:
                raise UnsupportedFormatError(
                    f"{path!r} embeds a compressed checkpoint, which ckptconv cannot read in place", path=path
                )
            else:
                source = ZipMember(path, name, crc32=info.CRC if crc_recorded else None)
            location_tag = pickle_location(location, path)
            devices.add(location_tag)
            storage = Storage(nbytes, source, location_tag, byteorder, name)
            storages[key] = storage
        return TypedStorage(storage, dtype)

    unpickler = Unpickler(data, persistent_load=persistent_load, source=path, max_items=max_items or DEFAULT_MAX_ITEMS)
    tree = unpickler.load()
    unpickler.check_end()
    metadata = _read_metadata(archive, infos.get(f"{root}{METADATA_RECORD}"))
    return ReadResult(FORMAT, tree, unpickler.foreign_globals, frozenset(devices), metadata)


def _check_version(
    path: str, archive: zipfile.ZipFile, file: Any, infos: Mapping[str, zipfile.ZipInfo], root: str, check_crc: bool
) -> None:
    """Refuse an archive whose format version torch.load refuses: none recorded, not a number, or outside
    :data:`FORMAT_VERSIONS` (a newer format may mean something else by the same records).

    torch reads ``.data/version``, else ``version``, as ``std::stoll`` does: leading white space, a sign,
    then decimal digits, whatever follows them.
    """
    info = infos.get(f"{root}.data/version") or infos.get(f"{root}version")
    if info is None:
        raise _damaged(path, "it has no version record, which torch.load requires")
    if info.file_size > _MAX_VERSION_BYTES:
        raise _damaged(path, f"its version record holds {info.file_size} bytes")
    check_compression(info, path)
    try:
        raw = member_bytes(archive, file, info, path, check_crc=check_crc)
    except _ZIP_ERRORS as error:
        raise _damaged(path, f"its version record cannot be read ({error})") from None
    match = re.match(rb"[ \t\n\v\f\r]*([+-]?[0-9]+)", raw)
    if match is None:
        raise _damaged(path, f"its version record says {short_repr(raw)}, not a number")
    digits = match.group(1)
    version = int(digits) if len(digits) <= 32 else None
    if version not in FORMAT_VERSIONS:
        shown = version if version is not None else digits[:32].decode() + "..."
        raise UnsupportedFormatError(
            f"{path!r} is a torch zip checkpoint of format version {shown}, which torch.load reads only from "
            f"{FORMAT_VERSIONS[0]} to {FORMAT_VERSIONS[-1]} (written by a newer torch?); refusing rather than "
            "guessing what its records mean",
            path=path,
        )


def inflates_too_much(info: zipfile.ZipInfo) -> bool:
    """Whether a member read whole into memory inflates more than :data:`MAX_INFLATION` allows."""
    return (
        info.compress_type != zipfile.ZIP_STORED
        and info.file_size > MAX_INFLATION * info.compress_size + INFLATION_SLACK
    )


def member_bytes(archive: zipfile.ZipFile, file: Any, info: zipfile.ZipInfo, path: str, *, check_crc: bool) -> bytes:
    """A small member's bytes; its CRC-32 checked (by zipfile) when ``check_crc``, for archives that record CRCs.

    Refused, before anything is inflated, when it would inflate more than a pickle does (:data:`MAX_INFLATION`).
    """
    if inflates_too_much(info):
        raise _damaged(
            path,
            f"{short_repr(info.filename)} inflates from {info.compress_size} to {info.file_size} bytes, more than "
            f"{MAX_INFLATION}:1 (torch.save stores it uncompressed; a zip bomb?)",
        )
    if check_crc:
        return archive.read(info)
    if info.compress_type != zipfile.ZIP_STORED:
        raise _damaged(path, f"{info.filename!r} is compressed but the archive records no CRC-32 to check it by")
    file.seek(record_data_offset(file, info, path))
    data: bytes = file.read(info.file_size)
    if len(data) != info.file_size:
        raise _damaged(path, f"{info.filename!r} ends past the end of the file")
    return data


def _read_metadata(archive: zipfile.ZipFile, info: zipfile.ZipInfo | None) -> dict[str, str]:
    """ckptconv's own metadata record, if present and well formed (it is informational only)."""
    if info is None or info.file_size > 16 << 20 or inflates_too_much(info):
        return {}
    try:
        value = json.loads(archive.read(info).decode("utf-8"))
    except (*_ZIP_ERRORS, UnicodeDecodeError):
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return {}
    return value


# ---------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------

ALIGNMENT = 64
METADATA_RECORD = "ckptconv.json"
PAGE = 4096
# Records at least this big are placed at their source's page phase (see _local_header).
PHASE_MATCH_BYTES = 1 << 20
#: Records up to this size are filled in memory and written with their CRC-32 in the header,
#: instead of patching the header afterwards (two seeks, each a flush: per tensor, that was most
#: of the cost of writing 10^5 small ones). Fillers must not need a file descriptor for them.
BUFFERED_RECORD = 64 << 10
ROOT = "archive"
_ZIP64_LIMIT = 0xFFFFFFFF


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


class _PickleWriter:
    """Writes the protocol-2 pickle torch.save would write for a dict of tensors."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")
        self.memo: dict[str, int] = {}

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
        slot = self.memo.get(full)
        if slot is not None:
            self.out += b"h" + bytes([slot]) if slot < 256 else b"j" + struct.pack("<I", slot)
            return
        self.out += b"c" + full.encode("ascii")
        slot = len(self.memo)
        self.memo[full] = slot
        self.out += b"q" + bytes([slot]) if slot < 256 else b"r" + struct.pack("<I", slot)

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

    def checkpoint(
        self, tensors: Sequence[PlannedTensor], storages: Sequence[PlannedStorage], extra: Mapping[str, Any] | None
    ) -> bytes:
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
        return bytes(self.out)


class _ZipWriter:
    """A minimal zip writer with torch's 64-byte data alignment and ZIP64 support."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.entries: list[tuple[bytes, int, int, int]] = []  # name, crc, size, header offset

    def _local_header(self, name: bytes, size: int, crc: int, offset: int, phase: int | None = None) -> bytes:
        zip64 = size >= _ZIP64_LIMIT
        extra = struct.pack("<HHQQ", 0x0001, 16, size, size) if zip64 else b""
        data_start = offset + 30 + len(name) + len(extra)
        # torch aligns record data to 64 bytes. Copies run fastest when the
        # output offset has the same position within a page as the input's
        # (page-level copies, no 4K-aliasing in memcpy), so big records may ask
        # for a page phase, which is then also 64-aligned.
        if phase is not None and phase % ALIGNMENT == 0:
            padding = (phase - data_start) % PAGE
        else:
            padding = -data_start % ALIGNMENT
        if padding:
            if padding < 4:
                padding += ALIGNMENT if phase is None else PAGE
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
        offset = self.file.tell()
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
        self.file.seek(offset + 14)
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

    def write_bytes(self, name: str, data: bytes) -> None:
        def fill(file: BinaryIO) -> int:
            file.write(data)
            return zlib.crc32(data)

        self.write_record(name, len(data), fill)

    def close(self) -> None:
        directory_start = self.file.tell()
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
        directory_end = self.file.tell()
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
    writer.write_bytes(f"{ROOT}/data.pkl", _PickleWriter().checkpoint(tensors, storages, extra))
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
    return sum(storage.nbytes for storage in storages)


def source_phase(ref: TensorRef) -> int | None:
    """Where a tensor's first byte sits within a page of its source file, if it is copied as is."""
    region = ref.verbatim_region
    return None if region is None else (region[0].offset + region[1]) % PAGE


def is_zip(head: bytes) -> bool:
    return head[:4] in (b"PK\x03\x04", b"PK\x05\x06")
