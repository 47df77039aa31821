"""What travels with the weights: a training checkpoint's non-tensor facts, and provenance.

A training checkpoint carries the epoch, the step, hyperparameters and the
``argparse.Namespace`` the run was started with. Those are worth keeping
next to converted weights, as JSON, but never by running code: values are
taken from the inert object tree (stand-ins included) and anything that is
not plain data (tensors, optimizer state, RNG state) is left out.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import queue
import threading
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

from ckptconv.dtypes import DType
from ckptconv.errors import CkptconvError
from ckptconv.reading import read_policy
from ckptconv.reading.formats import safetensors, sharded
from ckptconv.reading.formats._base import json_bytes
from ckptconv.runtime import cores as _cores
from ckptconv.selection.state_dicts import as_tensor, is_training_state
from ckptconv.selection.weights import Selection
from ckptconv.values.standins import ForeignGlobal, ForeignObject, NumpyArray

__all__ = ["checkpoint_metadata", "file_sha256", "written_by_ckptconv"]

# Entries whose JSON is larger than this are left out (a pickled dataset, say).
MAX_ENTRY_BYTES = 64 * 1024
_MAX_DEPTH = 12


class _NotData(Exception):
    """Raised inside :func:`_plain` for values that are not plain data."""


class _Unreadable(_NotData):
    """A value a ``.pt`` output's plain data cannot carry exactly, and why (for the caller's note)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_FROZENSET = "a frozenset, which torch.load(weights_only=True) cannot read"
# A torch.dtype is read as ckptconv's DType, which the .pt writer's plain data does not hold: in JSON
# metadata it is its name ("torch.bfloat16"), in a .pt output it is left out with a note.
_TORCH_DTYPE = "a torch.dtype, which ckptconv writes only as text, into safetensors metadata"


def _plain(value: Any, depth: int = 0, *, exact: bool = False) -> Any:
    """``value`` as plain data, or raise :class:`_NotData`.

    With ``exact=False`` (safetensors metadata), JSON-compatible: tuples and sets
    become lists, non-finite floats their text, keys text; a mapping whose keys
    JSON cannot hold (tuples, None) or that collide as text is not data. With
    ``exact=True`` (``.pt`` outputs), the values as ``torch.load(weights_only=True)``
    gives them back: tuples, sets, NaN, integer, float, None and tuple keys,
    ``OrderedDict``, ``Counter``, ``bytes``, ``bytearray`` and ``complex`` kept; a
    frozenset, which that loader refuses, raises :class:`_Unreadable`.
    """
    if depth > _MAX_DEPTH:
        raise _NotData
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if exact or math.isfinite(value) else repr(value)
    if exact and type(value) in (bytes, bytearray, complex):
        return value
    if exact and type(value) is frozenset:
        raise _Unreadable(_FROZENSET)
    if isinstance(value, DType):
        if exact:
            raise _Unreadable(_TORCH_DTYPE)
        return f"torch.{value.name}"
    if as_tensor(value) is not None or isinstance(value, (NumpyArray, bytes, bytearray, complex)):
        raise _NotData
    if hasattr(value, "item") and hasattr(value, "dtype") and type(value).__module__ == "numpy":
        return _plain(value.item(), depth + 1, exact=exact)  # numpy scalars
    if exact and isinstance(value, tuple):
        return tuple(_plain(item, depth + 1, exact=True) for item in value)
    if exact and type(value) is set:
        return {_key(item, depth + 1) for item in value}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(item, depth + 1, exact=exact) for item in value]
    if isinstance(value, Mapping):
        # OrderedDict and Counter are read back as themselves; any other mapping as a dict.
        result: dict[Any, Any] = {}
        if exact and isinstance(value, (OrderedDict, Counter)) and type(value) in (OrderedDict, Counter):
            result = type(value)()
        for key, item in value.items():
            if exact:
                plain_key = _key(key, depth + 1)
            elif isinstance(key, (str, int, float, bool)):
                plain_key = str(key)
            else:
                raise _NotData  # a key JSON cannot hold: leave the entry out rather than cut it
            if plain_key in result:
                raise _NotData  # {1: ..., "1": ...} as JSON keys
            result[plain_key] = _plain(item, depth + 1, exact=exact)
        return result
    if isinstance(value, ForeignObject):
        # argparse.Namespace, SimpleNamespace, dataclasses, omegaconf containers...
        fields = value.attributes() or {str(k): v for k, v in value.items.items()}
        if not fields and value.args:
            return _plain(list(value.args), depth + 1, exact=exact)
        return {key: _plain(item, depth + 1, exact=exact) for key, item in fields.items()}
    if isinstance(value, ForeignGlobal):
        return value.qualname
    raise _NotData


