"""torch's legacy checkpoint format (before 1.6, or ``_use_new_zipfile_serialization=False``).

Layout (see ``torch/serialization.py``, ``_legacy_save`` and ``_legacy_load``)::

    pickle  MAGIC_NUMBER (0x1950a86a20f9469cfc6c)
    pickle  PROTOCOL_VERSION (1001)
    pickle  sys_info ({"little_endian": ..., "type_sizes": ...})
    pickle  the saved object; tensors refer to storages through persistent ids
            ('storage', StorageType, root_key, location, numel, view_metadata)
    pickle  the list of storage keys, in the order their bytes follow
    then, per key: int64 element count, then the raw bytes (both little-endian, whatever
                   sys_info says: torch converts on big-endian machines)

The storages are read in place at their offsets, like the zip format's.
The even older tar format (torch < 0.4) is recognised and refused; ``scan`` runs the pickles of its
members through the pickle machine (:func:`tar_member_pickles`), as torch's ``legacy_load`` reads them.
"""

from __future__ import annotations

import os
import re
import struct
import tarfile
from collections import Counter
from typing import Any, Callable

from ckptconv._text import short_repr
from ckptconv.errors import MalformedCheckpointError, UnsafeCheckpointError, UnsupportedFormatError
from ckptconv.reading import read_policy
from ckptconv.reading.formats._base import (
    ReadResult,
    check_same_storage_type,
    check_storage_type,
    pickle_location,
    text_storage_reference,
)
from ckptconv.reading.formats.torch_zip import MAX_PICKLE_BYTES
from ckptconv.reading.sources import FileRegion, Source, read_exactly_into
from ckptconv.reading.unpickling.unpickler import DEFAULT_MAX_ITEMS, PickleTruncatedError, Unpickler, recording_unsafe
from ckptconv.values.standins import ForeignGlobal, StorageType, TypedStorage
from ckptconv.values.tensor import Storage

__all__ = ["MAGIC_NUMBER", "TAR_MEMBERS", "looks_legacy", "read", "tar_member_pickles"]

FORMAT = "torch-legacy"
MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
# The magic number as torch.save's default protocol 2 writes it: PROTO 2, LONG1 10 bytes.
_MAGIC_PICKLE = b"\x80\x02\x8a\x0a" + MAGIC_NUMBER.to_bytes(10, "little") + b"."
# As protocols 0 and 1 write it: the text opcode LONG.
_MAGIC_TEXT_PICKLE = b"L" + str(MAGIC_NUMBER).encode() + b"L\n."

_FIRST_READ = 1 << 20


class _PendingRegion(Source):
    """Placeholder source until the storage key list tells where the bytes are (never read)."""

    def opened(self) -> Any:
        raise MalformedCheckpointError("storage bytes were never located; the legacy file is damaged")

    def paths(self) -> frozenset[str]:
        return frozenset()


def looks_legacy(head: bytes) -> bool:
    """True if ``head`` starts with the legacy magic-number pickle (any protocol)."""
    if head.startswith((_MAGIC_PICKLE, _MAGIC_TEXT_PICKLE)):
        return True
    if head[:1] != b"\x80":
        return False
    try:
        with recording_unsafe(None):  # a guess at the format: `scan` records what the real read finds
            return bool(Unpickler(head[:64], source="").load() == MAGIC_NUMBER)
    except Exception:  # any failure just means "not this format"
        return False


