"""The safetensors format: reading and writing, without the safetensors package.

Layout (https://github.com/huggingface/safetensors, "Format")::

    8 bytes    N, little-endian unsigned header length
    N bytes    JSON: {"__metadata__": {str: str}, key: {"dtype", "shape", "data_offsets": [begin, end]}}
    rest       tensor bytes, little-endian, row-major; offsets are relative to here

safetensors cannot express two keys sharing memory (huggingface/safetensors#98,
#202). ckptconv writes one copy of a tied tensor and lists the other keys in the
``ckptconv.aliases`` metadata entry (a JSON object ``{alias: kept key}``);
reading a file back through ckptconv restores every key, and plain safetensors
readers still see a valid file.
"""

from __future__ import annotations

import array
import json
import os
from typing import Any

import numpy as np

from ckptconv._text import short_repr
from ckptconv.dtypes import SAFETENSORS_WITHOUT_TORCH, dtype_by_safetensors_code
from ckptconv.errors import MalformedCheckpointError, UnsupportedFormatError
from ckptconv.reading import read_policy
from ckptconv.reading.formats._base import ReadResult, is_utf8, json_object, unique_pairs
from ckptconv.reading.sources import FileRegion
from ckptconv.values.tensor import Storage, TensorRef, contiguous_strides, shape_overflows

__all__ = ["ALIASES_KEY", "looks_safetensors", "read"]

FORMAT = "safetensors"
ALIASES_KEY = "ckptconv.aliases"
#: The header entry that holds the file's string metadata, never a tensor.
METADATA_KEY = "__metadata__"
# The safetensors library refuses headers over 100 MB; so do we.
MAX_HEADER_BYTES = 100_000_000


def looks_safetensors(head: bytes, size: int) -> bool:
    """True if ``head`` starts like a safetensors file of ``size`` bytes."""
    if len(head) < 9:
        return False
    header_length = int.from_bytes(head[:8], "little")
    # JSON may start with white space, and the safetensors library reads such a header.
    return 2 <= header_length <= size - 8 and head[8:].lstrip(_JSON_SPACE)[:1] == b"{"


