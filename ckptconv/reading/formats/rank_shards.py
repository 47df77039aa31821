"""Per-rank files of a sharded model saved with ``torch.save``: FSDP2 DTensor and FSDP1 ShardedTensor
state dicts, read as one.

Training frameworks that shard a model with FSDP2 (``fully_shard``) often save
``model.state_dict()`` on every rank with plain ``torch.save``, one file per
rank, without DCP's ``.metadata``: verl writes ``model_world_size_N_rank_R.pt``
beside ``optim_world_size_N_rank_R.pt`` and ``extra_state_world_size_N_rank_R.pt``.
Each value is a ``DTensor``: the rank's local shard (``_local_tensor``) and a
spec naming the device mesh, the rank's coordinates on it and the placements
(``Shard(dim)`` or ``Replicate()`` per mesh dimension).

:func:`read` puts each tensor back together from every rank's shard, read in
place where the shards split the first dimension (the usual ``Shard(0)``), and
pasted once per tensor otherwise. Shards are placed by torch's own rule
(``torch.chunk``: ``ceil(size / n)`` per rank, the last ones shorter or empty),
checked against each shard's shape, and must tile the tensor exactly; partial
(unreduced) and strided placements are refused. Plain tensors (buffers) are
taken from rank 0. Tensors tied in the files stay tied.

FSDP1's ``SHARDED_STATE_DICT`` gives ``ShardedTensor`` values instead: each
rank's local shards with their offsets and sizes, and the global metadata
(the full size and every rank's shard). Those are placed by their own offsets
(uneven shards included), checked against the metadata every rank holds, and
must tile the tensor with no overlap and no hole, as DCP chunks must.
FSDP1's ``LOCAL_STATE_DICT`` (``_flat_param``: each rank's slice of the
flattened, padded parameters) does not record the parameters' shapes, so it
is refused with what to save instead.
"""

from __future__ import annotations

import math
import os
import re
import zipfile
import zlib
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ckptconv._text import short_repr
from ckptconv.dtypes import DType
from ckptconv.errors import CkptconvError, MalformedCheckpointError, UnsupportedFormatError
from ckptconv.reading import read_policy
from ckptconv.reading.formats import torch_zip
from ckptconv.reading.formats._base import ReadResult
from ckptconv.reading.formats.dcp import Assembled, _overlapping_chunks, box_inside, recorded_dtype
from ckptconv.values.standins import ForeignObject
from ckptconv.values.tensor import Storage, TensorRef, contiguous_strides

__all__ = ["FORMAT", "find_files", "read", "sibling_files"]

FORMAT = "rank-shards"

_RANK_FILE = re.compile(r"^(?P<prefix>.*?)(?:world_size_(?P<world>\d+)_)?rank_?(?P<rank>\d+)\.(?:pt|pth|bin)$")


def _damaged(path: str, detail: str) -> MalformedCheckpointError:
    return MalformedCheckpointError(f"{path!r} holds damaged per-rank shards: {detail}", path=path)


def find_files(folder: str) -> list[str] | None:
    """The per-rank model files in ``folder`` (rank order), or None if it holds no complete set.

    Files are grouped by the name before ``rank_R`` (``model_world_size_2_``); a
    group counts when it has ranks ``0..N-1`` (and ``N`` matches a
    ``world_size_N`` in the name), at least two of them. With several groups,
    the one whose name starts with ``model`` is taken; otherwise none is. The
    files must be torch zip files whose pickle makes DTensors: per-rank copies
    of a plain state dict (DDP's) are not a sharded model.
    """
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    groups: dict[str, dict[int, str]] = {}
    worlds: dict[str, set[int]] = {}
    for name in names:
        match = _RANK_FILE.match(name)
        if not match or not os.path.isfile(os.path.join(folder, name)):
            continue
        prefix = match["prefix"] + (f"world_size_{match['world']}_" if match["world"] else "")
        groups.setdefault(prefix, {})[int(match["rank"])] = name
        if match["world"]:
            worlds.setdefault(prefix, set()).add(int(match["world"]))
    complete = {
        prefix: ranks
        for prefix, ranks in groups.items()
        if len(ranks) >= 2
        and sorted(ranks) == list(range(len(ranks)))
        and worlds.get(prefix, {len(ranks)}) == {len(ranks)}
    }
    if len(complete) > 1:
        complete = {prefix: ranks for prefix, ranks in complete.items() if prefix.startswith("model")}
    if len(complete) != 1:
        return None
    (ranks,) = complete.values()
    files = [os.path.join(folder, ranks[rank]) for rank in range(len(ranks))]
    return files if _holds_dtensors(files[0]) else None