def _key(value: Any, depth: int) -> Any:
    """A dict key or set item kept exactly: a number, text, bytes, None, or a tuple of them."""
    if value is None or type(value) in (bool, int, float, str, bytes, complex):
        return value
    if type(value) is frozenset:
        raise _Unreadable(_FROZENSET)
    if type(value) is tuple and depth <= _MAX_DEPTH:
        return tuple(_key(item, depth + 1) for item in value)
    raise _NotData


def _size(plain: Any, *, exact: bool) -> int:
    """About how many bytes ``plain`` takes as text (ValueError: an integer too long to print)."""
    return len(repr(plain)) if exact else len(json.dumps(plain))


def checkpoint_metadata(
    tree: Any, selection: Selection, *, exact: bool = False, unreadable: dict[str, str] | None = None
) -> dict[str, Any]:
    """The plain-data entries beside the selected weights.

    Only the checkpoint's top level is considered; the entry holding the
    weights, other weight copies (EMA), optimizer, scheduler and RNG state,
    and anything containing tensors are left out. ``exact`` keeps the values
    as Python data torch writes and reads back unchanged (for ``.pt`` outputs);
    otherwise they are JSON-compatible (see :func:`_plain`). Entries left out
    because ``torch.load(weights_only=True)`` could not read them back go into
    ``unreadable`` (name -> why), for the caller to say so.
    """
    if isinstance(tree, Mapping):
        items = list(tree.items())
    elif isinstance(tree, ForeignObject):
        items = list(tree.attributes().items())
    else:
        return {}
    weights_key = selection.path[0] if selection.path else None
    result: dict[str, Any] = {}
    for key, value in items:
        # Lightning's callback states are bookkeeping, not data worth keeping beside the weights
        # (the weights search still looks inside them: an EMA callback may hold a copy).
        if not isinstance(key, str) or key == weights_key or is_training_state(key) or key.lower() == "callbacks":
            continue
        try:
            plain = _plain(value, exact=exact)
            size = _size(plain, exact=exact)
        except _Unreadable as error:
            if unreadable is not None:
                unreadable[key] = error.reason
            continue
        except (_NotData, ValueError):  # ValueError: an integer of more digits than Python prints
            continue
        if size <= MAX_ENTRY_BYTES:
            result[key] = plain
    return result


#: A chunk small enough to stay in the CPU's cache between its read and its hash
#: (1 GiB: 0.69 s with 256 KiB chunks against 0.79 s with 8 MiB on the development VM).
_HASH_CHUNK = 1 << 20
#: Chunks the reader thread of :func:`file_sha256` may be ahead by.
_READ_AHEAD_CHUNKS = 3


def file_sha256(path: str, stop: threading.Event | None = None) -> str:
    """The sha256 of a file, read in chunks (hashlib releases the GIL, so a thread can do it).

    Where the process has a second core, a reader thread fills the next chunks
    while this one hashes: sha256 then sets the pace alone.

    Returns "" if ``stop`` is set before the end (the caller gave up).
    """
    digest = hashlib.sha256()
    with read_policy.open_file(path) as file:
        chunks = _read_ahead(file.fileno(), stop) if _cores.usable() > 1 else _read_in_turn(file, stop)
        for chunk in chunks:
            digest.update(chunk)
        if stop is not None and stop.is_set():
            return ""
    return digest.hexdigest()


