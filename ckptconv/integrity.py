"""Integrity: the bytes read are the bytes the file recorded.

A zip checkpoint records a CRC-32 for every record. torch.load does not check
them, so a flipped bit in a record loads silently; a conversion that copied it
would launder the damage into a clean-looking file. :func:`check_record_crcs`
reads every record the selected tensors use, in full, and compares. Converting
runs it on a worker thread beside the write (and the source hash), and the
output is moved into place only once it has passed.

Formats without checksums (legacy ``.pt``, safetensors, raw pickles) have
nothing to compare and are skipped. This module does not import torch.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Mapping

from .errors import MalformedCheckpointError
from .tensor import FileRegion, Storage, TensorRef, ZipMember

__all__ = ["CRC_OPT_OUT", "check_record_crcs", "crc32", "crc32_combine"]

try:
    # ISA-L's CRC-32 (carry-less multiply, vpclmulqdq where the CPU has it): the same
    # values as zlib's, 4x faster on the 2-core VM (18 vs 4.2 GB/s); it releases the GIL too.
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal has wheels where we run; zlib everywhere else
    from zlib import crc32

#: What a user passes to convert a damaged file anyway.
CRC_OPT_OUT = "--no-crc-check"

_BLOCK = 8 << 20

# CRC-32 arithmetic modulo its polynomial, as zlib's crc32.c does it (multmodp,
# x2nmodp): Python's zlib module has no crc32_combine.
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32 polynomial (bit-reversed; ``a`` non-zero)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


@functools.cache
def _x2n_table() -> tuple[int, ...]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return tuple(table)


@functools.lru_cache(maxsize=256)
def _x8nmodp(length: int) -> int:
    """``x^(8 * length)`` modulo the polynomial: what appending ``length`` bytes does to a CRC."""
    table = _x2n_table()
    p = 1 << 31  # x^0
    k = 3
    while length:
        if length & 1:
            p = _multmodp(table[k & 31], p)
        length >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)`` and ``length2 = len(b)``.

    Example:
        >>> crc32_combine(zlib.crc32(b"ab"), zlib.crc32(b"cd"), 2) == zlib.crc32(b"abcd")
        True
    """
    return _multmodp(_x8nmodp(length2), crc1) ^ crc2


def check_record_crcs(
    entries: Iterable[tuple[str, TensorRef]],
    *,
    stop: threading.Event | None = None,
    computed: Mapping[Storage, int] | None = None,
) -> None:
    """Read each zip record the tensors use and compare its CRC-32 with the archive's.

    Args:
        entries: ``(key, tensor)`` pairs; each distinct record is read once,
            and named in an error with the first key that uses it.
        stop: return early (unchecked) when set; for a conversion that failed anyway.
        computed: CRC-32s already taken of whole records' bytes as they were
            read (by :func:`ckptconv._transfer.read_spans`); these records are
            compared without reading them again.

    Raises:
        MalformedCheckpointError: a record's bytes do not match its CRC-32 (or
            a compressed record cannot be decompressed).
    """
    records = _records(entries)
    unread = [r[0].nbytes for r in records.values() if computed is None or r[0] not in computed]
    buffer = memoryview(bytearray(min(_BLOCK, max(unread, default=0))))
    for storage, key, source in records.values():
        if stop is not None and stop.is_set():
            return
        if computed is not None and storage in computed:
            _compare(computed[storage], storage, key, source)
            continue
        crc = 0
        try:
            with storage.reader() as read_into:
                for position in range(0, storage.nbytes, _BLOCK):
                    piece = buffer[: min(_BLOCK, storage.nbytes - position)]
                    read_into(position, piece)
                    crc = crc32(piece, crc)
        except MalformedCheckpointError as error:
            # zipfile checks a compressed record's CRC itself, at its end.
            raise MalformedCheckpointError(
                f"{error.message} (tensor {key!r}); pass {CRC_OPT_OUT} to convert what can be read anyway",
                path=error.path,
            ) from None
        _compare(crc, storage, key, source)


def _records(entries: Iterable[tuple[str, TensorRef]]) -> dict[int, tuple[Storage, str, FileRegion | ZipMember]]:
    """Each distinct zip record the tensors use, with the first key that uses it."""
    records: dict[int, tuple[Storage, str, FileRegion | ZipMember]] = {}
    for key, ref in entries:
        source = ref.storage.source
        if isinstance(source, (FileRegion, ZipMember)) and source.crc32 is not None:
            records.setdefault(id(ref.storage), (ref.storage, key, source))
    return records


def _compare(crc: int, storage: Storage, key: str, source: FileRegion | ZipMember) -> None:
    if crc != source.crc32:
        raise MalformedCheckpointError(
            f"{source.path!r} is damaged: record {storage.name!r} (tensor {key!r}) has CRC-32 {crc:08x} "
            f"but the archive records {source.crc32:08x}; pass {CRC_OPT_OUT} to convert its bytes anyway",
            path=source.path,
        )