def sibling_files(folder: str, files: list[str]) -> list[str]:
    """The other per-rank files of the same run beside ``files`` (verl's ``optim_*`` and
    ``extra_state_*``): same number of ranks, same ``world_size_N`` if named."""
    world = len(files)
    siblings = []
    for name in sorted(os.listdir(folder)):
        match = _RANK_FILE.match(name)
        path = os.path.join(folder, name)
        if match and path not in files and int(match["rank"]) < world and int(match["world"] or world) == world:
            siblings.append(path)
    return siblings


# A pickle that makes DTensors names their class; torch.save writes the pickle as data.pkl.
_DTENSOR_MODULES = (
    b"torch.distributed.tensor",
    b"torch.distributed._tensor",
    b"torch.distributed._shard.sharded_tensor",
)
# FSDP1's name for a flat parameter in LOCAL_STATE_DICT (torch.distributed.fsdp._flat_param.FLAT_PARAM).
_FLAT_PARAM = "_flat_param"
_MAX_PROBE_BYTES = 64 << 20


def _holds_dtensors(path: str) -> bool:
    """True when the torch zip file at ``path`` pickles DTensors (read from its content, not its name)."""
    try:
        with read_policy.open_file(path, folder=os.path.dirname(path)) as file, zipfile.ZipFile(file) as archive:
            for info in archive.infolist():
                if torch_zip.fold_case(info.filename).endswith("data.pkl") and info.file_size <= _MAX_PROBE_BYTES:
                    data = torch_zip.member_bytes(archive, file, info, path, check_crc=False)  # a probe
                    return any(module in data for module in _DTENSOR_MODULES)
    except (CkptconvError, OSError, zipfile.BadZipFile, ValueError, EOFError, NotImplementedError, zlib.error):
        return False
    return False


def _is_dtensor(value: Any) -> bool:
    """True for a DTensor (FSDP2) or a ShardedTensor (FSDP1) stand-in."""
    return isinstance(value, ForeignObject) and value.qualname.endswith((".DTensor", ".ShardedTensor"))


def _is_sharded_tensor(value: Any) -> bool:
    return isinstance(value, ForeignObject) and value.qualname.endswith(".ShardedTensor")


