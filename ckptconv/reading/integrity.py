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

import threading
from collections.abc import Iterable, Mapping

from ckptconv.errors import MalformedCheckpointError
from ckptconv.reading.checksums import crc32
from ckptconv.values.tensor import ByteSource, Storage, TensorRef

__all__ = ["CRC_OPT_OUT", "check_record_crcs"]

#: What a user passes to convert a damaged file anyway.
CRC_OPT_OUT = "--no-crc-check"

_BLOCK = 8 << 20


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
            read (by :func:`ckptconv.gpu.transfer.read_spans`); these records are
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


def _records(entries: Iterable[tuple[str, TensorRef]]) -> dict[int, tuple[Storage, str, ByteSource]]:
    """Each distinct zip record the tensors use, with the first key that uses it."""
    records: dict[int, tuple[Storage, str, ByteSource]] = {}
    for key, ref in entries:
        source = ref.storage.source
        if source.crc32 is not None:
            records.setdefault(id(ref.storage), (ref.storage, key, source))
    return records


def _compare(crc: int, storage: Storage, key: str, source: ByteSource) -> None:
    path = min(source.paths(), default="")
    if crc != source.crc32:
        raise MalformedCheckpointError(
            f"{path!r} is damaged: record {storage.name!r} (tensor {key!r}) has CRC-32 {crc:08x} "
            f"but the archive records {source.crc32:08x}; pass {CRC_OPT_OUT} to convert its bytes anyway",
            path=path,
        )