def utf8_text(text: str) -> str:
    """Metadata text as UTF-8 can store it: lone surrogates become ``\\udcXX`` escapes."""
    return text if is_utf8(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _damaged(path: str, detail: str) -> MalformedCheckpointError:
    return MalformedCheckpointError(f"{path!r} is a damaged safetensors file: {detail}", path=path)


_JSON_SPACE = b" \t\n\r"


def read_header(path: str) -> tuple[dict[str, Any], int, int]:
    """The parsed JSON header, the offset where tensor data starts, and the file size.

    A tensor description that has the three fields and nothing else, with a string dtype and list
    shape and offsets, comes back as an :class:`_Entry` instead of a dict: a tuple a third the size,
    its dtype and shape shared with every entry of the same dtype and shape. A header of 10^6 tensors
    parses into about 120 MB instead of 600 MB (issue #31, "Plain data that balloons").
    """
    with read_policy.open_file(path) as file:
        size = os.fstat(file.fileno()).st_size
        prefix = file.read(8)
        if len(prefix) < 8:
            raise _damaged(path, "it is shorter than its 8-byte header length")
        header_length = int.from_bytes(prefix, "little")
        if header_length > MAX_HEADER_BYTES:
            raise _damaged(path, f"its header claims {header_length} bytes (the limit is {MAX_HEADER_BYTES})")
        if 8 + header_length > size:
            raise MalformedCheckpointError(
                f"{path!r} is truncated: its header claims {header_length} bytes but the file has {size}",
                path=path,
            )
        raw = file.read(header_length)
    try:
        text = raw.decode("utf-8")
        del raw  # the bytes and the text are each the header's size: hold one of them while parsing
        header = json.loads(text, object_pairs_hook=_EntryParser())
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise _damaged(path, f"its header is not valid JSON ({error})") from None
    if isinstance(header, _Entry):  # the header itself has a tensor description's three fields: still a header
        header = {"dtype": header[0], "shape": list(header[1]), "data_offsets": header[2]}
    if not isinstance(header, dict):
        raise _damaged(path, "its header is not a JSON object")
    return header, 8 + header_length, size


class _Entry(tuple):  # type: ignore[type-arg]
    """A tensor description as parsed: ``(dtype code, shape, data_offsets)``, shape and offsets tuples."""

    __slots__ = ()


class _EntryParser:
    """The ``object_pairs_hook`` of a safetensors header: :func:`unique_pairs` for every object, but a
    plain tensor description becomes an :class:`_Entry`, its dtype code and shape shared."""

    def __init__(self) -> None:
        self.shared: dict[Any, Any] = {}

    def __call__(self, pairs: list[tuple[str, Any]]) -> Any:
        if len(pairs) == 3:
            fields = dict(pairs)
            code, shape, offsets = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
            if (
                len(fields) == 3
                and type(code) is str
                and (code.isascii() or is_utf8(code))  # else unique_pairs says what is wrong with it
                and type(shape) is list
                and all(type(size) is int for size in shape)  # else the reader says what is wrong with it
                and type(offsets) is list
            ):
                return _Entry((self.share(code), self.share(tuple(shape)), offsets))
        return unique_pairs(pairs)

    def share(self, value: Any) -> Any:
        """The one copy of ``value`` kept for every entry that has it; at most :data:`_SHARED` values are kept,
        so a header of a million shapes, all different, does not add a table of a million."""
        shared = self.shared.get(value)
        if shared is not None:
            return shared
        if len(self.shared) < _SHARED:
            self.shared[value] = value
        return value


_SHARED = 4096


def read(path: str) -> ReadResult:
    """Read a safetensors file lazily; every tensor is a region of the file.

    The parsed header is taken apart as the tensors are made, so the two are not held whole at once.
    """
    header, data_start, size = read_header(path)
    metadata = header.pop(METADATA_KEY, None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _damaged(path, "its __metadata__ is not a map of strings to strings")
    data_length = size - data_start
    tree: dict[str, TensorRef] = {}
    begins, ends = array.array("q"), array.array("q")
    strides: dict[tuple[int, ...], tuple[int, ...]] = {}
    for key in list(header):
        code, shape, offsets = _fields(path, key, header.pop(key))
        dtype = dtype_by_safetensors_code(code) if isinstance(code, str) else None
        if dtype is None and code in SAFETENSORS_WITHOUT_TORCH:
            raise UnsupportedFormatError(
                f"{path!r} holds tensor {short_repr(key)} as {code}, a safetensors dtype that no torch dtype holds; "
                "ckptconv converts only what torch can load",
                path=path,
            )
        if dtype is None:
            raise _damaged(path, f"tensor {short_repr(key)} has unknown dtype {short_repr(code)}")
        shape_ok = isinstance(shape, (list, tuple)) and len(shape) <= 64
        if not (shape_ok and all(type(s) is int and s >= 0 for s in shape)):
            raise _damaged(path, f"tensor {short_repr(key)} has shape {short_repr(_as_json(shape))}")
        if shape_overflows(shape):  # the safetensors library's checked product; torch's int64 sizes
            raise _damaged(
                path,
                f"tensor {short_repr(key)} has shape {short_repr(list(shape))}, "
                "whose sizes or their product overflow int64",
            )
        if code == PACKED_F4:
            # The safetensors library stores torch's float4_e2m1fn_x2 (two 4-bit floats a byte)
            # as F4 with the last dimension counted in 4-bit elements.
            if not shape or shape[-1] % 2:
                raise UnsupportedFormatError(
                    f"{path!r}: tensor {short_repr(key)} is F4 of shape {short_repr(list(shape))}, "
                    "which no torch dtype holds "
                    "(torch packs two 4-bit floats a byte)",
                    path=path,
                )
            shape = (*shape[:-1], shape[-1] // 2)
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise _damaged(path, f"tensor {short_repr(key)} has data_offsets {short_repr(offsets)}")
        begin, end = offsets
        numel = 1
        for dim in shape:
            numel *= dim
        if not 0 <= begin <= end or end - begin != numel * dtype.itemsize:
            raise _damaged(
                path,
                f"tensor {short_repr(key)} of shape {short_repr(list(shape))} has data_offsets {short_repr(offsets)}",
            )
        if end > data_length:
            raise MalformedCheckpointError(
                f"{path!r} is truncated: tensor {short_repr(key)} ends at byte {data_start + end} of {size}", path=path
            )
        begins.append(begin)
        ends.append(end)
        shape = tuple(shape)
        stride = strides.get(shape)
        if stride is None:
            stride = strides[shape] = contiguous_strides(shape)
        storage = Storage(end - begin, FileRegion(path, data_start + begin), name=key)
        tree[key] = TensorRef(storage, dtype, shape, stride)
    del header
    if not _tiled(begins, ends, data_length):
        _check_buffer_indexed(path, [_span(ref, data_start) for ref in tree.values()], data_length)
    _restore_aliases(path, tree, metadata)
    return ReadResult(FORMAT, tree, metadata=dict(metadata))


def _fields(path: str, key: str, entry: Any) -> tuple[Any, Any, Any]:
    """An entry's dtype code, shape and data_offsets; other fields are ignored, as the safetensors library does."""
    if isinstance(entry, _Entry):
        return entry[0], entry[1], entry[2]
    if not isinstance(entry, dict) or not entry.keys() >= _ENTRY_FIELDS:
        raise _damaged(path, f"entry {short_repr(key)} is not a tensor description")
    return entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")


def _as_json(value: Any) -> Any:
    """A shape as the header spells it (a list), for messages."""
    return list(value) if isinstance(value, tuple) else value


def _span(ref: TensorRef, data_start: int) -> tuple[int, int, str]:
    region = ref.storage.source.stored_region()
    begin = region.offset - data_start if region is not None else 0
    return begin, begin + ref.storage.nbytes, ref.storage.name


def _tiled(begins: array.array[int], ends: array.array[int], data_length: int) -> bool:
    """True when the spans, sorted, tile ``[0, data_length)`` exactly: what :func:`_check_buffer_indexed`
    accepts, in 16 bytes a tensor (numpy's sort) instead of a tuple each."""
    if not begins:
        return data_length == 0
    first = np.frombuffer(begins, dtype=np.int64)
    last = np.frombuffer(ends, dtype=np.int64)
    order = np.lexsort((last, first))
    first, last = first[order], last[order]
    return bool(first[0] == 0 and last[-1] == data_length and np.array_equal(first[1:], last[:-1]))


def _check_buffer_indexed(path: str, spans: list[tuple[int, int, str]], data_length: int) -> None:
    """The format's rule, as the reference reader applies it: the tensors, sorted by
    offsets, tile the data buffer exactly. No hole, no overlap (not even one hidden
    behind an empty tensor), no trailing bytes: a buffer that is entirely indexed
    leaves no room for a second file hidden inside (a polyglot)."""
    position = 0
    for begin, end, key in sorted(spans):
        if begin != position:
            what = "overlaps the tensor before it" if begin < position else f"leaves bytes {position}-{begin} unindexed"
            raise _damaged(path, f"tensor {short_repr(key)} at data_offsets [{begin}, {end}] {what}")
        position = end
    if position != data_length:
        raise _damaged(path, f"{data_length - position} bytes after the last tensor belong to no tensor")


_ENTRY_FIELDS = frozenset({"dtype", "shape", "data_offsets"})


def _restore_aliases(path: str, tree: dict[str, TensorRef], metadata: dict[str, str]) -> None:
    raw = metadata.get(ALIASES_KEY)
    if raw is None:
        return
    try:
        aliases = json_object(raw)  # an alias named twice is two readings
    except (ValueError, RecursionError) as error:
        raise _damaged(path, f"its {ALIASES_KEY} metadata is not JSON ({error})") from None
    if not isinstance(aliases, dict):
        raise _damaged(path, f"its {ALIASES_KEY} metadata is not a JSON object")
    for alias, target in aliases.items():
        if not isinstance(target, str) or target not in tree or alias in tree or alias == METADATA_KEY:
            raise _damaged(path, f"alias {short_repr(alias)} -> {short_repr(target)} does not match the tensors")
        tree[alias] = tree[target]


PACKED_F4 = "F4"