def _box(value: Any, path: str, key: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` of one ShardMetadata, checked to lie inside ``shape``."""
    fields = value.attributes() if isinstance(value, ForeignObject) else {}
    offsets, sizes = fields.get("shard_offsets"), fields.get("shard_sizes")
    box = box_inside(offsets, sizes, shape)
    if box is None:
        raise _damaged(path, f"{key!r} has a shard at {offsets!r} of size {sizes!r} in a tensor of size {list(shape)}")
    return box


def _sharded_tensor(
    value: ForeignObject, path: str, key: str
) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]], list[tuple[tuple[int, ...], TensorRef]]]:
    """``(global shape, every shard's box per the metadata, this rank's (offsets, shard))`` of a ShardedTensor.

    Its pickled state is ``ShardedTensor.__getstate__``'s tuple: local shards, metadata, process
    group state, sharding spec, rrefs.
    """
    state = value.state
    if not isinstance(state, tuple) or len(state) < 2 or not isinstance(state[0], list):
        raise _damaged(path, f"{key!r} is a ShardedTensor without its local shards and metadata")
    local_shards, metadata = state[0], state[1]
    meta = metadata.attributes() if isinstance(metadata, ForeignObject) else {}
    shape: Any = meta.get("size")
    if not isinstance(shape, (tuple, list)) or not all(type(s) is int and s >= 0 for s in shape):
        raise _damaged(path, f"{key!r} has global size {shape!r}")
    shape = tuple(shape)
    listed = meta.get("shards_metadata")
    if not isinstance(listed, list) or not listed:
        raise _damaged(path, f"{key!r} lists no shards in its metadata")
    boxes = [_box(item, path, key, shape) for item in listed]
    pieces: list[tuple[tuple[int, ...], TensorRef]] = []
    for shard in local_shards:
        fields = shard.attributes() if isinstance(shard, ForeignObject) else {}
        tensor = fields.get("tensor")
        if not isinstance(tensor, TensorRef):
            raise _damaged(path, f"a local shard of {key!r} holds no tensor")
        box = _box(fields.get("metadata"), path, key, shape)
        if box not in boxes:
            raise _damaged(path, f"the local shard of {key!r} at {list(box[0])} is not in the tensor's metadata")
        if tensor.shape != box[1]:
            raise _damaged(
                path, f"the local shard of {key!r} at {list(box[0])} is {list(tensor.shape)}, not {list(box[1])}"
            )
        recorded = recorded_dtype(meta.get("tensor_properties"))
        if recorded is not None and tensor.dtype != recorded:
            raise _damaged(
                path,
                f"the local shard of {key!r} at {list(box[0])} holds {tensor.dtype.name} but its metadata records "
                f"{recorded.name}; gathering it would cast, so it is refused rather than read two ways",
            )
        pieces.append((box[0], tensor))
    return shape, boxes, pieces


def _placements(spec: dict[str, Any], path: str, key: str) -> list[int | None]:
    """Per mesh dimension: the tensor dimension it shards, or None for Replicate."""
    placements = spec.get("placements")
    if not isinstance(placements, (tuple, list)) or not placements:
        raise _damaged(path, f"{key!r} has no placements")
    result: list[int | None] = []
    for placement in placements:
        name = placement.qualname.rsplit(".", 1)[-1] if isinstance(placement, ForeignObject) else repr(placement)
        if name == "Replicate":
            result.append(None)
        elif name == "Shard":
            dim = placement.attributes().get("dim")
            if type(dim) is not int or dim < 0:
                raise _damaged(path, f"{key!r} is sharded along dimension {dim!r}")
            result.append(dim)
        else:
            raise UnsupportedFormatError(
                f"{path!r} stores {key!r} with placement {name}, which is not a plain shard or replica "
                "(a partial sum or a strided shard); gather it with torch first",
                path=path,
            )
    return result


def _layout_shape(layout: ForeignObject) -> Any:
    """The mesh shape a pickled ``_MeshLayout`` records, or None.

    torch 2.11 keeps it in ``shape``; torch 2.13 keeps one ``_FlatLayout(shape, stride)`` per mesh
    dimension in ``axes``, a dimension's size the product of its layout's shape (one made by
    flattening others has several).
    """
    fields = layout.attributes()
    if "shape" in fields:
        return fields["shape"]
    axes = fields.get("axes")
    if not isinstance(axes, (tuple, list)):
        return None
    sizes = []
    for axis in axes:
        shape = axis.attributes().get("shape") if isinstance(axis, ForeignObject) else None
        if isinstance(shape, int):
            shape = (shape,)
        if not isinstance(shape, (tuple, list)) or not all(type(s) is int and s > 0 for s in shape):
            return None
        sizes.append(math.prod(shape))
    return tuple(sizes)


def _mesh(spec: dict[str, Any], path: str, key: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The device mesh's shape and this rank's coordinates on it."""
    mesh = spec.get("mesh")
    fields = mesh.attributes() if isinstance(mesh, ForeignObject) else {}
    shape: Any = None
    layout = fields.get("_layout")
    if isinstance(layout, ForeignObject):
        shape = _layout_shape(layout)
    elif isinstance(fields.get("mesh"), TensorRef):
        shape = fields["mesh"].shape
    coordinates = fields.get("_coordinate_on_dim")
    if (
        not isinstance(shape, (tuple, list))
        or not isinstance(coordinates, (tuple, list))
        or len(shape) != len(coordinates)
        or not all(type(s) is int and type(c) is int and 0 <= c < s for s, c in zip(shape, coordinates))
    ):
        raise _damaged(path, f"{key!r} has no readable device mesh (shape {shape!r}, coordinates {coordinates!r})")
    return tuple(shape), tuple(coordinates)


def _check_shard_order(spec: dict[str, Any], placements: list[int | None], path: str, key: str) -> None:
    """Refuse a DTensor whose tensor dimensions are split over mesh dimensions in another order than
    the mesh's (torch 2.13's ``shard_order``): the offsets below split them in the mesh's order.

    torch 2.13 records the order in every spec, as ``ShardOrderEntry(tensor_dim, mesh_dims)`` per
    sharded tensor dimension; an entry must name exactly the mesh dimensions that shard that tensor
    dimension by the placements, in ascending order.
    """
    order = spec.get("shard_order")
    if order is None or order == ():
        return
    expected: dict[int, tuple[int, ...]] = {}
    for mesh_dim, tensor_dim in enumerate(placements):
        if tensor_dim is not None:
            expected[tensor_dim] = (*expected.get(tensor_dim, ()), mesh_dim)
    recorded: dict[int, tuple[int, ...]] = {}
    for entry in order if isinstance(order, (tuple, list)) else [order]:
        fields = entry.attributes() if isinstance(entry, ForeignObject) else {}
        args = entry.args if isinstance(entry, ForeignObject) else ()
        tensor_dim = fields.get("tensor_dim", args[0] if len(args) > 0 else None)
        mesh_dims = fields.get("mesh_dims", args[1] if len(args) > 1 else None)
        if type(tensor_dim) is not int or not isinstance(mesh_dims, (tuple, list)) or tensor_dim in recorded:
            raise _damaged(path, f"{key!r} has a shard order {short_repr(order)} that is not torch's")
        if mesh_dims:
            recorded[tensor_dim] = tuple(mesh_dims)
    if {dim: tuple(sorted(dims)) for dim, dims in recorded.items()} != expected:
        raise _damaged(path, f"{key!r} has a shard order {short_repr(order)} that does not match its placements")
    if any(list(dims) != sorted(dims) for dims in recorded.values()):
        raise UnsupportedFormatError(
            f"{path!r} stores {key!r} split over the mesh's dimensions in another order than the mesh's "
            f"(shard order {short_repr(order)}), which ckptconv does not place; gather it with torch first",
            path=path,
        )


def _chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` when ``torch.chunk`` splits ``size`` into ``parts``."""
    full = -(-size // parts) if parts else 0
    start = min(index * full, size)
    return start, max(0, min(size, start + full) - start)


def _shard(value: ForeignObject, path: str, key: str) -> tuple[tuple[int, ...], tuple[int, ...], TensorRef]:
    """``(global shape, offsets, local shard)`` of one rank's DTensor."""
    fields = value.attributes()
    local, spec = fields.get("_local_tensor"), fields.get("_spec")
    if not isinstance(local, TensorRef) or not isinstance(spec, ForeignObject):
        raise _damaged(path, f"{key!r} is a DTensor without its local tensor or spec")
    spec_fields = spec.attributes()
    meta = spec_fields.get("tensor_meta")
    shape: Any = meta.args[0] if isinstance(meta, ForeignObject) and meta.args else None
    if shape is None and len(value.args) > 2:
        shape = value.args[2]
    if not isinstance(shape, (tuple, list)) or not all(type(s) is int and s >= 0 for s in shape):
        raise _damaged(path, f"{key!r} has global shape {shape!r}")
    shape = tuple(shape)
    placements = _placements(spec_fields, path, key)
    mesh_shape, coordinates = _mesh(spec_fields, path, key)
    if len(placements) != len(mesh_shape):
        raise _damaged(path, f"{key!r} has {len(placements)} placements for a {len(mesh_shape)}-D mesh")
    _check_shard_order(spec_fields, placements, path, key)
    offsets = [0] * len(shape)
    sizes = list(shape)
    for dim, parts, index in zip(placements, mesh_shape, coordinates):
        if dim is None:
            continue
        if dim >= len(shape):
            raise _damaged(path, f"{key!r} of {len(shape)} dimensions is sharded along dimension {dim}")
        start, length = _chunk(sizes[dim], parts, index)
        offsets[dim] += start
        sizes[dim] = length
    if tuple(sizes) != local.shape:
        raise _damaged(
            path, f"{key!r}: this rank's shard is {list(local.shape)}, but its placement gives {sizes} of {list(shape)}"
        )
    return shape, tuple(offsets), local


def _local_tensor(value: ForeignObject) -> Any:
    """Rank 0's local tensor of a DTensor, or its first local shard's of a ShardedTensor (for ties)."""
    if not _is_sharded_tensor(value):
        return value.attributes().get("_local_tensor")
    state = value.state
    if isinstance(state, tuple) and state and isinstance(state[0], list) and state[0]:
        first = state[0][0]
        return first.attributes().get("tensor") if isinstance(first, ForeignObject) else None
    return None


def _empty_dtype(value: ForeignObject, path: str, key: str) -> Any:
    """The dtype of a tensor with no elements (no shard holds any): the one torch recorded."""
    local = _local_tensor(value)
    if isinstance(local, TensorRef):
        return local.dtype
    dtype = value.args[1] if len(value.args) > 1 else None
    if isinstance(dtype, DType):
        return dtype
    raise _damaged(path, f"{key!r} records no dtype")


def _dtensor_pieces(
    files: list[str], trees: list[Mapping[str, Any]], key: str
) -> tuple[dict[tuple[int, ...], TensorRef], tuple[int, ...]]:
    """Every rank's DTensor shard of ``key`` by its offsets, and the global shape."""
    pieces: dict[tuple[int, ...], TensorRef] = {}
    shape: tuple[int, ...] = ()
    for path, tree in zip(files, trees):
        other = tree[key]
        if not _is_dtensor(other) or _is_sharded_tensor(other):
            raise _damaged(path, f"{key!r} is not a DTensor here but is on rank 0")
        rank_shape, offsets, local = _shard(other, path, key)
        if path is files[0]:
            shape = rank_shape
        elif rank_shape != shape:
            raise _damaged(path, f"{key!r} has global shape {list(rank_shape)} here, {list(shape)} on rank 0")
        if local.numel:
            pieces.setdefault(offsets, local)  # replicas of a shard: the first rank's
    return pieces, shape


def _sharded_tensor_pieces(
    files: list[str], trees: list[Mapping[str, Any]], key: str
) -> tuple[dict[tuple[int, ...], TensorRef], tuple[int, ...]]:
    """Every rank's ShardedTensor shards of ``key`` by their offsets, and the global shape.

    Every rank holds the same metadata (all shards' boxes); each rank's local shards must be
    in it, and together the ranks must hold every shard it lists.
    """
    pieces: dict[tuple[int, ...], TensorRef] = {}
    shape: tuple[int, ...] = ()
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for path, tree in zip(files, trees):
        other = tree[key]
        if not _is_sharded_tensor(other):
            raise _damaged(path, f"{key!r} is not a ShardedTensor here but is on rank 0")
        rank_shape, rank_boxes, local = _sharded_tensor(other, path, key)
        if path is files[0]:
            shape, boxes = rank_shape, rank_boxes
        elif (rank_shape, sorted(rank_boxes)) != (shape, sorted(boxes)):
            raise _damaged(path, f"the metadata of {key!r} here differs from rank 0's")
        for offsets, tensor in local:
            if tensor.numel:
                pieces.setdefault(offsets, tensor)
    held = set(pieces)
    missing = [list(offsets) for offsets, sizes in boxes if math.prod(sizes) and offsets not in held]
    if missing:
        raise _damaged(files[0], f"no rank holds the shard of {key!r} at {missing[0]} that its metadata lists")
    return pieces, shape


def read(folder: str, *, max_items: int | None = None) -> ReadResult:
    """Read a folder of per-rank DTensor state dicts as one state dict; see the module docstring.

    Raises:
        UnsupportedFormatError: the files hold no DTensors, or placements ckptconv cannot place.
        MalformedCheckpointError: the ranks disagree or their shards do not tile a tensor.
    """
    files = find_files(folder)
    if files is None:
        raise UnsupportedFormatError(f"{folder!r} holds no complete set of per-rank files", path=folder)
    foreign: Counter[str] = Counter()
    devices: set[str] = set()
    trees: list[Mapping[str, Any]] = []
    files = [read_policy.member(folder, os.path.basename(path), source=folder, what="rank file") for path in files]
    for path in files:
        result = torch_zip.read(path, max_items=max_items)
        foreign.update(result.foreign_globals)
        devices.update(result.saved_devices)
        if not isinstance(result.tree, Mapping):
            raise _damaged(path, "it does not hold a state dict")
        trees.append(result.tree)
    first = trees[0]
    if not any(_is_dtensor(value) for value in first.values()):
        raise UnsupportedFormatError(
            f"{folder!r} holds per-rank files ({os.path.basename(files[0])}, ...) without DTensors; "
            "give the file of one rank to read it alone",
            path=folder,
        )
    flat = [key for key in first if isinstance(key, str) and key.rsplit(".", 1)[-1] == _FLAT_PARAM]
    if flat:
        raise UnsupportedFormatError(
            f"{folder!r} holds FSDP1 LOCAL_STATE_DICT files ({len(files)} ranks, flat parameter {flat[0]!r}"
            f"{f' and {len(flat) - 1} more' if len(flat) > 1 else ''}): each rank's slice of the flattened "
            "parameters, which does not record their shapes, so they cannot be rebuilt exactly; save with "
            "SHARDED_STATE_DICT or FULL_STATE_DICT and convert that",
            path=folder,
        )
    for path, tree in zip(files[1:], trees[1:]):
        if list(tree) != list(first):
            raise _damaged(path, f"its keys differ from those of {os.path.basename(files[0])}")
    weights: dict[str, Any] = {}
    built: dict[Any, TensorRef] = {}
    placements: Counter[str] = Counter()
    for key, value in first.items():
        if not _is_dtensor(value):
            weights[key] = value  # buffers and plain values: rank 0's
            continue
        # Tied parameters are separate DTensors whose local shards view the same storage, on every
        # rank: a rank where they do not holds other values for one of them.
        locals_ = [_local_tensor(tree[key]) if _is_dtensor(tree[key]) else None for tree in trees]
        shards = [local for local in locals_ if isinstance(local, TensorRef)]
        tie: Any = (
            tuple((id(local.storage), local.offset, local.shape, local.stride) for local in shards)
            if len(shards) == len(trees)
            else key
        )
        if tie in built:
            weights[key] = built[tie]
            continue
        sharded = _is_sharded_tensor(value)
        pieces, shape = (
            _sharded_tensor_pieces(files, trees, str(key)) if sharded else _dtensor_pieces(files, trees, str(key))
        )
        dtypes = {piece.dtype for piece in pieces.values()}
        if len(dtypes) > 1 or sum(piece.numel for piece in pieces.values()) != math.prod(shape):
            raise _damaged(folder, f"the ranks' shards of {key!r} do not tile a tensor of size {list(shape)}")
        # Equal volumes are not enough: an overlap can hide a hole.
        overlap = _overlapping_chunks([(offsets, piece.shape) for offsets, piece in pieces.items()])
        if overlap is not None:
            raise _damaged(
                folder,
                f"the shards of {key!r} at {list(overlap[0])} and {list(overlap[1])} overlap, so part of the "
                "tensor has two values and part none",
            )
        if sharded:
            placements["ShardedTensor shards placed by their offsets"] += 1
        else:
            spec = value.attributes()["_spec"].attributes()
            placements[
                ", ".join("Replicate()" if d is None else f"Shard({d})" for d in _placements(spec, folder, key))
            ] += 1
        dtype = next(iter(dtypes)) if dtypes else _empty_dtype(value, folder, str(key))
        source = Assembled(tuple(pieces.items()), shape, dtype.itemsize)
        ref = TensorRef(
            Storage(math.prod(shape) * dtype.itemsize, source, name=str(key)), dtype, shape, contiguous_strides(shape)
        )
        built[tie] = ref
        weights[key] = ref
    framework = (
        "FSDP1 SHARDED_STATE_DICT (ShardedTensor) saved per rank with torch.save"
        if any(_is_sharded_tensor(value) for value in first.values())
        else "FSDP2 / DTensor state dicts saved per rank with torch.save"
    )
    metadata = {
        "framework": framework,
        "world_size": str(len(files)),
        "files": f"{os.path.basename(files[0])} ... {os.path.basename(files[-1])}",
        "placements": "; ".join(f"{text}: {count} tensors" for text, count in placements.items()),
    }
    return ReadResult(FORMAT, weights, foreign_globals=foreign, saved_devices=frozenset(devices), metadata=metadata)
