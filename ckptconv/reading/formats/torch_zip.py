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
:class:`~ckptconv.values.tensor.FileRegion` at the record's offset in the file.
"""

from __future__ import annotations

import io
import json
import os
import re
import struct
import zipfile
import zlib
from collections.abc import Iterable, Mapping
from typing import Any, BinaryIO

from ckptconv._text import plural, short_repr
from ckptconv.errors import MalformedCheckpointError, UnsafeCheckpointError, UnsupportedFormatError
from ckptconv.reading import read_policy
from ckptconv.reading.checksums import zeros_crc32
from ckptconv.reading.formats._base import (
    ReadResult,
    check_same_storage_type,
    check_storage_type,
    pickle_location,
    text_storage_reference,
)
from ckptconv.reading.sources import FileRegion, ZipMember
from ckptconv.reading.unpickling.unpickler import DEFAULT_MAX_ITEMS, Unpickler
from ckptconv.values.standins import StorageType, TypedStorage
from ckptconv.values.tensor import Storage

__all__ = ["read"]

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
        max_items: the pickle's object budget (see ``ckptconv.reading.unpickling.unpickler.DEFAULT_MAX_ITEMS``).
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
    skipped: list[str] = []  # storage records saved under torch.serialization.skip_data
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
            recorded = info.CRC if crc_recorded else None
            if recorded == 0 and nbytes:
                # torch.save under torch.serialization.skip_data records CRC 0 and writes no bytes (a hole,
                # read as zeros); torch.load reads the zeros. They are held to the CRC-32 of zeros instead.
                recorded = zeros_crc32(nbytes)
                skipped.append(name)
            if info.compress_type == zipfile.ZIP_STORED:
                offset = record_data_offset(file, info, path)
                if offset + nbytes > size:
                    raise MalformedCheckpointError(
                        f"{path!r} is truncated: storage {name!r} ends past the end of the file",
                        path=path,
                    )
                source: Any = FileRegion(path, base + offset, crc32=recorded)
            elif base:
                raise UnsupportedFormatError(
                    f"{path!r} embeds a compressed checkpoint, which ckptconv cannot read in place", path=path
                )
            else:
                source = ZipMember(path, name, crc32=recorded)
            location_tag = pickle_location(location, path)
            devices.add(location_tag)
            storage = Storage(nbytes, source, location_tag, byteorder, name)
            storages[key] = storage
        return TypedStorage(storage, dtype)

    unpickler = Unpickler(data, persistent_load=persistent_load, source=path, max_items=max_items or DEFAULT_MAX_ITEMS)
    tree = unpickler.load()
    unpickler.check_end()
    metadata = _read_metadata(archive, infos.get(f"{root}{METADATA_RECORD}"))
    notes: tuple[str, ...] = ()
    if skipped:
        notes = (
            f"{plural(len(skipped), 'storage record')} of {path!r} hold no data (the file was saved under "
            "torch.serialization.skip_data): their tensors are zeros, as torch.load reads them",
        )
    return ReadResult(FORMAT, tree, unpickler.foreign_globals, frozenset(devices), metadata, notes=notes)


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


def is_zip(head: bytes) -> bool:
    return head[:4] in (b"PK\x03\x04", b"PK\x05\x06")


METADATA_RECORD = "ckptconv.json"