def read(path: str, *, max_items: int | None = None) -> ReadResult:
    """Read a legacy torch checkpoint lazily.

    The pickles come first and are usually small, so they are parsed from a
    buffer that grows only if a pickle runs past it.
    """
    with read_policy.open_file(path) as file:
        if _opens_as_tar(file):
            raise UnsafeCheckpointError(
                f"{path!r} is both a legacy torch checkpoint and a tar archive, which torch.load reads instead "
                "(torch's pre-0.4 format, which weights_only=True refuses from torch 2.6), so refusing a file that "
                "can be read two ways (nothing was executed)",
                path=path,
            )
        size = os.fstat(file.fileno()).st_size
        buffer_size = min(size, _FIRST_READ)
        while True:
            file.seek(0)
            head = file.read(buffer_size)
            try:
                return _read_from(path, head, file.fileno(), size, max_items)
            except PickleTruncatedError:
                if buffer_size >= size:
                    raise
                if buffer_size >= MAX_PICKLE_BYTES:
                    # torch writes small pickles before the storages; one that runs on
                    # for gigabytes would otherwise pull the whole file into memory.
                    raise _damaged(
                        path, f"its pickles run past the first {MAX_PICKLE_BYTES} bytes (the limit)"
                    ) from None
                buffer_size = min(size, buffer_size * 8, MAX_PICKLE_BYTES)


def _opens_as_tar(file: Any) -> bool:
    """True when ``tarfile`` opens the file, as torch.load tries first for a file that is not a zip: it then
    reads the file as a pre-0.4 tar checkpoint (its members ``storages``, ``tensors`` and ``pickle``),
    whatever the legacy pickles at the same bytes say. A file can be both: the header's fields are plain
    text at fixed offsets, which a string in the ``sys_info`` pickle can hold."""
    file.seek(0)
    try:
        with tarfile.open(fileobj=file, mode="r:", format=tarfile.PAX_FORMAT):
            return True
    except tarfile.TarError:
        return False
    finally:
        file.seek(0)


