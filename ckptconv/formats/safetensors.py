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

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, BinaryIO, Callable

from .. import read_policy
from ..dtypes import SAFETENSORS_WITHOUT_TORCH, dtype_by_safetensors_code
from ..errors import MalformedCheckpointError, UnsupportedFormatError, WriteError
from ..standins import short_repr
from ..tensor import FileRegion, Storage, TensorRef, contiguous_strides, shape_overflows
from ._base import Deferred, MetadataValue, ReadResult, is_utf8, json_object, metadata_text, split_aliases

__all__ = ["ALIASES_KEY", "looks_safetensors", "read", "write"]

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


def _utf8_text(text: str) -> str:
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
        if code == _PACKED_F4:
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


_PACKED_F4 = "F4"


def _header_shape(key: str, ref: TensorRef) -> list[int]:
    """The shape the header records: F4 counts 4-bit elements, two to each float4_e2m1fn_x2 byte."""
    shape = list(ref.shape)
    if ref.out_dtype.safetensors == _PACKED_F4:
        if not shape:
            raise WriteError(
                f"tensor {short_repr(key)} is a 0-dim float4_e2m1fn_x2, which safetensors cannot store; use --to pt"
            )
        shape[-1] *= 2
    return shape


def _header_padding(data_start: int, tensors: Sequence[tuple[str, TensorRef]]) -> int:
    """Spaces after the JSON header: a multiple of 8 that keeps the data 8-aligned.

    Copies run fastest when each tensor lands at the same position within a
    page as in its source file. Tensors follow each other without gaps, so
    only one padding can be chosen: the one that puts the most bytes in phase.
    """
    from .torch_zip import PAGE, source_phase

    matched: dict[int, int] = {}
    relative = 0
    for _, ref in tensors:
        phase = source_phase(ref)
        if phase is not None:
            padding = (phase - data_start - relative) % PAGE
            if padding % 8 == 0:
                matched[padding] = matched.get(padding, 0) + ref.nbytes
        relative += ref.nbytes
    minimal = -data_start % 8
    if not matched:
        return minimal
    best = max(matched, key=lambda padding: (matched[padding], -padding))
    return best if matched[best] >= (1 << 20) else minimal


def write(
    entries: Sequence[tuple[str, TensorRef]],
    file: BinaryIO,
    *,
    metadata: Mapping[str, MetadataValue] | None = None,
    write_tensor: Callable[[TensorRef, BinaryIO], Iterable[int]],
    dedupe: bool = True,
) -> int:
    """Write ``entries`` as one safetensors file; tied tensors are stored once unless ``dedupe`` is False.

    Args:
        entries: ``(key, tensor)`` pairs.
        file: a binary file opened for writing, positioned at 0.
        metadata: string metadata; ``{"format": "pt"}`` is always included.
            :class:`Deferred` values are written as placeholders and filled in
            once the tensors are written.
        write_tensor: writes one tensor's contiguous bytes to ``file`` and yields
            byte counts as it goes (the fast copy path lives with the caller).
        dedupe: store tied tensors once, the other names in ``ckptconv.aliases``
            (the Hugging Face convention); False writes a full copy under every
            name, which ``load_state_dict(load_file(path), strict=True)`` accepts.

    Returns:
        The number of tensor bytes written.

    Raises:
        WriteError: a tensor's dtype has no safetensors equivalent.
    """
    for key, ref in entries:
        if ref.out_dtype.safetensors is None:
            raise WriteError(
                f"tensor {key!r} is {ref.out_dtype.name}, which safetensors cannot store; "
                "write a .pt file instead (--to pt)"
            )
        if key == METADATA_KEY:
            # The header entry of that name is the file's metadata: a tensor there would replace it.
            raise WriteError(
                f"tensor {key!r} cannot be stored in safetensors: the name is reserved for the file's metadata; "
                f"rename it (--rename '^{key}$=NAME') or write a .pt file (--to pt)"
            )
    # Tied tensors once (the Hugging Face convention), or under every name.
    unique, aliases = split_aliases(entries) if dedupe else (list(entries), {})
    # Largest element types first keeps every tensor aligned to its itemsize,
    # as the safetensors library does.
    unique.sort(key=lambda item: (-item[1].out_dtype.itemsize, item[0]))

    for key, _ in entries:
        if not is_utf8(key):
            raise WriteError(
                f"tensor {key!r} has a name that is not valid Unicode (a lone surrogate), and safetensors "
                "stores names as UTF-8; rename it (--rename) or write a .pt file (--to pt)"
            )
    header: dict[str, Any] = {}
    deferred = {key: value for key, value in (metadata or {}).items() if isinstance(value, Deferred)}
    all_metadata = {
        "format": "pt",
        **{
            _utf8_text(k): v.placeholder if isinstance(v, Deferred) else _utf8_text(v)
            for k, v in (metadata or {}).items()
        },
    }
    if aliases:
        all_metadata[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
    header[METADATA_KEY] = all_metadata
    offset = 0
    for key, ref in unique:
        header[key] = {
            "dtype": ref.out_dtype.safetensors,
            "shape": _header_shape(key, ref),
            "data_offsets": [offset, offset + ref.nbytes],
        }
        offset += ref.nbytes
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    encoded += b" " * _header_padding(8 + len(encoded), unique)
    file.write(len(encoded).to_bytes(8, "little"))
    file.write(encoded)
    for key, ref in unique:
        written = sum(write_tensor(ref, file))
        if written != ref.nbytes:
            raise AssertionError(f"tensor {key!r}: wrote {written} bytes, planned {ref.nbytes}")
    end = file.tell()
    for key, value in deferred.items():
        needle = (json.dumps(key, ensure_ascii=False) + ":" + json.dumps(value.placeholder)).encode("utf-8")
        position = encoded.index(needle) + len(needle) - value.length - 1
        file.seek(8 + position)
        file.write(metadata_text(value).encode("ascii"))
    file.seek(end)
    return offset
