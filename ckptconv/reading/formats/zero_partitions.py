"""ZeRO's partitions: each parameter reassembled from the flat per-rank slices of fp32 master weights that
DeepSpeed's optimizer states hold (stages 1 and 2: laid end to end per group; stage 3: the same offset of
every rank), checked against the layout DeepSpeed recorded. :mod:`ckptconv.reading.formats.deepspeed`
finds the files and reads them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ckptconv.dtypes import DType
from ckptconv.errors import MalformedCheckpointError
from ckptconv.reading.formats.dcp import Assembled
from ckptconv.reading.sources import InMemory
from ckptconv.values.standins import ForeignObject
from ckptconv.values.tensor import Storage, TensorRef, contiguous_strides


def _int(value: Any) -> int | None:
    """An int, or the value of a stand-in enum (``ZeroStageEnum(2)``)."""
    if type(value) is int:
        return value
    if isinstance(value, ForeignObject) and len(value.args) == 1 and type(value.args[0]) is int:
        return value.args[0]
    return None


def _shape(value: Any, path: str, name: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise damaged(path, f"parameter {name!r} has shape {value!r}")
    return tuple(value)


def _flat(value: Any, path: str, what: str) -> TensorRef:
    if not isinstance(value, TensorRef) or len(value.shape) != 1 or not value.is_contiguous:
        raise damaged(path, f"its {what} is not a flat tensor")
    return value


def _piece(flat: TensorRef, start: int, length: int) -> TensorRef:
    """Elements ``[start, start + length)`` of a flat tensor, as a view of the same storage."""
    return TensorRef(flat.storage, flat.dtype, (length,), (1,), flat.offset + start)


def _joined(pieces: list[tuple[int, TensorRef]], shape: tuple[int, ...], name: str, dtype: DType) -> TensorRef:
    """One tensor of ``shape`` made of flat pieces at element offsets, read in place."""
    numel = math.prod(shape)
    if not pieces:
        return TensorRef(Storage(0, InMemory(b""), name=name), dtype, shape, contiguous_strides(shape))
    # Always a storage of its own, even for a piece of one partition: parameters that
    # share a partition are not tied, and writers must not see them as views of one storage.
    source = Assembled(tuple(((start,), piece) for start, piece in pieces), (numel,), dtype.itemsize)
    storage = Storage(numel * dtype.itemsize, source, name=name)
    return TensorRef(storage, dtype, shape, contiguous_strides(shape))


def _spans(groups: list[TensorRef], start: int, length: int) -> list[tuple[int, TensorRef]]:
    """Pieces covering ``[start, start + length)`` of flat groups laid end to end: ``(position, piece)``."""
    pieces: list[tuple[int, TensorRef]] = []
    base = 0
    for group in groups:
        size = group.shape[0]
        lo, hi = max(start, base), min(start + length, base + size)
        if lo < hi:
            pieces.append((lo - start, _piece(group, lo - base, hi - lo)))
        base += size
    return pieces


def _refuse_names_described_twice(param_shapes: list[Mapping[str, Any]], frozen: Any, model_file: str) -> None:
    """Refuse a parameter that ``param_shapes`` lists in two groups, or that is both trained and frozen.

    zero_to_fp32 reads such a file two ways: stage 3 merges the groups' names
    into one dict (the name is placed once, and its check then fails), stages 1
    and 2 place it twice and keep the last values.
    """
    seen: dict[str, int] = {}
    for index, group in enumerate(param_shapes):
        for name in group:
            if name in seen:
                raise damaged(
                    model_file,
                    f"parameter {name!r} is described in parameter groups {seen[name]} and {index}, so its values "
                    "could come from either; zero_to_fp32 reads it two ways",
                )
            seen[name] = index
    if isinstance(frozen, Mapping):
        for name in frozen:
            if name in seen:
                raise damaged(
                    model_file,
                    f"parameter {name!r} is described both as trained (group {seen[name]}) and as frozen, so its "
                    "values could come from either",
                )


def _frozen(
    weights: dict[str, TensorRef],
    *,
    models: list[Mapping[str, Any]],
    model_files: dict[int, str],
    stage: int,
    world: int,
    module: Mapping[str, Any],
    param_shapes: list[Mapping[str, Any]],
    buffer_names: Any,
) -> None:
    """Frozen (``requires_grad=False``) parameters, in their saved dtype."""
    model_file = model_files[0]
    shapes = models[0].get("frozen_param_shapes")
    if not shapes:
        if stage == 1:
            # Stage 1 records none: take the module's own weights for what is neither
            # trained, a buffer nor a tied alias.
            trained = {name for group in param_shapes for name in group}
            shared = models[0].get("shared_params") or {}
            for name, value in module.items():
                if (
                    isinstance(value, TensorRef)
                    and name not in trained
                    and name not in buffer_names
                    and name not in shared
                ):
                    weights[name] = value
        return
    if not isinstance(shapes, Mapping):
        raise damaged(model_file, "its frozen_param_shapes is not a mapping")
    for name, raw_shape in shapes.items():
        shape = _shape(raw_shape, model_file, name)
        numel = math.prod(shape)
        if stage < 3:
            fragments = models[0].get("frozen_param_fragments") or {}
            value = fragments.get(name) if isinstance(fragments, Mapping) else None
            if not isinstance(value, TensorRef) or value.numel != numel:
                raise damaged(model_file, f"frozen parameter {name!r} has no fragment of {numel} elements")
            if value.shape != shape:
                # DeepSpeed saves stage 1-2 frozen parameters whole; zero_to_fp32 takes the
                # fragment's own shape, a model the recorded one.
                raise damaged(
                    model_file,
                    f"frozen parameter {name!r} is recorded as {list(shape)} but saved as {list(value.shape)}",
                )
            weights[name] = value
            continue
        pieces: list[tuple[int, TensorRef]] = []
        position = 0
        dtypes: set[DType] = set()
        for rank in range(world):
            fragments = models[rank].get("frozen_param_fragments") or {}
            value = fragments.get(name) if isinstance(fragments, Mapping) else None
            if not isinstance(value, TensorRef):
                raise damaged(model_files[rank], f"it has no fragment of frozen parameter {name!r}")
            value = _flat(value, model_files[rank], f"fragment of {name!r}")
            dtypes.add(value.dtype)
            take = min(value.shape[0], numel - position)
            if take > 0:
                pieces.append((position, _piece(value, 0, take)))
                position += take
        if position != numel or len(dtypes) != 1:
            raise damaged(model_file, f"the ranks' fragments of frozen parameter {name!r} do not make {list(shape)}")
        weights[name] = _joined(pieces, shape, name, dtypes.pop())


def _trainable_stage12(
    weights: dict[str, TensorRef],
    *,
    flats: list[list[TensorRef]],
    param_shapes: list[Mapping[str, Any]],
    world: int,
    paddings: Any,
    folder: str,
    model_file: str,
) -> list[list[dict[str, tuple[int, int]]]]:
    """Rebuild the trained parameters of stages 1 and 2 into ``weights``.

    Returns:
        Per rank, per group: ``{name: (numel, start)}`` of the parameter pieces that rank holds,
        to compare with DeepSpeed's own ``param_slice_mappings``.
    """
    fragments: list[list[dict[str, tuple[int, int]]]] = [[] for _ in flats]
    if len(param_shapes) != len(flats[0]):
        raise damaged(folder, f"{len(param_shapes)} parameter groups are described but {len(flats[0])} are saved")
    align = 2 * world
    for index, shapes in enumerate(param_shapes):
        partitions = [groups[index] for groups in flats]
        if len({part.dtype for part in partitions}) != 1:
            raise damaged(folder, f"the ranks' partitions of group {index} have different dtypes")
        starts = [0]
        for rank, part in enumerate(partitions):
            starts.append(starts[-1] + part.shape[0])
            fragments[rank].append({})
        available = starts[-1]
        group_paddings = None
        if isinstance(paddings, list) and index < len(paddings):
            group_paddings = paddings[index]
            if not isinstance(group_paddings, list) or len(group_paddings) != len(shapes):
                raise damaged(folder, f"group {index} has {len(shapes)} parameters but other alignment paddings")
        offset = 0
        for position, (name, raw_shape) in enumerate(shapes.items()):
            shape = _shape(raw_shape, model_file, name)
            numel = math.prod(shape)
            if offset + numel > available:
                raise damaged(folder, f"parameter {name!r} lies past the end of group {index}'s partitions")
            pieces = []
            for rank, (start, part) in enumerate(zip(starts, partitions)):
                lo, hi = max(offset, start), min(offset + numel, start + part.shape[0])
                if lo < hi:
                    pieces.append((lo - offset, _piece(part, lo - start, hi - lo)))
                    fragments[rank][index][name] = (hi - lo, lo - start)
            weights[name] = _joined(pieces, shape, name, partitions[0].dtype)
            offset += numel
            if group_paddings is not None:
                pad = group_paddings[position]
                if type(pad) is not int or pad < 0:
                    raise damaged(folder, f"parameter {name!r} has alignment padding {pad!r}")
                offset += pad
        # zero_to_fp32's own sanity check: only padding up to 2 * world_size may be left over.
        if -(-offset // align) * align != -(-available // align) * align:
            raise damaged(folder, f"group {index} holds {available} elements but its parameters use {offset}")
    return fragments


def _check_slice_mappings(mappings: Any, expected: list[dict[str, tuple[int, int]]], path: str) -> None:
    """Compare DeepSpeed's record of where each parameter's piece lies in this rank's partitions
    (``fragment_address(numel, start)`` per group) with the layout ckptconv rebuilt."""
    if mappings is None:
        return  # older DeepSpeed versions do not record them
    if not isinstance(mappings, list) or len(mappings) != len(expected):
        raise damaged(path, "its param_slice_mappings do not match its parameter groups")
    for index, (recorded, computed) in enumerate(zip(mappings, expected)):
        if not isinstance(recorded, Mapping):
            raise damaged(path, f"its param_slice_mappings for group {index} are not a mapping")
        found: dict[str, tuple[int, int]] = {}
        for name, address in recorded.items():
            fields = address.attributes() if isinstance(address, ForeignObject) else {}
            found[name] = (fields.get("numel"), fields.get("start"))  # type: ignore[assignment]
        if found != computed:
            raise damaged(
                path,
                f"group {index} holds its parameters at {found}, not where their shapes place them "
                f"({computed}); the layout is not one ckptconv knows",
            )


def _trainable_stage3(
    weights: dict[str, TensorRef],
    *,
    flats: list[list[TensorRef]],
    param_shapes: list[Mapping[str, Any]],
    world: int,
    folder: str,
    model_file: str,
) -> None:
    sizes = [group.shape[0] for group in flats[0]]
    if any([group.shape[0] for group in groups] != sizes for groups in flats):
        raise damaged(folder, "the ranks' flat parameter groups differ in size")
    if len({group.dtype for groups in flats for group in groups}) != 1:
        raise damaged(folder, "the ranks' flat parameter groups differ in dtype")
    per_rank = sum(sizes)
    offset = 0
    for shapes in param_shapes:
        for name, raw_shape in shapes.items():
            shape = _shape(raw_shape, model_file, name)
            numel = math.prod(shape)
            part = -(-numel // world)
            if offset + part > per_rank:
                raise damaged(folder, f"parameter {name!r} lies past the end of the ranks' partitions")
            pieces: list[tuple[int, TensorRef]] = []
            for rank in range(world):
                first = rank * part
                take = min(part, numel - first)
                if take <= 0:
                    break
                pieces.extend((first + at, piece) for at, piece in _spans(flats[rank], offset, take))
            weights[name] = _joined(pieces, shape, name, flats[0][0].dtype)
            offset += part
    if offset != per_rank:
        raise damaged(folder, f"each rank holds {per_rank} elements but the parameters use {offset}")


def damaged(path: str, detail: str) -> MalformedCheckpointError:
    return MalformedCheckpointError(f"{path!r} is a damaged DeepSpeed checkpoint: {detail}", path=path)