def _read_from(path: str, head: bytes, fd: int, size: int, max_items: int | None) -> ReadResult:
    def next_pickle(start: int, persistent_load: Callable[[Any], Any] | None = None) -> tuple[Any, Unpickler]:
        unpickler = Unpickler(
            head, start=start, source=path, persistent_load=persistent_load, max_items=max_items or DEFAULT_MAX_ITEMS
        )
        return unpickler.load(), unpickler

    magic, unpickler = next_pickle(0)
    if magic != MAGIC_NUMBER:
        raise UnsupportedFormatError(f"{path!r} is not a legacy torch checkpoint (wrong magic number)", path=path)
    protocol, unpickler = next_pickle(unpickler.end)
    if protocol != PROTOCOL_VERSION:
        raise MalformedCheckpointError(
            f"{path!r} is a legacy torch checkpoint of unknown protocol {protocol!r}", path=path
        )
    # sys_info says which byte order the saving machine had, but torch writes every storage and its element
    # count little-endian on any machine (THPStorage_writeFileRaw converts) and reads them so, whatever
    # sys_info says: it is not consulted.
    _, unpickler = next_pickle(unpickler.end)

    storages: dict[str, Storage] = {}
    views: dict[str, TypedStorage] = {}
    itemsizes: dict[str, int] = {}
    types: dict[str, tuple[StorageType, int]] = {}
    devices: set[str] = set()

    def persistent_load(pid: Any) -> Any:
        refusal = text_storage_reference(path, pid, "legacy torch")
        if refusal is not None:
            raise refusal
        if not isinstance(pid, tuple) or not pid:
            raise _damaged(path, f"it refers to {short_repr(pid)}")
        kind = pid[0].decode("ascii", "replace") if isinstance(pid[0], bytes) else pid[0]
        if kind == "module" and len(pid) == 4:
            # ('module', class, source file, source): the class the object needs.
            return pid[1] if isinstance(pid[1], ForeignGlobal) else ForeignGlobal("unknown", "module")
        if kind != "storage" or len(pid) != 6:
            raise _damaged(path, f"it refers to {short_repr(pid)} instead of a storage")
        _, storage_type, root_key, location, numel, view_metadata = pid
        storage_type = check_storage_type(path, storage_type, _damaged)
        if not isinstance(root_key, str):
            raise _damaged(path, f"storage reference {short_repr(pid)} is malformed")
        if root_key in views:  # torch would take the view for the storage (as a tensor's or a view's root)
            raise _ambiguous(path, f"{root_key!r} names both a storage and a storage view")
        if type(numel) is not int or numel < 0:
            raise _damaged(path, f"storage {root_key!r} has size {numel!r}")
        dtype = storage_type.dtype
        storage = storages.get(root_key)
        if storage is not None:
            check_same_storage_type(path, root_key, types[root_key], (storage_type, numel))
        else:
            types[root_key] = (storage_type, numel)
            location_tag = pickle_location(location, path)
            devices.add(location_tag)
            storage = Storage(numel * dtype.itemsize, _PendingRegion(), location_tag, "little", root_key)
            storages[root_key] = storage
            itemsizes[root_key] = dtype.itemsize
        if view_metadata is None:
            return TypedStorage(storage, dtype)
        return _view(root_key, view_metadata, TypedStorage(storage, dtype, 0, numel))

    def _view(root_key: str, view_metadata: Any, root: TypedStorage) -> TypedStorage:
        """A storage view (files of torch before 1.0): ``(view key, offset, size)`` in elements of the root.

        torch keeps one object per key, storages and views alike, so a view key met
        again (or naming a storage) gives what it named first, whatever the new
        offset says: such files are refused, like every file that reads two ways.
        """
        if not (isinstance(view_metadata, tuple) and len(view_metadata) == 3):
            raise _damaged(path, f"storage view {short_repr(view_metadata)} is malformed")
        view_key, offset, count = view_metadata
        if not isinstance(view_key, str) or type(offset) is not int or type(count) is not int:
            raise _damaged(path, f"storage view {short_repr(view_metadata)} is malformed")
        assert root.element_count is not None
        if offset < 0 or count < 0 or offset + count > root.element_count:
            raise _damaged(path, f"storage view {view_key!r} ({offset}+{count}) lies outside its storage {root_key!r}")
        if view_key in storages:
            raise _ambiguous(path, f"{view_key!r} names both a storage and a storage view")
        view = TypedStorage(root.storage, root.dtype, offset, count)
        known = views.setdefault(view_key, view)
        if known != view:
            raise _ambiguous(path, f"storage view {view_key!r} is given two different places")
        return known

    tree, unpickler = next_pickle(unpickler.end, persistent_load=persistent_load)
    foreign = unpickler.foreign_globals
    keys, unpickler = next_pickle(unpickler.end)
    if not isinstance(keys, list) or not all(isinstance(key, str) for key in keys):
        raise _damaged(path, "its storage key list is not a list of names")

    offset = unpickler.end
    for key in keys:
        storage = storages.get(key)
        if storage is None:
            raise _damaged(path, f"storage {key!r} is listed but never used")
        if offset + 8 > size:
            raise MalformedCheckpointError(
                f"{path!r} is truncated: storage {key!r} is missing; the file is incomplete", path=path
            )
        header = bytearray(8)
        read_exactly_into(fd, offset, memoryview(header), path)
        count = int.from_bytes(header, "little", signed=True)
        if count != storage.nbytes // itemsizes[key]:
            raise _damaged(path, f"storage {key!r} holds {count} elements, the pickle says otherwise")
        data_offset = offset + 8
        if data_offset + storage.nbytes > size:
            raise MalformedCheckpointError(
                f"{path!r} is truncated: storage {key!r} ends past the end of the file", path=path
            )
        # The storage was created before its offset was known; set it now, once.
        object.__setattr__(storage, "source", FileRegion(path, data_offset))
        offset = data_offset + storage.nbytes
    missing = [key for key, storage in storages.items() if isinstance(storage.source, _PendingRegion)]
    if missing:
        raise _damaged(path, f"storage {missing[0]!r} is used but its bytes are not in the file")
    return ReadResult(FORMAT, tree, foreign, frozenset(devices))


