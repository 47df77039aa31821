"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3): reading a training run's folder as one set of weights.

Layout (``DeepSpeedEngine.save_checkpoint``; see ``deepspeed/utils/zero_to_fp32.py``)::

    run/latest                                     the newest tag, e.g. "global_step1000"
    run/<tag>/mp_rank_00_model_states.pt           stages 1-2: the module's 16-bit weights and buffers,
                                                   param_shapes, shared_params, frozen params, client state
    run/<tag>/zero_pp_rank_R_mp_rank_00_model_states.pt   stage 3: one per rank (its frozen fragments)
    run/<tag>/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt
                                                   one per data-parallel rank: that rank's slice of the
                                                   fp32 master weights, flat, one tensor per param group
                                                   (plus Adam's moments, which are never read)

The fp32 master weights are rebuilt exactly as ``zero_to_fp32`` rebuilds them,
without importing deepspeed or running its pickles, and without loading an
optimizer file into memory: each parameter is a :class:`~ckptconv.formats.dcp.Assembled`
tensor whose pieces are byte ranges of the rank files, read where they lie.

- Stages 1 and 2: a group's flat vector is the ranks' partitions end to end;
  parameters follow each other in ``param_shapes`` order (plus
  ``param_alignment_paddings`` when recorded); the end is padded to a multiple
  of ``2 * world_size``.
- Stage 3: each parameter is split into ``ceil(numel / world_size)`` elements
  per rank at the same offset of every rank's groups (laid end to end); the
  last rank's piece is padded.
- Frozen parameters come from ``frozen_param_fragments`` in their saved 16-bit
  dtype (stage 3: concatenated over the ranks' model files), buffers from the
  module (floating-point ones widened to fp32, as ``zero_to_fp32`` does),
  tied parameters (``shared_params``) become one tensor under both names.
- ``BF16_Optimizer`` files (ZeRO-1 with bf16 and fp32 gradient accumulation)
  record no stage and ``zero_to_fp32`` refuses them; they are laid out as
  stage 1, which DeepSpeed's ``param_slice_mappings`` (where each parameter's
  piece lies in each rank's partition) must confirm. Those mappings are
  checked for every stage 1 and 2 checkpoint that has them.
- Stage 1 files record no frozen parameters (``zero_to_fp32`` then drops
  them, and its result does not load with ``strict=True``); ckptconv takes
  them from the module's saved weights, the values they had in training.

The tree :func:`read` returns holds ``state_dict`` (the fp32 master weights,
what the selection picks by default), ``module`` (the 16-bit weights as
saved, stages 1-2; ``--select module``) and the run's plain data (steps,
``ds_config``, client state).
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from .. import read_policy
from ..dtypes import DType, parse_cast_target
from ..errors import MalformedCheckpointError, UnsupportedFormatError
from ..standins import ForeignObject
from ..tensor import InMemory, Storage, TensorRef, contiguous_strides
from . import torch_zip
from ._base import ReadResult
from .dcp import Assembled

__all__ = ["FORMAT", "checkpoint_files", "find_checkpoint", "read"]

FORMAT = "deepspeed"
LATEST = "latest"
_MAX_LATEST_BYTES = 4096

_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")

# Entries of the model-states file that describe the layout, not the run.
_LAYOUT_KEYS = frozenset(
    {
        "module",
        "optimizer",
        "buffer_names",
        "param_shapes",
        "frozen_param_shapes",
        "frozen_param_fragments",
        "shared_params",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
    }
)


def _damaged(path: str, detail: str) -> MalformedCheckpointError:
    return MalformedCheckpointError(f"{path!r} is a damaged DeepSpeed checkpoint: {detail}", path=path)


def _is_tag_folder(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(_OPTIM.match(name) for name in names) and any(_MODEL.match(n) or _MODEL3.match(n) for n in names)


def find_checkpoint(path: str) -> str | None:
    """The tag folder holding a DeepSpeed checkpoint for ``path``, or None if it is not one.

    ``path`` is the folder ``save_checkpoint`` wrote into (with ``latest``) or a
    tag folder (``global_step1000/``).

    Raises:
        MalformedCheckpointError: ``latest`` names a tag that is missing or outside the folder.
    """
    if _is_tag_folder(path):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest) and os.path.getsize(latest) <= _MAX_LATEST_BYTES:
        raw = read_policy.read_limited(latest, limit=_MAX_LATEST_BYTES, folder=path, what="DeepSpeed 'latest' file")
        tag = raw.decode("utf-8", "replace").strip()
        if not tag or "/" in tag or "\\" in tag or "\x00" in tag or tag in (".", ".."):
            raise _damaged(path, f"its 'latest' file names {tag!r}, not a tag folder")
        folder = os.path.join(path, tag)
        if os.path.exists(folder) and not read_policy.inside(folder, path):
            raise _damaged(path, f"its 'latest' names {tag!r}, a link that leads outside the run folder")
        if not _is_tag_folder(folder):
            raise MalformedCheckpointError(
                f"{path!r} is a DeepSpeed checkpoint whose 'latest' names {tag!r}, but {folder!r} holds no "
                "model and optimizer states; give the tag folder to read",
                path=path,
            )
        return folder
    return None


def checkpoint_files(path: str) -> list[str] | None:
    """Every file the checkpoint at ``path`` consists of (``latest`` and the tag folder's files), or None."""
    tag = find_checkpoint(path)
    if tag is None:
        return None
    files = [] if tag == path else [os.path.join(path, LATEST)]
    files += sorted(os.path.join(tag, name) for name in os.listdir(tag) if os.path.isfile(os.path.join(tag, name)))
    return files


def _rank_files(folder: str, pattern: re.Pattern[str], what: str) -> dict[int, str]:
    """``{rank: path}`` for files named by ``pattern``; only model-parallel rank 0 (no TP/PP)."""
    found: dict[int, str] = {}
    prefixes: set[str] = set()
    for name in os.listdir(folder):
        match = pattern.match(name)
        if not match:
            continue
        groups = match.groups()
        if pattern is _OPTIM:
            prefixes.add(groups[0] or "")
            groups = groups[1:]
        rank, mp_rank = int(groups[0]), int(groups[1])
        if mp_rank != 0:
            raise UnsupportedFormatError(
                f"{folder!r} is a DeepSpeed checkpoint with tensor or pipeline parallelism ({name}); "
                "ckptconv merges data-parallel (ZeRO) ranks only",
                path=folder,
            )
        found[rank] = read_policy.member(folder, name, source=folder, what=f"{what} file")
    if len(prefixes) > 1:
        raise MalformedCheckpointError(
            f"{folder!r} holds both bf16_zero_pp_rank_* and zero_pp_rank_* {what} files (left over from "
            "another run?); remove the stale ones",
            path=folder,
        )
    if sorted(found) != list(range(len(found))):
        raise MalformedCheckpointError(
            f"{folder!r} is incomplete: it holds {what} files for ranks {sorted(found)}, not 0..{len(found) - 1}",
            path=folder,
        )
    return found


def _int(value: Any) -> int | None:
    """An int, or the value of a stand-in enum (``ZeroStageEnum(2)``)."""
    if type(value) is int:
        return value
    if isinstance(value, ForeignObject) and len(value.args) == 1 and type(value.args[0]) is int:
        return value.args[0]
    return None


def _shape(value: Any, path: str, name: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise _damaged(path, f"parameter {name!r} has shape {value!r}")
    return tuple(value)


def _flat(value: Any, path: str, what: str) -> TensorRef:
    if not isinstance(value, TensorRef) or len(value.shape) != 1 or not value.is_contiguous:
        raise _damaged(path, f"its {what} is not a flat tensor")
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


def read(path: str, *, max_items: int | None = None) -> ReadResult:
    """Read a DeepSpeed ZeRO checkpoint folder lazily; see the module docstring for what it holds.

    Raises:
        UnsupportedFormatError: not a ZeRO checkpoint ckptconv can merge (tensor/pipeline parallel,
            an optimizer without ZeRO partitions).
        MalformedCheckpointError: files are missing or disagree with each other.
    """
    folder = find_checkpoint(path)
    if folder is None:
        raise UnsupportedFormatError(f"{path!r} is not a DeepSpeed checkpoint folder", path=path)
    foreign: Counter[str] = Counter()
    devices: set[str] = set()

    def load(file: str) -> Any:
        result = torch_zip.read(file, max_items=max_items)
        foreign.update(result.foreign_globals)
        devices.update(result.saved_devices)
        return result.tree

    optim_files = _rank_files(folder, _OPTIM, "optimizer")
    optim: list[Mapping[str, Any]] = []
    for rank in range(len(optim_files)):
        tree = load(optim_files[rank])
        state = tree.get("optimizer_state_dict") if isinstance(tree, Mapping) else None
        if not isinstance(state, Mapping):
            raise _damaged(optim_files[rank], "it holds no optimizer_state_dict")
        optim.append(state)
    first = optim[0]
    stage = _int(first.get("zero_stage"))
    bf16_optimizer = stage is None and "single_partition_of_fp32_groups" in first
    if bf16_optimizer:
        # DeepSpeed's BF16_Optimizer (ZeRO-1 with bf16 and fp32 gradient accumulation) records no
        # stage, and zero_to_fp32 refuses it; its partitions are laid out as stage 1's, which
        # param_slice_mappings (required here) must confirm.
        stage = 1
        if not all(isinstance(state.get("param_slice_mappings"), list) for state in optim):
            raise UnsupportedFormatError(
                f"{folder!r} was saved by DeepSpeed's BF16_Optimizer without param_slice_mappings, so its "
                "layout cannot be checked; zero_to_fp32 refuses it too",
                path=folder,
            )
    if stage is None:
        raise _damaged(optim_files[0], "its optimizer state names no ZeRO stage")
    if stage not in (1, 2, 3):
        raise UnsupportedFormatError(f"{folder!r} is a ZeRO stage {stage} checkpoint; stages 1-3 are supported")
    counts = first.get("partition_count")
    world = max(counts) if isinstance(counts, list) and counts and all(type(c) is int for c in counts) else counts
    if type(world) is not int or world < 1:
        raise _damaged(optim_files[0], f"its partition_count is {counts!r}")
    if world != len(optim):
        raise MalformedCheckpointError(
            f"{folder!r} is incomplete: ZeRO was run on {world} ranks but {len(optim)} optimizer files are "
            "there (an overwritten checkpoint, or a rank that did not save?)",
            path=folder,
        )
    groups_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    flats: list[list[TensorRef]] = []
    for rank, state in enumerate(optim):
        groups = state.get(groups_key)
        if not isinstance(groups, list) or not groups:
            raise _damaged(optim_files[rank], f"its optimizer state has no {groups_key}")
        flats.append([_flat(group, optim_files[rank], groups_key) for group in groups])
    if any(len(groups) != len(flats[0]) for groups in flats):
        raise _damaged(folder, "the ranks' optimizer files hold different numbers of parameter groups")

    if stage == 3:
        model_files = _rank_files(folder, _MODEL3, "model states")
    else:
        if not os.path.lexists(os.path.join(folder, "mp_rank_00_model_states.pt")):
            raise MalformedCheckpointError(f"{folder!r} is incomplete: mp_rank_00_model_states.pt is missing")
        single = read_policy.member(folder, "mp_rank_00_model_states.pt", source=folder, what="model states file")
        model_files = {0: single}
    if stage == 3 and len(model_files) != world:
        raise MalformedCheckpointError(
            f"{folder!r} is incomplete: {len(model_files)} model states files for {world} ranks", path=folder
        )
    models: list[Mapping[str, Any]] = []
    for rank in range(len(model_files)):
        tree = load(model_files[rank])
        if not isinstance(tree, Mapping) or "buffer_names" not in tree or "param_shapes" not in tree:
            raise _damaged(model_files[rank], "it is not a DeepSpeed model states file")
        models.append(tree)
    model = models[0]
    model_file = model_files[0]
    module = model.get("module")
    if not isinstance(module, Mapping):
        raise _damaged(model_file, "it holds no module state dict")

    param_shapes = model.get("param_shapes")
    if not isinstance(param_shapes, list) or not all(isinstance(group, Mapping) for group in param_shapes):
        raise _damaged(model_file, "its param_shapes is not a list of groups")

    _refuse_names_described_twice(param_shapes, model.get("frozen_param_shapes"), model_file)

    weights: dict[str, TensorRef] = {}
    # Buffers, widened to fp32 as zero_to_fp32 does (exact: every 16-bit value is an fp32 value).
    buffer_names = model.get("buffer_names") or []
    float32 = parse_cast_target("fp32")
    for name in buffer_names:
        value = module.get(name)
        if isinstance(value, TensorRef):
            weights[name] = value.cast(float32) if value.dtype.is_floating_point else value
    before = len(weights)
    _frozen(
        weights,
        models=models,
        model_files=model_files,
        stage=stage,
        world=world,
        module=module,
        param_shapes=param_shapes,
        buffer_names=buffer_names,
    )
    taken_from_module = len(weights) - before if stage == 1 and not model.get("frozen_param_shapes") else 0
    if stage == 3:
        _trainable_stage3(
            weights, flats=flats, param_shapes=param_shapes, world=world, folder=folder, model_file=model_file
        )
    else:
        fragments = _trainable_stage12(
            weights,
            flats=flats,
            param_shapes=param_shapes,
            world=world,
            paddings=first.get("param_alignment_paddings"),
            folder=folder,
            model_file=model_file,
        )
        for rank, state in enumerate(optim):
            _check_slice_mappings(state.get("param_slice_mappings"), fragments[rank], optim_files[rank])
    shared = model.get("shared_params") or {}
    if isinstance(shared, Mapping):
        for alias, target in shared.items():
            if isinstance(alias, str) and target in weights:
                weights[alias] = weights[target]

    result: dict[str, Any] = {"state_dict": weights}
    if stage < 3:
        result["module"] = dict(module)
    result.update({k: v for k, v in model.items() if isinstance(k, str) and k not in _LAYOUT_KEYS})
    master = Counter(group.dtype.name for group in flats[0])
    saved = Counter(ref.dtype.name for k, ref in module.items() if isinstance(ref, TensorRef) and k not in buffer_names)
    metadata = {
        "framework": f"DeepSpeed {model.get('ds_version') or ''}".strip(),
        "zero_stage": "1 (BF16_Optimizer: laid out as stage 1, checked against param_slice_mappings)"
        if bf16_optimizer
        else str(stage),
        "world_size": str(world),
        "tag": os.path.basename(os.path.normpath(folder)),
        "master_weights": f"{', '.join(master)} (state_dict: rebuilt from {world} optimizer partitions; default)",
        "module_weights": (
            f"{', '.join(saved)} (module: as saved by rank 0; --select module)"
            if stage < 3
            else "not saved (ZeRO-3 partitions the module; only the master weights can be produced)"
        ),
    }
    if taken_from_module:
        metadata["frozen_parameters"] = (
            f"{taken_from_module} taken from the module's saved weights (ZeRO-1 records none; zero_to_fp32 drops them)"
        )
    return ReadResult(FORMAT, result, foreign_globals=foreign, saved_devices=frozenset(devices), metadata=metadata)


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
                raise _damaged(
                    model_file,
                    f"parameter {name!r} is described in parameter groups {seen[name]} and {index}, so its values "
                    "could come from either; zero_to_fp32 reads it two ways",
                )
            seen[name] = index
    if isinstance(frozen, Mapping):
        for name in frozen:
            if name in seen:
                raise _damaged(
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
        raise _damaged(model_file, "its frozen_param_shapes is not a mapping")
    for name, raw_shape in shapes.items():
        shape = _shape(raw_shape, model_file, name)
        numel = math.prod(shape)
        if stage < 3:
            fragments = models[0].get("frozen_param_fragments") or {}
            value = fragments.get(name) if isinstance(fragments, Mapping) else None
            if not isinstance(value, TensorRef) or value.numel != numel:
                raise _damaged(model_file, f"frozen parameter {name!r} has no fragment of {numel} elements")
            if value.shape != shape:
                # DeepSpeed saves stage 1-2 frozen parameters whole; zero_to_fp32 takes the
                # fragment's own shape, a model the recorded one.
                raise _damaged(
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
                raise _damaged(model_files[rank], f"it has no fragment of frozen parameter {name!r}")
            value = _flat(value, model_files[rank], f"fragment of {name!r}")
            dtypes.add(value.dtype)
            take = min(value.shape[0], numel - position)
            if take > 0:
                pieces.append((position, _piece(value, 0, take)))
                position += take
        if position != numel or len(dtypes) != 1:
            raise _damaged(model_file, f"the ranks' fragments of frozen parameter {name!r} do not make {list(shape)}")
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
        raise _damaged(folder, f"{len(param_shapes)} parameter groups are described but {len(flats[0])} are saved")
    align = 2 * world
    for index, shapes in enumerate(param_shapes):
        partitions = [groups[index] for groups in flats]
        if len({part.dtype for part in partitions}) != 1:
            raise _damaged(folder, f"the ranks' partitions of group {index} have different dtypes")
        starts = [0]
        for rank, part in enumerate(partitions):
            starts.append(starts[-1] + part.shape[0])
            fragments[rank].append({})
        available = starts[-1]
        group_paddings = None
        if isinstance(paddings, list) and index < len(paddings):
            group_paddings = paddings[index]
            if not isinstance(group_paddings, list) or len(group_paddings) != len(shapes):
                raise _damaged(folder, f"group {index} has {len(shapes)} parameters but other alignment paddings")
        offset = 0
        for position, (name, raw_shape) in enumerate(shapes.items()):
            shape = _shape(raw_shape, model_file, name)
            numel = math.prod(shape)
            if offset + numel > available:
                raise _damaged(folder, f"parameter {name!r} lies past the end of group {index}'s partitions")
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
                    raise _damaged(folder, f"parameter {name!r} has alignment padding {pad!r}")
                offset += pad
        # zero_to_fp32's own sanity check: only padding up to 2 * world_size may be left over.
        if -(-offset // align) * align != -(-available // align) * align:
            raise _damaged(folder, f"group {index} holds {available} elements but its parameters use {offset}")
    return fragments


def _check_slice_mappings(mappings: Any, expected: list[dict[str, tuple[int, int]]], path: str) -> None:
    """Compare DeepSpeed's record of where each parameter's piece lies in this rank's partitions
    (``fragment_address(numel, start)`` per group) with the layout ckptconv rebuilt."""
    if mappings is None:
        return  # older DeepSpeed versions do not record them
    if not isinstance(mappings, list) or len(mappings) != len(expected):
        raise _damaged(path, "its param_slice_mappings do not match its parameter groups")
    for index, (recorded, computed) in enumerate(zip(mappings, expected)):
        if not isinstance(recorded, Mapping):
            raise _damaged(path, f"its param_slice_mappings for group {index} are not a mapping")
        found: dict[str, tuple[int, int]] = {}
        for name, address in recorded.items():
            fields = address.attributes() if isinstance(address, ForeignObject) else {}
            found[name] = (fields.get("numel"), fields.get("start"))  # type: ignore[assignment]
        if found != computed:
            raise _damaged(
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
        raise _damaged(folder, "the ranks' flat parameter groups differ in size")
    if len({group.dtype for groups in flats for group in groups}) != 1:
        raise _damaged(folder, "the ranks' flat parameter groups differ in dtype")
    per_rank = sum(sizes)
    offset = 0
    for shapes in param_shapes:
        for name, raw_shape in shapes.items():
            shape = _shape(raw_shape, model_file, name)
            numel = math.prod(shape)
            part = -(-numel // world)
            if offset + part > per_rank:
                raise _damaged(folder, f"parameter {name!r} lies past the end of the ranks' partitions")
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
        raise _damaged(folder, f"each rank holds {per_rank} elements but the parameters use {offset}")
