"""Legacy Megatron-LM checkpoints (``--ckpt-format torch``): one file per model-parallel rank, merged.

Layout (Megatron-LM's ``save_checkpoint``)::

    run/latest_checkpointed_iteration.txt       the newest iteration ("3"), or "release"
    run/iter_0000003/mp_rank_TT/model_optim_rng.pt        tensor-parallel rank TT (no pipeline)
    run/iter_0000003/mp_rank_TT_PPP/model_optim_rng.pt    with pipeline parallelism: stage PPP

Each file holds ``{"args", "checkpoint_version", "iteration", "model": state_dict, ...}``, the
model being the rank's piece: flat with Megatron-Core (``decoder.layers.N.…``), nested before it
(``{"language_model": {"embedding": {"word_embeddings": {"weight": t}}, "encoder": {"layers.N.…": t},
"output_layer": {"weight": t}}}``, the legacy GPTModel's ``state_dict_for_save_checkpoint``), which is
flattened to dotted names (``language_model.encoder.layers.0.self_attention.query_key_value.weight``) as
``nn.Module.state_dict`` would name them; they are not mapped to a Hugging Face model's.

:func:`read` merges the pieces lazily (each merged tensor is a
:class:`~ckptconv.reading.formats.dcp.Assembled` of the ranks' byte ranges, read where they lie),
by the partition rule of each name, :data:`PARTITIONS` (first match wins; give ``partitions``
to override):

- ``column``: split along dim 0 (column-parallel linears ``linear_qkv``, ``linear_fc1``; the
  vocabulary-parallel ``word_embeddings`` and ``output_layer``). Megatron splits the QKV rows by
  query groups, so the ranks' blocks end to end are the full, group-interleaved tensor;
- ``row``: split along dim 1 (row-parallel ``linear_proj``, ``linear_fc2``);
- ``replicated``: the same on every rank (norms, the biases of row-parallel layers, position
  embeddings, a router): rank 0's, the others checked for shape;
- ``column`` on ``linear_fc1`` of a gated (SwiGLU) MLP, recognised by its rows being twice
  ``linear_fc2``'s columns on each rank: each rank holds ``[gate_r; up_r]``, so the gates are
  put together, then the ups.

Pipeline stages number their layers from 0; stage ``p``'s layers follow stage ``p - 1``'s. Names
no rule matches are refused, naming them. Optimizer and RNG state (``optimizer``,
``rng_state``) are never read; ``_extra_state`` entries (None, or Transformer Engine's bytes) are
not weights.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ckptconv._text import short_repr
from ckptconv.errors import MalformedCheckpointError, UnsupportedFormatError
from ckptconv.reading import read_policy
from ckptconv.reading.formats import torch_zip
from ckptconv.reading.formats._base import ReadResult
from ckptconv.reading.formats.dcp import Assembled
from ckptconv.values.tensor import Storage, TensorRef, contiguous_strides

__all__ = ["FORMAT", "PARTITIONS", "checkpoint_files", "find_checkpoint", "read"]

FORMAT = "megatron-legacy"
TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?layers)\.(?P<index>\d+)\.(?P<rest>.+)$")
# Not carried into the merged tree: the pieces, the state never read, and checkpoint_version (which,
# beside args, marks one rank's file for the selection's guard); the metadata records the version.
_NOT_MODEL = frozenset(
    {"model", "optimizer", "rng_state", "opt_param_scheduler", "rerun_state_machine", "checkpoint_version"}
)

#: (regex searched in the name, rule): the first match decides; see the module docstring.
PARTITIONS: tuple[tuple[str, str], ...] = (
    (r"(^|\.)word_embeddings\.weight$", "column"),
    (r"(^|\.)output_layer\.weight$", "column"),
    (r"\.linear_qkv\.(weight|bias)$", "column"),
    (r"\.linear_fc1\.(weight|bias)$", "column"),
    (r"\.linear_proj\.weight$", "row"),
    (r"\.linear_fc2\.weight$", "row"),
    (r"\.(linear_proj|linear_fc2)\.bias$", "replicated"),
    (r"(layernorm|layer_norm)(\.|_)(weight|bias)$", "replicated"),
    (r"(^|\.)position_embeddings\.weight$", "replicated"),
    (r"\.router\.weight$", "replicated"),
    # The nested layout before Megatron-Core (``language_model.encoder.layers.N.…``): legacy/model/transformer.py.
    (r"(^|\.)word_embeddings_for_head\.weight$", "column"),
    (r"\.query_key_value\.(weight|bias)$", "column"),
    (r"\.dense_h_to_4h\.(weight|bias)$", "column"),
    (r"\.(self_)?attention\.dense\.weight$", "row"),
    (r"\.dense_4h_to_h\.weight$", "row"),
    (r"\.((self_)?attention\.dense|dense_4h_to_h)\.bias$", "replicated"),
)
# Before checkpoint_version 2.0, Megatron-LM ordered these rows otherwise (its fix_query_key_value_ordering).
_OLD_QKV = ("query_key_value.weight", "query_key_value.bias")
#: The deepest nesting of the model's dicts that is flattened (the legacy layout nests four deep).
MAX_NESTING = 16
_RULES = ("column", "row", "replicated")


def _damaged(path: str, detail: str) -> MalformedCheckpointError:
    return MalformedCheckpointError(f"{path!r} is a damaged Megatron-LM checkpoint: {detail}", path=path)


def _rank_folders(folder: str) -> dict[tuple[int, int], str] | None:
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    ranks = {}
    for name in names:
        match = _RANK.match(name)
        if match and os.path.isfile(os.path.join(folder, name, RANK_FILE)):
            ranks[(int(match[1]), int(match[2] or 0))] = os.path.join(folder, name, RANK_FILE)
    return ranks or None


def find_checkpoint(path: str) -> str | None:
    """The iteration folder (holding ``mp_rank_*``) of a Megatron-LM checkpoint at ``path``, or None.

    Raises:
        MalformedCheckpointError: the tracker file names an iteration that is not there.
    """
    if _rank_folders(path):
        return path
    tracker = os.path.join(path, TRACKER)
    if not os.path.isfile(tracker) or os.path.getsize(tracker) > 64:
        return None
    text = read_policy.read_limited(tracker, limit=64, folder=path, what=TRACKER).decode("ascii", "replace").strip()
    name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
    if name is None:
        raise _damaged(path, f"{TRACKER} says {text!r}, neither an iteration nor 'release'")
    folder = os.path.join(path, name)
    if not _rank_folders(folder):
        raise _damaged(path, f"{TRACKER} names {name}, which holds no mp_rank_*/{RANK_FILE}")
    return folder


def checkpoint_files(path: str) -> list[str] | None:
    """The rank files the checkpoint at ``path`` is read from, or None if it is not one."""
    folder = find_checkpoint(path)
    ranks = _rank_folders(folder) if folder else None
    return [ranks[key] for key in sorted(ranks)] if ranks else None


def _rule(name: str, partitions: Sequence[tuple[str, str]]) -> str | None:
    for pattern, rule in partitions:
        if re.search(pattern, name):
            if rule not in _RULES:
                raise ValueError(f"partition rule {rule!r} for {pattern!r} is not one of {', '.join(_RULES)}")
            return rule
    return None


def _view(ref: TensorRef, start: int, rows: int) -> TensorRef:
    """Rows ``[start, start + rows)`` of ``ref`` (a view on the same bytes)."""
    return TensorRef(ref.storage, ref.dtype, (rows, *ref.shape[1:]), ref.stride, ref.offset + start * ref.stride[0])


def _merge(name: str, pieces: list[TensorRef], rule: str, gated: bool, file: str) -> TensorRef:
    first = pieces[0]
    if any(p.dtype != first.dtype or len(p.shape) != len(first.shape) for p in pieces):
        raise _damaged(file, f"the ranks' {name} differ in dtype or rank")
    if rule == "replicated" or len(pieces) == 1:
        if any(p.shape != first.shape for p in pieces):
            raise _damaged(file, f"{name} is replicated but the ranks hold shapes {[list(p.shape) for p in pieces]}")
        return first
    dim = 0 if rule == "column" else 1
    if len(first.shape) <= dim or any(
        p.shape[:dim] + p.shape[dim + 1 :] != first.shape[:dim] + first.shape[dim + 1 :] for p in pieces
    ):
        raise _damaged(file, f"the ranks' {name} ({[list(p.shape) for p in pieces]}) do not join along dim {dim}")
    size = sum(p.shape[dim] for p in pieces)
    shape = (*first.shape[:dim], size, *first.shape[dim + 1 :])
    chunks: list[tuple[tuple[int, ...], TensorRef]] = []
    if gated:  # each rank: [gate_r; up_r]; the full tensor: [gate_0 … gate_n; up_0 … up_n]
        if any(p.shape[0] % 2 or p.shape[0] != first.shape[0] for p in pieces):
            raise _damaged(file, f"the ranks' gated {name} ({[list(p.shape) for p in pieces]}) do not halve alike")
        half = first.shape[0] // 2
        for rank, piece in enumerate(pieces):
            chunks.append(((rank * half, *([0] * (len(shape) - 1))), _view(piece, 0, half)))
            chunks.append(((size // 2 + rank * half, *([0] * (len(shape) - 1))), _view(piece, half, half)))
    else:
        at = 0
        for piece in pieces:
            offsets = [0] * len(shape)
            offsets[dim] = at
            chunks.append((tuple(offsets), piece))
            at += piece.shape[dim]
    nbytes = first.dtype.itemsize
    for extent in shape:
        nbytes *= extent
    storage = Storage(nbytes, Assembled(tuple(chunks), shape, first.dtype.itemsize), location="cpu", name=name)
    return TensorRef(storage, first.dtype, shape, contiguous_strides(shape))


# (fc1, fc2) name endings of an MLP: Megatron-Core's, then the legacy layout's.
_MLPS = (("linear_fc1.weight", "linear_fc2.weight"), ("dense_h_to_4h.weight", "dense_4h_to_h.weight"))


def _gated_layers(stage: Mapping[str, TensorRef]) -> set[str]:
    """The ``linear_fc1`` (legacy: ``dense_h_to_4h``) names of gated MLPs: rows twice the second linear's columns
    (per rank)."""
    gated = set()
    for name, ref in stage.items():
        for fc1, fc2_name in _MLPS:
            if name.endswith(fc1):
                fc2 = stage.get(name[: -len(fc1)] + fc2_name)
                if fc2 is not None and len(fc2.shape) == 2 and ref.shape[0] == 2 * fc2.shape[1]:
                    gated.update({name, name[: -len("weight")] + "bias"})
    return gated


def _flattened(model: Mapping[Any, Any], file: str) -> dict[str, TensorRef]:
    """The model's tensors by dotted name. Megatron-Core's state dict is flat; the legacy layout nests dicts
    (``{"language_model": {"embedding": {"word_embeddings": {"weight": t}}, "encoder": {"layers.0.…": t},
    "output_layer": {"weight": t}}}``), joined here with dots, as ``nn.Module.state_dict`` names them."""
    flat: dict[str, TensorRef] = {}
    stack: list[tuple[str, Iterator[tuple[Any, Any]]]] = [("", iter(model.items()))]  # depth first, in file order
    while stack:
        prefix, items = stack[-1]
        item = next(items, None)
        if item is None:
            stack.pop()
            continue
        key, value = item
        if not isinstance(key, str):
            continue
        name = prefix + key
        if isinstance(value, TensorRef):
            if name in flat:
                raise _damaged(file, f"its model names {name!r} twice (flat and nested)")
            flat[name] = value
        elif isinstance(value, Mapping) and value:
            if len(stack) >= MAX_NESTING:
                raise _damaged(file, f"its model nests deeper than {MAX_NESTING} dicts at {name!r}")
            stack.append((name + ".", iter(value.items())))
    return flat


def read(path: str, *, partitions: Sequence[tuple[str, str]] = PARTITIONS, max_items: int | None = None) -> ReadResult:
    """Read a legacy Megatron-LM checkpoint, its ranks merged; see the module docstring.

    Raises:
        UnsupportedFormatError: not such a checkpoint, a name no partition rule covers, or a layout
            ckptconv does not merge (virtual pipeline stages, ranks missing from the grid).
        MalformedCheckpointError: the ranks' files disagree.
    """
    folder = find_checkpoint(path)
    ranks = _rank_folders(folder) if folder else None
    if folder is None or not ranks:
        raise UnsupportedFormatError(f"{path!r} is not a Megatron-LM checkpoint folder", path=path)
    tp = 1 + max(t for t, _ in ranks)
    pp = 1 + max(p for _, p in ranks)
    if len(ranks) != tp * pp:
        raise MalformedCheckpointError(
            f"{folder!r} is incomplete: {len(ranks)} rank folders for {tp} tensor x {pp} pipeline ranks", path=folder
        )
    foreign: Counter[str] = Counter()
    devices: set[str] = set()
    trees: dict[tuple[int, int], Mapping[str, Any]] = {}
    for key in sorted(ranks):
        result = torch_zip.read(ranks[key], max_items=max_items)
        foreign.update(result.foreign_globals)
        devices.update(result.saved_devices)
        tree = result.tree
        if not isinstance(tree, Mapping) or not isinstance(tree.get("model"), Mapping):
            if isinstance(tree, Mapping) and any(str(k).startswith("model0") for k in tree):
                raise UnsupportedFormatError(
                    f"{folder!r} has virtual pipeline stages (model0, model1, ...), which ckptconv does not merge"
                )
            raise _damaged(ranks[key], "it holds no 'model' state dict")
        trees[key] = tree
    weights: dict[str, TensorRef] = {}
    offset = 0
    unknown: list[str] = []
    for stage in range(pp):
        models = [_flattened(trees[(t, stage)]["model"], ranks[(t, stage)]) for t in range(tp)]
        names = list(models[0])
        if any(list(m) != names for m in models):
            raise _damaged(folder, f"the tensor-parallel ranks of stage {stage} hold different names")
        gated = _gated_layers(models[0])
        layers = 0
        for name in names:
            rule = _rule(name, partitions)
            if rule is None:
                unknown.append(name)
                continue
            merged = _merge(name, [m[name] for m in models], rule, name in gated, ranks[(0, stage)])
            match = _LAYER.match(name)
            if match:
                index = int(match["index"])
                layers = max(layers, index + 1)
                name = f"{match['prefix']}.{offset + index}.{match['rest']}"  # noqa: PLW2901
            weights.setdefault(name, merged)  # a tied embedding repeated on the last stage: the first's
        offset += layers
    if unknown:
        raise UnsupportedFormatError(
            f"{folder!r}: no partition rule says how the ranks split {len(unknown)} name(s), e.g. "
            f"{', '.join(unknown[:3])}; give megatron_legacy.read a partitions table that does",
            path=folder,
        )
    first = trees[(0, 0)]
    version = first.get("checkpoint_version", 0)  # Megatron-LM's get_checkpoint_version: 0 when not saved
    if any(name.endswith(_OLD_QKV) for name in weights) and not (type(version) in (int, float) and version >= 2.0):
        raise UnsupportedFormatError(
            f"{folder!r} is a Megatron-LM checkpoint_version {short_repr(version)} file, whose fused query_key_value "
            "rows are in the order Megatron-LM used before version 2.0; ckptconv does not reorder them: load it "
            "with Megatron-LM (which does) and save it again",
            path=folder,
        )
    out: dict[str, Any] = {"model": weights}
    out.update({k: v for k, v in first.items() if isinstance(k, str) and k not in _NOT_MODEL})
    metadata = {
        "framework": "Megatron-LM (--ckpt-format torch)",
        "parallel": f"tensor {tp}, pipeline {pp} (merged by partition rule per name)",
        "iteration": os.path.basename(os.path.normpath(folder)),
        "checkpoint_version": str(first.get("checkpoint_version")),
    }
    if "optimizer" in first:
        metadata["optimizer"] = "saved beside the model; not read"
    files = tuple(ranks[key] for key in sorted(ranks))
    return ReadResult(
        FORMAT, out, foreign_globals=foreign, saved_devices=frozenset(devices), metadata=metadata, files=files
    )
