"""Writing safetensors files, without the safetensors package: the header, padded so that the data
starts where the source's bytes lie in their page (a copy the kernel can do), then the tensors.
The reading side is :mod:`ckptconv.reading.formats.safetensors`."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, BinaryIO, Callable

from ckptconv._text import short_repr
from ckptconv.errors import WriteError
from ckptconv.reading.formats._base import Deferred, MetadataValue, is_utf8, metadata_text, split_aliases
from ckptconv.reading.formats.safetensors import ALIASES_KEY, METADATA_KEY, PACKED_F4, utf8_text
from ckptconv.values.tensor import TensorRef


def _header_shape(key: str, ref: TensorRef) -> list[int]:
    """The shape the header records: F4 counts 4-bit elements, two to each float4_e2m1fn_x2 byte."""
    shape = list(ref.shape)
    if ref.out_dtype.safetensors == PACKED_F4:
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
    from ckptconv.writing.torch_zip import PAGE, source_phase

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
    header: dict[str, Any] = {}  # the entries not yet in ``encoded``
    deferred = {key: value for key, value in (metadata or {}).items() if isinstance(value, Deferred)}
    all_metadata = {
        "format": "pt",
        **{
            utf8_text(k): v.placeholder if isinstance(v, Deferred) else utf8_text(v)
            for k, v in (metadata or {}).items()
        },
    }
    if aliases:
        all_metadata[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
    header[METADATA_KEY] = all_metadata
    # The header's JSON, made 1,024 entries at a time: a dict of every tensor's entry took 430 bytes a
    # tensor beside the text (issue #31). The bytes are those json.dumps(header) gives.
    encoded = bytearray(b"{")
    _add_entries(encoded, header)
    offset = 0
    for key, ref in unique:
        header[key] = {
            "dtype": ref.out_dtype.safetensors,
            "shape": _header_shape(key, ref),
            "data_offsets": [offset, offset + ref.nbytes],
        }
        offset += ref.nbytes
        if len(header) > _ENTRIES_AT_A_TIME:
            _add_entries(encoded, header)
    _add_entries(encoded, header)
    encoded += b"}"
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


_ENTRIES_AT_A_TIME = 1024


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _add_entries(encoded: bytearray, header: dict[str, Any]) -> None:
    """Append ``header``'s entries to the JSON object ``encoded`` is the start of, and empty ``header``."""
    if header:
        if len(encoded) > 1:
            encoded += b","
        encoded += _json(header)[1:-1]
        header.clear()
