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
optimizer file into memory: each parameter is a :class:`~ckptconv.reading.formats.dcp.Assembled`
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
what the selection picks by default), ``module`` (the 16-bit weights the model
trained with; ``--select module``) and the run's plain data (steps,
``ds_config``, client state). Stages 1-2 save the module whole, and ``module`` is
it, as saved. Stage 3 saves each parameter of the module as an empty placeholder
of its dtype (the weights live partitioned in the optimizer files); its 16-bit
weights are the fp32 master weights cast to that dtype, which is what DeepSpeed
does after every step (``fp16_partitioned_groups_flat[i].copy_(fp32_partitioned_groups_flat[i])``:
a round to nearest even, which ckptconv's casts reproduce bit for bit), so
``module`` is that cast (lazy), the frozen parameters in their saved dtype, the
buffers as saved and the tied parameters one tensor under both names.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ckptconv.dtypes import parse_cast_target
from ckptconv.errors import MalformedCheckpointError, UnsupportedFormatError
from ckptconv.reading import read_policy
from ckptconv.reading.formats import torch_zip
from ckptconv.reading.formats._base import ReadResult
from ckptconv.reading.formats.zero_partitions import (
    _check_slice_mappings,
    _flat,
    _frozen,
    _int,
    _refuse_names_described_twice,
    _trainable_stage3,
    _trainable_stage12,
    damaged,
)
from ckptconv.values.tensor import TensorRef

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
            raise damaged(path, f"its 'latest' file names {tag!r}, not a tag folder")
        folder = os.path.join(path, tag)
        if os.path.exists(folder) and not read_policy.inside(folder, path):
            raise damaged(path, f"its 'latest' names {tag!r}, a link that leads outside the run folder")
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


def _module_stage3(
    module: Mapping[str, Any], weights: Mapping[str, TensorRef], buffer_names: Any, model_file: str
) -> dict[str, Any]:
    """ZeRO-3's module state dict: each placeholder's parameter, from the master weights, in its saved dtype."""
    buffers = set(buffer_names)
    out: dict[str, Any] = {}
    made: dict[tuple[int, str], TensorRef] = {}  # a tied parameter stays one tensor
    for name, placeholder in module.items():
        if name in buffers or not isinstance(placeholder, TensorRef):
            out[name] = placeholder
            continue
        master = weights.get(name)
        if master is None:
            raise damaged(model_file, f"its module names {name!r}, which no partition or fragment holds")
        key = (id(master), placeholder.dtype.name)
        if key not in made:
            made[key] = master.cast(placeholder.dtype)
        out[name] = made[key]
    return out


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
            raise damaged(optim_files[rank], "it holds no optimizer_state_dict")
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
        raise damaged(optim_files[0], "its optimizer state names no ZeRO stage")
    if stage not in (1, 2, 3):
        raise UnsupportedFormatError(f"{folder!r} is a ZeRO stage {stage} checkpoint; stages 1-3 are supported")
    counts = first.get("partition_count")
    world = max(counts) if isinstance(counts, list) and counts and all(type(c) is int for c in counts) else counts
    if type(world) is not int or world < 1:
        raise damaged(optim_files[0], f"its partition_count is {counts!r}")
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
            raise damaged(optim_files[rank], f"its optimizer state has no {groups_key}")
        flats.append([_flat(group, optim_files[rank], groups_key) for group in groups])
    if any(len(groups) != len(flats[0]) for groups in flats):
        raise damaged(folder, "the ranks' optimizer files hold different numbers of parameter groups")

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
            raise damaged(model_files[rank], "it is not a DeepSpeed model states file")
        models.append(tree)
    model = models[0]
    model_file = model_files[0]
    module = model.get("module")
    if not isinstance(module, Mapping):
        raise damaged(model_file, "it holds no module state dict")

    param_shapes = model.get("param_shapes")
    if not isinstance(param_shapes, list) or not all(isinstance(group, Mapping) for group in param_shapes):
        raise damaged(model_file, "its param_shapes is not a list of groups")

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
    result["module"] = dict(module) if stage < 3 else _module_stage3(module, weights, buffer_names, model_file)
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
            else f"{', '.join(saved)} (module: the master weights cast to each parameter's saved dtype, as "
            "DeepSpeed does after each step; buffers as saved; --select module)"
        ),
    }
    if taken_from_module:
        metadata["frozen_parameters"] = (
            f"{taken_from_module} taken from the module's saved weights (ZeRO-1 records none; zero_to_fp32 drops them)"
        )
    return ReadResult(FORMAT, result, foreign_globals=foreign, saved_devices=frozenset(devices), metadata=metadata)