def _ambiguous(path: str, detail: str) -> MalformedCheckpointError:
    return _damaged(
        path,
        f"{detail}; torch reads the first it met, other readers may not, so refusing a file that can be read two ways",
    )


def _damaged(path: str, detail: str) -> MalformedCheckpointError:
    return MalformedCheckpointError(f"{path!r} is a damaged legacy torch checkpoint: {detail}", path=path)


#: The members of torch's pre-0.4 tar checkpoints (``legacy_load`` in torch/serialization.py).
TAR_MEMBERS = ("sys_info", "storages", "tensors", "pickle")
# The tensor class each tensor of the ``tensors`` member names (torch.FloatTensor ...): torch's own, named only.
_TENSOR_TYPE = re.compile(r"torch(\.cuda)?\.[A-Za-z0-9]+Tensor")
# A count read from a member's first pickle: no more storages or tensors than this.
_MAX_TAR_RECORDS = 10_000_000


def tar_member_pickles(name: str, path: str, where: str) -> Counter[str]:
    """Run every pickle of the member ``name`` of a pre-0.4 tar checkpoint, copied to ``path``, through the
    pickle machine, in torch's order: ``storages`` is a count, then per storage its ``(key, location, type)``
    pickle and its bytes (an int64 element count first), then the views' pickle; ``tensors`` a count, then per
    tensor its pickle and its sizes; ``pickle`` and ``sys_info`` one pickle each. Nothing is built on.

    Returns:
        The foreign globals the pickles name, with counts (unsafe ones go to :func:`recording_unsafe`'s list).

    Raises:
        MalformedCheckpointError: the member does not follow that layout.
    """
    foreign: Counter[str] = Counter()
    with read_policy.open_file(path) as file:
        size = os.fstat(file.fileno()).st_size

        def pickle_at(offset: int) -> tuple[Any, int]:
            window = min(size - offset, _FIRST_READ)
            while True:
                file.seek(offset)
                unpickler = Unpickler(file.read(window), source=where, persistent_load=lambda _pid: None)
                try:
                    value = unpickler.load()
                except PickleTruncatedError:
                    if window >= min(size - offset, MAX_PICKLE_BYTES):
                        raise
                    window = min(size - offset, window * 8, MAX_PICKLE_BYTES)
                    continue
                foreign.update(
                    {
                        global_name: count
                        for global_name, count in unpickler.foreign_globals.items()
                        if not (name == "tensors" and _TENSOR_TYPE.fullmatch(global_name))
                    }
                )
                return value, offset + unpickler.end

        def count_at(offset: int) -> tuple[int, int]:
            count, offset = pickle_at(offset)
            if not isinstance(count, int) or not 0 <= count <= _MAX_TAR_RECORDS:
                raise _damaged(where, f"its count {short_repr(count)} is not a number of records")
            return count, offset

        def skip(offset: int, nbytes: int) -> int:
            if offset + nbytes > size:
                raise _damaged(where, "its records run past its end")
            return offset + nbytes

        if name == "storages":
            count, offset = count_at(0)
            for _ in range(count):
                args, offset = pickle_at(offset)
                storage_type = args[2] if isinstance(args, tuple) and len(args) == 3 else None
                if not isinstance(storage_type, StorageType):
                    raise _damaged(where, f"a storage is described as {short_repr(args)}")
                file.seek(offset)
                raw = file.read(8)
                offset = skip(offset, 8)
                (elements,) = struct.unpack("<q", raw)
                offset = skip(offset, max(elements, 0) * storage_type.dtype.itemsize)
            pickle_at(offset)  # the views
        elif name == "tensors":
            count, offset = count_at(0)
            for _ in range(count):
                _args, offset = pickle_at(offset)
                file.seek(offset)
                raw = file.read(4)
                offset = skip(offset, 4)
                (ndim,) = struct.unpack("<i", raw)
                offset = skip(offset, 4 + 16 * max(ndim, 0) + 8)
        else:
            pickle_at(0)
    return foreign