def _read_in_turn(file: io.BufferedReader, stop: threading.Event | None) -> Iterator[memoryview]:
    """A file's bytes in chunks of one reused buffer, until its end or ``stop``."""
    view = memoryview(bytearray(_HASH_CHUNK))
    while stop is None or not stop.is_set():
        count = file.readinto(view)
        if not count:
            return
        yield view[:count]


def _read_ahead(fd: int, stop: threading.Event | None) -> Iterator[memoryview]:
    """A file's bytes in chunks, read by a second thread a few chunks ahead, until its end or ``stop``.

    Each chunk is valid until the next is asked for.
    """
    free: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
    full: queue.SimpleQueue[tuple[memoryview, int] | BaseException] = queue.SimpleQueue()
    for _ in range(_READ_AHEAD_CHUNKS):
        free.put(memoryview(bytearray(_HASH_CHUNK)))

    def read() -> None:
        offset = 0
        try:
            while True:
                buffer = free.get()
                if buffer is None:
                    return
                count = os.preadv(fd, [buffer], offset)
                full.put((buffer, count))
                if not count:
                    return
                offset += count
        except BaseException as error:  # handed to the hashing thread, which raises it
            full.put(error)

    reader = threading.Thread(target=read, name="ckptconv-hash-read", daemon=True)
    reader.start()
    try:
        while stop is None or not stop.is_set():
            item = full.get()
            if isinstance(item, BaseException):
                raise item
            buffer, count = item
            if not count:
                return
            yield buffer[:count]
            free.put(buffer)
    finally:
        free.put(None)  # the reader stops at its next chunk
        _cores.join_uninterrupted(reader)


def source_sha256(path: str, stop: threading.Event | None = None) -> str:
    """The sha256 identifying a checkpoint: of the file, or for a sharded or DCP
    checkpoint, of its files' names (relative to its folder) and sha256s, sorted,
    so every shard counts (:func:`ckptconv.reading.detection.checkpoint_files` says which)."""
    from ckptconv.reading.detection import checkpoint_files

    files = checkpoint_files(path)
    if len(files) == 1 and os.path.isfile(path):
        return file_sha256(files[0], stop=stop)
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    named = sorted((os.path.relpath(file, folder).replace(os.sep, "/"), file) for file in files)
    digest = hashlib.sha256()
    for name, file in named:
        value = file_sha256(file, stop=stop)
        if not value:
            return ""
        digest.update(f"{name}\0{value}\n".encode())
    return digest.hexdigest()


def encode_entries(entries: Mapping[str, Any], prefix: str) -> dict[str, str]:
    """Metadata entries as strings (JSON), each under ``prefix + key``."""
    return {f"{prefix}{key}": json_bytes(value).decode("utf-8", "surrogatepass") for key, value in entries.items()}


def written_by_ckptconv(path: str) -> bool:
    """True when the file at ``path`` carries ckptconv's provenance (it is an output ckptconv wrote).

    A safetensors file or a shard index whose metadata holds ``ckptconv.`` keys, or a ``.pt``/``.bin``
    zip with a ``ckptconv.json`` record. Anything else (``--no-provenance`` outputs included, and files
    that cannot be read) is someone else's, which ckptconv never removes.
    """
    metadata: Any
    try:
        if path.endswith(".index.json"):
            _, metadata = sharded.read_index(path)
        elif path.endswith(".safetensors"):
            header, _, _ = safetensors.read_header(path)
            metadata = header.get("__metadata__")
        else:
            with read_policy.open_file(path) as file, zipfile.ZipFile(file) as archive:
                return any(name.rpartition("/")[2] == "ckptconv.json" for name in archive.namelist())
    except (CkptconvError, OSError, ValueError, zipfile.BadZipFile):
        return False
    return isinstance(metadata, dict) and any(isinstance(key, str) and key.startswith("ckptconv.") for key in metadata)
