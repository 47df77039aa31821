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

import os
from typing import Any

from ckptconv._text import short_repr
from ckptconv.dtypes import SAFETENSORS_WITHOUT_TORCH, dtype_by_safetensors_code
from ckptconv.errors import MalformedCheckpointError, UnsupportedFormatError
from ckptconv.reading import read_policy
from ckptconv.reading.formats._base import ReadResult, is_utf8, json_object
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
    """The parsed JSON header, the offset where tensor data starts, and the file size."""
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
        header = json_object(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise _damaged(path, f"its header is not valid JSON ({error})") from None
    if not isinstance(header, dict):
        raise _damaged(path, "its header is not a JSON object")
    return header, 8 + header_length, size


def read(path: str) -> ReadResult:
    """Read a safetensors file lazily; every tensor is a region of the file."""
    header, data_start, size = read_header(path)
    metadata = header.pop(METADATA_KEY, None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _damaged(path, "its __metadata__ is not a map of strings to strings")
    data_length = size - data_start
    tree: dict[str, TensorRef] = {}
    spans: list[tuple[int, int, str]] = []
    for key, entry in header.items():
        # Other fields are ignored, as the safetensors library reads such an entry.
        if not isinstance(entry, dict) or not entry.keys() >= _ENTRY_FIELDS:
            raise _damaged(path, f"entry {short_repr(key)} is not a tensor description")
        code = entry.get("dtype")
        dtype = dtype_by_safetensors_code(code) if isinstance(code, str) else None
        if dtype is None and code in SAFETENSORS_WITHOUT_TORCH:
            raise UnsupportedFormatError(
                f"{path!r} holds tensor {short_repr(key)} as {code}, a safetensors dtype that no torch dtype holds; "
                "ckptconv converts only what torch can load",
                path=path,
            )
        if dtype is None:
            raise _damaged(path, f"tensor {short_repr(key)} has unknown dtype {short_repr(entry.get('dtype'))}")
        shape = entry.get("shape")
        offsets = entry.get("data_offsets")
        if not (isinstance(shape, list) and len(shape) <= 64 and all(type(s) is int and s >= 0 for s in shape)):
            raise _damaged(path, f"tensor {short_repr(key)} has shape {short_repr(shape)}")
        if shape_overflows(shape):  # the safetensors library's checked product; torch's int64 sizes
            raise _damaged(
                path,
                f"tensor {short_repr(key)} has shape {short_repr(shape)}, whose sizes or their product overflow int64",
            )
        if code == PACKED_F4:
            # The safetensors library stores torch's float4_e2m1fn_x2 (two 4-bit floats a byte)
            # as F4 with the last dimension counted in 4-bit elements.
            if not shape or shape[-1] % 2:
                raise UnsupportedFormatError(
                    f"{path!r}: tensor {short_repr(key)} is F4 of shape {short_repr(shape)}, "
                    "which no torch dtype holds "
                    "(torch packs two 4-bit floats a byte)",
                    path=path,
                )
            shape = [*shape[:-1], shape[-1] // 2]
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise _damaged(path, f"tensor {short_repr(key)} has data_offsets {short_repr(offsets)}")
        begin, end = offsets
        numel = 1
        for dim in shape:
            numel *= dim
        if not 0 <= begin <= end or end - begin != numel * dtype.itemsize:
            raise _damaged(
                path, f"tensor {short_repr(key)} of shape {short_repr(shape)} has data_offsets {short_repr(offsets)}"
            )
        if end > data_length:
            raise MalformedCheckpointError(
                f"{path!r} is truncated: tensor {short_repr(key)} ends at byte {data_start + end} of {size}", path=path
            )
        spans.append((begin, end, key))
        storage = Storage(end - begin, FileRegion(path, data_start + begin), name=key)
        tree[key] = TensorRef(storage, dtype, tuple(shape), contiguous_strides(tuple(shape)))
    _check_buffer_indexed(path, spans, data_length)
    _restore_aliases(path, tree, metadata)
    return ReadResult(FORMAT, tree, metadata=dict(metadata))


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
