"""torch.distributed.checkpoint (DCP) folders, as FSDP and torchtitan write them: reading and writing.

Layout (see ``torch/distributed/checkpoint/filesystem.py`` and ``metadata.py``)::

    .metadata            pickle of a Metadata dataclass:
                           state_dict_metadata  {fqn: TensorStorageMetadata(properties, size, chunks)
                                                       | BytesStorageMetadata}
                           storage_data         {MetadataIndex(fqn, offset): _StorageInfo(file, offset, length)}
                           planner_data         {fqn: path in the saved state dict, e.g. ("model", "w")}
    __<rank>_<n>.distcp  each chunk of each tensor saved with torch.save (a small zip),
                         one after the other; other objects likewise, as bytes.

torch's own reader unpickles ``.metadata`` with plain ``pickle.load``, which
runs any code the file contains; ckptconv reads it with its safe unpickler and
each chunk with its lazy zip reader, in place. A tensor split across ranks
becomes one tensor whose chunks are read where they lie.

Writing (:mod:`ckptconv.writing.dcp`) needs no torch: the records are torch zip
archives ckptconv writes itself, and ``.metadata`` a pickle that names torch's
own classes, so that ``torch.distributed.checkpoint.load`` accepts it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable

from ckptconv._text import short_repr
from ckptconv.dtypes import DType
from ckptconv.errors import MalformedCheckpointError, UnsupportedFormatError
from ckptconv.reading import read_policy
from ckptconv.reading.formats import torch_zip
from ckptconv.reading.formats._base import ReadResult
from ckptconv.reading.sources import Source
from ckptconv.reading.unpickling.unpickler import DEFAULT_MAX_ITEMS, Unpickler
from ckptconv.suffixes import DCP_DATA_SUFFIX, DCP_METADATA
from ckptconv.values.standins import ForeignObject
from ckptconv.values.tensor import ReadInto, Storage, TensorRef, contiguous_strides

__all__ = ["METADATA_FILE", "assembled", "box_inside", "checkpoint_files", "is_dcp_folder", "read"]

FORMAT = "dcp"
METADATA_FILE = DCP_METADATA
DATA_FILE = "__0_0.distcp"
MAX_METADATA_BYTES = 512 << 20

# The classes a DCP .metadata pickle is made of: known, so not reported as stand-ins.
_DCP_CLASSES = ("torch.distributed.checkpoint.", "torch.serialization._get_layout", "pathlib.")


def is_dcp_folder(path: str) -> bool:
    """True when ``path`` holds a ``.metadata`` entry (whatever it is: :func:`read` checks it)."""
    return os.path.lexists(os.path.join(path, METADATA_FILE))


def checkpoint_files(folder: str) -> list[str]:
    """``.metadata`` and the data files: the files the checkpoint is made of."""
    data = sorted(
        name
        for name in os.listdir(folder)
        if name.endswith(DCP_DATA_SUFFIX)
        # only what may be read: regular files inside the folder (see ckptconv.reading.read_policy)
        and os.path.isfile(os.path.join(folder, name))
        and read_policy.within(os.path.join(folder, name), folder)
    )
    return [os.path.join(folder, name) for name in (METADATA_FILE, *data)]


def _damaged(path: str, detail: str) -> MalformedCheckpointError:
    return MalformedCheckpointError(f"{path!r} is a damaged DCP checkpoint: {detail}", path=path)


def _fields(value: Any, path: str, what: str) -> dict[str, Any]:
    if not isinstance(value, ForeignObject):
        raise _damaged(path, f"its {what} is not a DCP record")
    return value.attributes()


@dataclass(frozen=True, eq=False)
class Assembled(Source):
    """A tensor stored as several chunks (a DCP checkpoint's shards), read as one contiguous tensor.

    Chunks that split the tensor along its first dimension (FSDP's layout) are
    read in place, piece by piece; chunks of any other shape are pasted into
    one buffer the first time the tensor is read while it is open (bounded by
    the tensor's size, and released when the reader closes).

    Attributes:
        chunks: ``(offsets, chunk)`` pairs: where each chunk starts in the full
            tensor, and the chunk itself.
        shape: the full tensor's shape.
        itemsize: bytes per element.
    """

    chunks: tuple[tuple[tuple[int, ...], TensorRef], ...]
    shape: tuple[int, ...]
    itemsize: int

    @functools.cached_property
    def _rows(self) -> list[tuple[int, int, TensorRef]] | None:
        """``(first byte, last byte, chunk)`` when every chunk is a contiguous block of whole rows."""
        if not self.shape:
            return None
        row = math.prod(self.shape[1:]) * self.itemsize
        rows = []
        for offsets, chunk in self.chunks:
            if (
                any(offsets[1:])
                or tuple(chunk.shape[1:]) != tuple(self.shape[1:])
                or not chunk.is_contiguous
                or not chunk.is_stored_as_is
            ):
                return None
            rows.append((offsets[0] * row, (offsets[0] + chunk.shape[0]) * row, chunk))
        rows.sort(key=lambda item: item[0])
        expected = 0
        for first, last, _ in rows:
            if first != expected:
                return None
            expected = last
        return rows if expected == math.prod(self.shape) * self.itemsize else None

    @contextlib.contextmanager
    def opened(self) -> Iterator[ReadInto]:
        rows = self._rows
        # Pasted bytes live as long as this reader (readers may call from several threads).
        pasted: list[bytes] = []
        lock = threading.Lock()

        def whole() -> bytes:
            with lock:
                if not pasted:
                    pasted.append(self._paste())
                return pasted[0]

        def read_into(start: int, out: memoryview) -> None:
            out = out.cast("B")
            if rows is None:
                out[:] = whole()[start : start + len(out)]
                return
            end = start + len(out)
            for first, last, chunk in rows:
                if last <= start or first >= end:
                    continue
                piece_start, piece_end = max(first, start), min(last, end)
                chunk_start = chunk.byte_span[0] + piece_start - first
                chunk.storage.read_into(chunk_start, out[piece_start - start : piece_end - start])

        yield read_into

    def paths(self) -> frozenset[str]:
        return frozenset().union(*(chunk.storage.source.paths() for _, chunk in self.chunks))

    def _paste(self) -> bytes:
        """The whole tensor, pasted together from its chunks."""
        import numpy as np

        full = np.zeros(math.prod(self.shape) * self.itemsize, dtype=np.uint8)
        view = full.view(f"V{self.itemsize}").reshape(self.shape) if self.itemsize else full
        for offsets, chunk in self.chunks:
            block = chunk.numpy().view(f"V{self.itemsize}").reshape(chunk.shape)
            view[tuple(slice(o, o + n) for o, n in zip(offsets, chunk.shape))] = block
        return full.tobytes()


def _chunk_file(folder: str, relative: Any) -> str:
    """The data file a chunk lives in; never anything outside the checkpoint folder (:mod:`.read_policy`)."""
    return read_policy.member(folder, relative, source=folder, what="data file")


def read(folder: str, *, max_items: int | None = None) -> ReadResult:
    """Read a DCP folder lazily: every tensor is a chunk of a data file, or several chunks read as one."""
    metadata_path = read_policy.member(folder, METADATA_FILE, source=folder, what="metadata file")
    if os.path.getsize(metadata_path) > MAX_METADATA_BYTES:
        raise _damaged(folder, f"its .metadata is larger than {MAX_METADATA_BYTES >> 20} MiB")
    raw = read_policy.read_limited(metadata_path, limit=MAX_METADATA_BYTES, folder=folder, what="DCP .metadata")
    unpickler = Unpickler(raw, source=metadata_path, max_items=max_items or DEFAULT_MAX_ITEMS)
    tree = unpickler.load()
    unpickler.check_end()
    metadata = _fields(tree, folder, ".metadata")
    tensors = metadata.get("state_dict_metadata")
    storage = metadata.get("storage_data")
    if not isinstance(tensors, Mapping) or not isinstance(storage, Mapping):
        raise _damaged(folder, "its .metadata has no state_dict_metadata or storage_data")

    locations: dict[tuple[str, tuple[int, ...]], dict[str, Any]] = {}
    for index, info in storage.items():
        index_fields = _fields(index, folder, "storage index")
        offset = index_fields.get("offset")
        key = (index_fields.get("fqn"), tuple(offset) if isinstance(offset, (tuple, list)) else ())
        if key in locations:
            raise _damaged(folder, f"it lists the data of {key[0]!r} at {list(key[1])} twice")
        locations[key] = _fields(info, folder, "storage info")  # type: ignore[index]
    claimed: list[tuple[str, int, int, str]] = []

    def region(fqn: str, offsets: tuple[int, ...]) -> tuple[str, int, int]:
        info = locations.get((fqn, offsets))
        if info is None:
            raise _damaged(folder, f"the data of {fqn!r} at {list(offsets)} is not listed")
        if info.get("transform_descriptors"):
            raise UnsupportedFormatError(
                f"{folder!r} stores {fqn!r} with transforms {info['transform_descriptors']} (compression?), "
                "which ckptconv cannot read; save the checkpoint without storage extensions",
                path=folder,
            )
        start, length = info.get("offset"), info.get("length")
        if type(start) is not int or type(length) is not int or start < 0 or length <= 0:
            raise _damaged(folder, f"{fqn!r} has data at offset {start!r}, length {length!r}")
        path = _chunk_file(folder, info.get("relative_path"))
        files[path] = None
        if start + length > os.path.getsize(path):
            raise MalformedCheckpointError(f"{path!r} is truncated: {fqn!r} ends past its end", path=path)
        claimed.append((path, start, start + length, fqn))
        return path, start, length

    flat: dict[str, Any] = {}
    devices: set[str] = set()
    files: dict[str, None] = {metadata_path: None}
    for fqn, entry in tensors.items():
        if not isinstance(fqn, str):
            raise _damaged(folder, f"it names an entry {fqn!r}")
        record = _fields(entry, folder, f"entry {fqn!r}")
        if "chunks" in record:
            flat[fqn] = _tensor(folder, fqn, record, region, max_items, devices)
        else:
            path, start, length = region(fqn, ())
            flat[fqn] = torch_zip.read(path, region=(start, length), max_items=max_items).tree
    _check_disjoint(folder, claimed)
    tree = _nest(flat, metadata.get("planner_data"), folder)
    foreign = {name: count for name, count in unpickler.foreign_globals.items() if not name.startswith(_DCP_CLASSES)}
    return ReadResult(
        FORMAT,
        tree,
        foreign_globals=foreign,  # type: ignore[arg-type]
        saved_devices=frozenset(devices),
        files=tuple(files),
    )


def box_inside(
    offsets: object, sizes: object, shape: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(offsets, sizes)`` as tuples when they (read from a file) are integer lists that place a box of
    non-negative size inside a tensor of ``shape`` (a DCP chunk, a ShardedTensor shard); else None."""
    inside = (
        isinstance(offsets, (tuple, list))
        and isinstance(sizes, (tuple, list))
        and len(offsets) == len(shape)
        and len(sizes) == len(shape)
        and all(
            type(o) is int and type(n) is int and o >= 0 and n >= 0 and o + n <= d
            for o, n, d in zip(offsets, sizes, shape)
        )
    )
    return (tuple(offsets), tuple(sizes)) if inside else None  # type: ignore[arg-type]


def _tensor(
    folder: str,
    fqn: str,
    record: dict[str, Any],
    region: Callable[[str, tuple[int, ...]], tuple[str, int, int]],
    max_items: int | None,
    devices: set[str],
) -> TensorRef:
    size = record.get("size")
    chunks = record.get("chunks")
    if not isinstance(size, (tuple, list)) or not all(type(s) is int and s >= 0 for s in size):
        raise _damaged(folder, f"{fqn!r} has size {size!r}")
    if not isinstance(chunks, list) or not chunks:
        raise _damaged(folder, f"{fqn!r} has no chunks")
    shape = tuple(size)
    pieces: list[tuple[tuple[int, ...], TensorRef]] = []
    for chunk in chunks:
        chunk_fields = _fields(chunk, folder, f"chunk of {fqn!r}")
        offsets, sizes = chunk_fields.get("offsets"), chunk_fields.get("sizes")
        box = box_inside(offsets, sizes, shape)
        if box is None:
            raise _damaged(folder, f"{fqn!r} has a chunk at {offsets!r} of size {sizes!r}")
        offsets, sizes = box
        path, start, length = region(fqn, tuple(offsets))
        result = torch_zip.read(path, region=(start, length), max_items=max_items)
        devices |= result.saved_devices
        piece = result.tree
        if not isinstance(piece, TensorRef) or piece.shape != tuple(sizes):
            raise _damaged(folder, f"the chunk of {fqn!r} at {list(offsets)} is not a tensor of size {list(sizes)}")
        pieces.append((tuple(offsets), piece))
    recorded = recorded_dtype(record.get("properties"))
    if recorded is not None and recorded != pieces[0][1].dtype:
        raise _damaged(
            folder,
            f"{fqn!r} is recorded as {recorded.name} but its chunks hold {pieces[0][1].dtype.name}; torch's loader "
            f"would cast them to {recorded.name}, so it is refused rather than read two ways",
        )
    return assembled(fqn, shape, pieces, lambda detail: _damaged(folder, detail))


def assembled(
    fqn: str,
    shape: tuple[int, ...],
    pieces: list[tuple[tuple[int, ...], TensorRef]],
    damaged: Callable[[str], Exception],
) -> TensorRef:
    """One tensor of ``shape`` from its chunks (each inside it: :func:`box_inside`), read where they lie.

    Raises:
        the exception ``damaged`` makes of a sentence: the chunks differ in dtype, or do not tile the tensor
        (a hole, or an overlap).
    """
    dtype = pieces[0][1].dtype
    covered = sum(math.prod(piece.shape) for _, piece in pieces)
    if any(piece.dtype != dtype for _, piece in pieces) or covered != math.prod(shape):
        raise damaged(f"the chunks of {fqn!r} do not tile a {dtype.name} tensor of size {list(shape)}")
    # Equal volumes are not enough: an overlap (or a chunk listed twice) can hide a hole.
    overlap = _overlapping_chunks([(offsets, piece.shape) for offsets, piece in pieces])
    if overlap is not None:
        first, second = overlap
        raise damaged(
            f"the chunks of {fqn!r} at {list(first)} and {list(second)} overlap, so part of the tensor has two "
            "values and part none",
        )
    if len(pieces) == 1 and pieces[0][1].shape == shape:
        return pieces[0][1]
    source = Assembled(tuple(pieces), shape, dtype.itemsize)
    storage = Storage(math.prod(shape) * dtype.itemsize, source, name=fqn)
    return TensorRef(storage, dtype, shape, contiguous_strides(shape))


def recorded_dtype(properties: Any) -> DType | None:
    """The dtype a tensor's ``TensorProperties`` record (torch's loader makes the tensor in it), if readable
    (DCP's, and ShardedTensor's, which pickles alike).

    Recent torch pickles them as a tuple ``(dtype, layout, requires_grad, memory_format,
    pin_memory)``, older versions as a ``__dict__``.
    """
    if not isinstance(properties, ForeignObject):
        return None
    state = properties.state
    if isinstance(state, tuple) and state and isinstance(state[0], DType):
        return state[0]
    recorded = properties.attributes().get("dtype")
    return recorded if isinstance(recorded, DType) else None


def _overlapping_chunks(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The offsets of two chunks that share an element, if any (a sweep along the first dimension)."""
    ordered = sorted((box for box in boxes if all(box[1])), key=lambda box: box[0][:1])
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for offsets, sizes in ordered:
        start = offsets[0] if offsets else 0
        active = [box for box in active if not box[0] or box[0][0] + box[1][0] > start]
        for other_offsets, other_sizes in active:
            if all(o < p + m and p < o + n for o, n, p, m in zip(offsets, sizes, other_offsets, other_sizes)):
                return other_offsets, offsets
        active.append((offsets, sizes))
    return None


def _check_disjoint(folder: str, claimed: list[tuple[str, int, int, str]]) -> None:
    """Refuse two tensors (or chunks) whose bytes lie on top of each other in a data file."""
    claimed.sort()
    for (path, _, end, first), (other_path, start, _, second) in zip(claimed, claimed[1:]):
        if path == other_path and start < end:
            raise _damaged(
                folder,
                f"{first!r} and {second!r} are stored in the same bytes of {os.path.basename(path)!r}; "
                "one of them would be read as the other",
            )


def _nest(flat: dict[str, Any], planner_data: Any, folder: str) -> Any:
    """Rebuild the nested state dict DCP flattened, from the paths in ``planner_data`` (an entry without
    one stays at the top under its flat name, as torch's loader leaves it).

    Two entries at one place, or one inside another's value, are refused: torch's loader (``set_element``)
    keeps whichever comes last, or fails, depending on their order.
    """
    if not isinstance(planner_data, Mapping):
        return flat
    paths: dict[str, tuple[str | int, ...]] = {}
    for fqn in flat:
        path = planner_data.get(fqn, (fqn,))
        if not isinstance(path, (tuple, list)) or not path or not all(type(part) in (str, int) for part in path):
            raise _damaged(folder, f"its planner_data gives {fqn!r} the path {short_repr(path)}, not a list of names")
        paths[fqn] = tuple(path)
    leaves = {path: fqn for fqn, path in reversed(paths.items())}  # the first fqn at each path
    for fqn, path in paths.items():
        other = leaves[path]
        if other != fqn:
            raise _damaged(
                folder,
                f"its planner_data puts {other!r} and {fqn!r} at the same place {list(path)}; one would be lost",
            )
        for end in range(1, len(path)):
            outer = leaves.get(path[:end])
            if outer is not None:
                raise _damaged(
                    folder,
                    f"its planner_data puts {fqn!r} at {list(path)}, inside {outer!r} at {list(path[:end])}; "
                    "one would be lost",
                )
    tree: dict[Any, Any] = {}
    holes = 0  # empty places opened in lists so far
    for fqn, value in flat.items():
        holes = _set_element(tree, paths[fqn], value, fqn, folder, holes)
    return tree


#: Empty places (None) the integer indices of planner_data may open in lists. A saved list leaves a hole
#: only where one of its elements was an empty container, so real checkpoints have a few at most.
_MAX_LIST_HOLES = 1 << 20


def _set_element(
    tree: dict[Any, Any], path: tuple[str | int, ...], value: Any, fqn: str, folder: str, holes: int
) -> int:
    """Put ``value`` at ``path`` as torch's ``set_element`` does; return ``holes``, the empty places opened
    in lists so far, with those it opens.

    A name makes a dict and an integer a list (grown with None up to the index), so a DCP save of
    ``{"extra": [t, {"x": u}]}`` comes back as the same list. What torch's loader cannot do (a name
    inside a list, a negative index) is refused in one line instead of ending in its traceback, and so
    is an index that would open more than :data:`_MAX_LIST_HOLES` places, before the list grows.
    """
    node: Any = tree
    for depth, part in enumerate(path):
        if isinstance(node, list):
            if type(part) is not int:
                raise _damaged(
                    folder,
                    f"its planner_data puts {fqn!r} at {list(path)}, a name inside the list at "
                    f"{list(path[:depth])}; torch's loader fails on it",
                )
            if part < 0:
                raise _damaged(folder, f"its planner_data puts {fqn!r} at {list(path)}, a negative list index")
            grow = part + 1 - len(node)
            if grow > 0:
                holes += grow
                if holes > _MAX_LIST_HOLES:
                    raise _damaged(
                        folder,
                        f"its planner_data asks for lists with more than {_MAX_LIST_HOLES:,} empty places (indices "
                        "far beyond the entries saved); refusing what looks like a hostile file",
                    )
                node.extend([None] * grow)
        if depth == len(path) - 1:
            node[part] = value
            break
        child = node.get(part) if isinstance(node, dict) else node[part]
        if child is None:
            child = {} if type(path[depth + 1]) is str else []
            node[part] = child
        node = child
    return holes
