"""Sharded checkpoints: an index plus shard files, as Hugging Face writes them. Reading and writing.

Layout::

    model.safetensors.index.json        {"metadata": {"total_size": N}, "weight_map": {key: shard file}}
    model-00001-of-00003.safetensors    (or pytorch_model.bin.index.json and
    model-00002-of-00003.safetensors     pytorch_model-0000k-of-0000N.bin shards)
    ...

Reading opens every shard lazily with its own reader and merges them into one
state dict; a ``weight_map`` may only name files inside the checkpoint folder.
Writing plans the shards first, as a pure function (:func:`plan_shards`), then
writes each shard with the single-file writers and the index last.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ckptconv._text import short_repr
from ckptconv.errors import MalformedCheckpointError
from ckptconv.reading import read_policy
from ckptconv.reading.formats._base import ReadResult, unique_pairs
from ckptconv.suffixes import INDEX_SUFFIXES
from ckptconv.values.tensor import TensorRef

__all__ = ["checkpoint_files", "read"]

FORMAT = "sharded"
MAX_INDEX_BYTES = 100_000_000


def _damaged(path: str, detail: str) -> MalformedCheckpointError:
    return MalformedCheckpointError(f"{path!r} is a damaged sharded checkpoint index: {detail}", path=path)


def shard_path(index_path: str, name: Any) -> str:
    """The file a ``weight_map`` entry names; never anything outside the index's folder (:mod:`.read_policy`)."""
    folder = os.path.dirname(os.path.abspath(index_path))
    if isinstance(name, str) and name.endswith(INDEX_SUFFIXES):
        raise _damaged(index_path, f"its weight_map names the index {short_repr(name)} as a shard")
    return read_policy.member(folder, name, source=index_path, what="shard")


def read_index(index_path: str, *, folder: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """An index's ``weight_map`` (names to shard files, not yet checked) and its ``metadata``.

    Args:
        index_path: the index file (a regular file of at most :data:`MAX_INDEX_BYTES`).
        folder: when given, the index must lie inside it (links included).

    Raises:
        LoadError: the file is not a regular file (a FIFO, a device), or leads out of ``folder``.
        MalformedCheckpointError: the file is too large, not JSON, or has no weight_map.
    """
    raw = read_policy.read_limited(index_path, limit=MAX_INDEX_BYTES, folder=folder, what="shard index")
    try:
        text = raw.decode("utf-8")
        del raw  # the bytes and the text are each the index's size: hold one of them while parsing
        index = json.loads(text, object_pairs_hook=_SharedNames())  # a key named twice maps it to two shards
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise _damaged(index_path, f"it is not valid JSON ({error})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(key, str) for key in weight_map):
        raise _damaged(index_path, "it has no weight_map of names to shard files")
    for name in weight_map.values():
        if not isinstance(name, str):
            shard_path(index_path, name)  # says what is wrong with it, before a list is hashed
    metadata = index.get("metadata")
    return weight_map, metadata if isinstance(metadata, dict) else {}


class _SharedNames:
    """:func:`unique_pairs`, keeping one copy of each text value: a weight_map names a few shards
    a million times, each a string of 80 bytes as ``json.loads`` makes them (issue #31)."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result = unique_pairs(pairs)
        names = self.names
        for key, value in result.items():
            if type(value) is str:
                shared = names.get(value)
                if shared is not None:
                    result[key] = shared
                elif len(names) < 4096:  # never a table as large as the index
                    names[value] = value
        return result


def checkpoint_files(index_path: str) -> list[str]:
    """The index and every shard it names: the files the checkpoint is made of."""
    weight_map, _ = read_index(index_path)
    return [index_path, *(shard_path(index_path, name) for name in sorted(set(weight_map.values()), key=str))]


def read(index_path: str, *, max_items: int | None = None) -> ReadResult:
    """Read an index and its shards lazily, merged into one state dict in ``weight_map`` order."""
    from ckptconv.reading.detection import READERS, detect
    from ckptconv.selection.weights import select_weights

    weight_map, metadata = read_index(index_path)
    shards: dict[str, dict[str, Any]] = {}
    foreign: dict[str, int] = {}
    devices: set[str] = set()
    files = [index_path]
    for name in dict.fromkeys(weight_map.values()):
        path = shard_path(index_path, name)
        files.append(path)
        kind = detect(path)
        if kind in (FORMAT, "dcp"):
            raise _damaged(
                index_path, f"its weight_map names {short_repr(name)}, which is not a single checkpoint file"
            )
        result = READERS[kind](path)
        shards[name] = select_weights(result.tree, source=repr(path)).weights
        for global_name, count in result.foreign_globals.items():
            foreign[global_name] = foreign.get(global_name, 0) + count
        devices |= result.saved_devices
    _refuse_keys_in_two_shards(index_path, shards, weight_map)
    tree: dict[str, TensorRef] = {}
    for key, name in weight_map.items():
        tensor = shards[name].get(key)
        if tensor is None:
            raise MalformedCheckpointError(
                f"{index_path!r} maps {short_repr(key)} to {short_repr(name)}, which does not hold it; "
                "the shards do not match the index",
                path=index_path,
            )
        # A safetensors shard names each storage after its key: keep that one copy of the name, not two.
        stored = tensor.storage.name
        tree[stored if stored == key and type(stored) is str else key] = tensor
    # Keys a shard restores beyond its weight_map entries (ckptconv's tied-tensor aliases).
    for weights in shards.values():
        for key, tensor in weights.items():
            if key not in tree:
                tree[key] = tensor
    text_metadata = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    return ReadResult(FORMAT, tree, foreign, frozenset(devices), text_metadata, tuple(files))  # type: ignore[arg-type]


def _refuse_keys_in_two_shards(index_path: str, shards: dict[str, dict[str, Any]], weight_map: dict[str, Any]) -> None:
    """Refuse a tensor name two shards hold: loaders that read every shard in turn (transformers,
    accelerate) keep the last one's values, where the index may name the other."""
    owner: dict[str, str] = {}
    for name, weights in shards.items():
        for key in weights:
            first = owner.setdefault(key, name)
            if first != name:
                raise _damaged(
                    index_path,
                    f"tensor {short_repr(key)} is in {short_repr(first)} and in {short_repr(name)} "
                    f"(the index names {short_repr(weight_map.get(key))}); "
                    "loaders that read every shard keep the last, so refusing a checkpoint that reads two ways",
                )


def find_index(folder: str) -> str | None:
    """The one index file in ``folder`` (safetensors preferred over .bin, as transformers does)."""
    names = sorted(name for name in os.listdir(folder) if name.endswith(INDEX_SUFFIXES))
    for suffix in INDEX_SUFFIXES:
        matching = [name for name in names if name.endswith(suffix)]
        if len(matching) == 1:
            return os.path.join(folder, matching[0])
        if len(matching) > 1:
            raise MalformedCheckpointError(
                f"{folder!r} holds several indexes ({', '.join(matching)}); give the one to read", path=folder
            )
    return None


# ---------------------------------------------------------------------------------------
# Planning and naming (pure)
# ---------------------------------------------------------------------------------------
