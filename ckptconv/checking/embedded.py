"""Pickles inside other containers, for ``scan``: zip members and numpy object arrays.

``torch.load`` reads one member of a zip, but other loaders (and an attacker's
instructions) may read any; numpy's ``allow_pickle`` loads the data of an object
``.npy`` as a pickle. :func:`scan_embedded` runs each such pickle through the
pickle machine, which records what it names (:func:`recording_unsafe`) and builds
nothing on it.
"""

from __future__ import annotations

import re
import struct
import zipfile
import zlib
from collections.abc import Iterator
from typing import Any

from ckptconv.errors import CkptconvError, LoadError
from ckptconv.reading import read_policy
from ckptconv.reading.unpickling.unpickler import UnsafeFinding, recording_unsafe

__all__ = ["scan_embedded"]


# Pickles inside other containers are scanned up to this size each.
_MAX_EMBEDDED = 256 << 20
_PICKLE_SUFFIXES = (".pkl", ".pickle")
# Members named otherwise are scanned if they start like a pickle and are at most this big.
_MAX_UNNAMED = 16 << 20
_PROTOCOLS = (b"\x02", b"\x03", b"\x04", b"\x05")
_STORAGE_RECORD = re.compile(r"(^|/)data/\d+$")


def _embedded_pickles(path: str) -> Iterator[tuple[str, bytes]]:
    """``(where, bytes)`` of every pickle inside a zip archive or a numpy object array, one at a time (each is
    up to 256 MiB: only one is held).

    ``torch.load`` reads one member of a zip, but other loaders (and an
    attacker's instructions) may read any; numpy's ``allow_pickle`` loads the
    data of an object ``.npy`` as a pickle. Zip members are read from their
    local headers, so a damaged central directory (a wrong CRC, a name that
    disagrees with the local header) does not hide them.
    """
    try:
        with read_policy.open_file(path) as file:  # regular files only: a FIFO would never end
            head = file.read(8)
            if head.startswith(b"\x93NUMPY"):
                yield from _npy_pickle(path, file)
            elif head.startswith(b"PK\x03\x04"):
                yield from _zip_pickles(path, file)
    except (OSError, LoadError):
        return


def _npy_pickle(path: str, file: Any) -> list[tuple[str, bytes]]:
    file.seek(6)
    major = file.read(2)[:1]
    size_format = "<H" if major == b"\x01" else "<I"
    raw = file.read(struct.calcsize(size_format))
    if len(raw) != struct.calcsize(size_format):
        return []
    (header_size,) = struct.unpack(size_format, raw)
    header = file.read(min(header_size, 1 << 16))
    if b"'|O'" not in header and b'"|O"' not in header:
        return []
    return [(f"{path} (object array data)", file.read(_MAX_EMBEDDED))]


def _zip_pickles(path: str, file: Any) -> Iterator[tuple[str, bytes]]:
    from ckptconv.loading import _PARSE_FAILURES

    try:
        archive = zipfile.ZipFile(file)
        infos = archive.infolist()
    except (*_PARSE_FAILURES, OSError):
        return
    for info in infos:
        if info.is_dir() or info.flag_bits & 1 or info.compress_size > _MAX_EMBEDDED:
            continue
        named = info.filename.lower().endswith(_PICKLE_SUFFIXES)
        if not named and (info.file_size > _MAX_UNNAMED or _STORAGE_RECORD.search(info.filename)):
            continue  # tensor bytes (torch's data/N records), or too big to be a hidden payload
        data = _zip_member_bytes(file, info)
        if data is not None and (named or (data[:1] == b"\x80" and data[1:2] in _PROTOCOLS)):
            yield f"{path}:{info.filename}", data


def _zip_member_bytes(file: Any, info: zipfile.ZipInfo) -> bytes | None:
    """A member's bytes from its local header, without the CRC or name checks zipfile makes."""
    from ckptconv.reading.formats.torch_zip import INFLATION_SLACK, MAX_INFLATION

    try:
        file.seek(info.header_offset)
        local = file.read(30)
        if len(local) != 30 or local[:4] != b"PK\x03\x04":
            return None
        name_length, extra_length = struct.unpack("<HH", local[26:30])
        file.seek(info.header_offset + 30 + name_length + extra_length)
        raw = file.read(info.compress_size)
        if info.compress_type == zipfile.ZIP_STORED:
            return bytes(raw)
        if info.compress_type == zipfile.ZIP_DEFLATED:
            # No more than a pickle inflates to (a zip bomb's zeros would be read up to the limit).
            limit = min(_MAX_EMBEDDED, MAX_INFLATION * info.compress_size + INFLATION_SLACK)
            return zlib.decompressobj(-15).decompress(raw, limit)
    except (OSError, zlib.error, struct.error, ValueError, OverflowError):
        return None
    return None


def scan_embedded(path: str) -> list[UnsafeFinding]:
    """Unsafe names in the pickles :func:`_embedded_pickles` finds (they are only read, never built on)."""
    from ckptconv.loading import _PARSE_FAILURES
    from ckptconv.reading.unpickling.unpickler import Unpickler

    findings: list[UnsafeFinding] = []
    with recording_unsafe(findings):
        for where, data in _embedded_pickles(path):
            unpickler = Unpickler(data, source=where, persistent_load=lambda _pid: None)
            try:
                unpickler.load()
                unpickler.check_end()
            except (CkptconvError, *_PARSE_FAILURES):
                continue  # a broken pickle: whatever it named before breaking is recorded
    return findings
