"""transformers' rank-local distributed checkpoints: one safetensors file per rank, read as one state dict.

``model.save_pretrained(..., distributed_checkpoint=True)`` (transformers' ``distributed/checkpoint.py``)
has every rank write its own shards with torch's ``HuggingFaceStorageWriter(save_distributed=True)``
(``torch/distributed/checkpoint/hf_storage.py``)::

    shard-00001-model-00001-of-00001.safetensors    rank 0's chunks
    shard-00002-model-00001-of-00001.safetensors    rank 1's chunks
    ...                                            (model-0000k-of-0000M: the output file each belongs to)

Each file is a plain safetensors file whose metadata ``DCP_SHARDING_INFO`` is JSON naming, for each of
its tensors, where its chunk starts in the full tensor (``{"w": {"saved_offsets": [7, 0]}}``); a
replicated tensor is written by one rank only. As torch's ``HuggingFaceStorageReader.read_metadata``
does, the full size of a tensor is the furthest extent of its chunks; :func:`read` then places each chunk
at its offset, read where it lies (:func:`ckptconv.reading.formats.dcp.assembled`), and requires the
chunks to tile the tensor exactly (no hole, no overlap, one dtype), which torch's consolidation
(``_consolidate_hf_safetensors.py``) does not check. Each tensor keeps its stored dtype.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ckptconv._text import short_repr
from ckptconv.errors import MalformedCheckpointError
from ckptconv.reading import read_policy
from ckptconv.reading.formats import dcp, safetensors
from ckptconv.reading.formats._base import ReadResult, json_object
from ckptconv.values.tensor import TensorRef

__all__ = ["FORMAT", "find_files", "read"]

FORMAT = "hf-distributed"

_RANK_FILE = re.compile(r"^shard-[0-9]{5}-model-[0-9]{5}-of-[0-9]{5}\.safetensors$")  # transformers' own test
SHARDING_KEY = "DCP_SHARDING_INFO"
OFFSETS_KEY = "saved_offsets"


def _damaged(path: str, detail: str) -> MalformedCheckpointError:
    return MalformedCheckpointError(f"{path!r} is a damaged rank-local distributed checkpoint: {detail}", path=path)


def find_files(folder: str) -> list[str] | None:
    """The rank-local files in ``folder`` (sorted), or None when it holds none."""
    try:
        names = sorted(name for name in os.listdir(folder) if _RANK_FILE.match(name))
    except OSError:
        return None
    return [os.path.join(folder, name) for name in names] or None


def read(folder: str) -> ReadResult:
    """Read every rank's file lazily and put each tensor together from its chunks."""
    files = [read_policy.member(folder, os.path.basename(path), source=folder, what="rank file") for path in
             find_files(folder) or ()]  # fmt: skip
    if not files:
        raise _damaged(folder, "it holds no shard-NNNNN-model-NNNNN-of-NNNNN.safetensors file")
    chunks: dict[str, list[tuple[tuple[int, ...], TensorRef]]] = {}
    for path in files:
        result = safetensors.read(path)
        info = _sharding_info(path, result.metadata)
        if not isinstance(result.tree, dict):
            raise _damaged(path, "it holds no tensors")
        for key, ref in result.tree.items():
            offsets = info.get(key, {}).get(OFFSETS_KEY) if isinstance(info.get(key), dict) else None
            if (
                not isinstance(ref, TensorRef)
                or not isinstance(offsets, list)
                or len(offsets) != len(ref.shape)
                or not all(type(offset) is int and offset >= 0 for offset in offsets)
            ):
                raise _damaged(
                    path, f"{SHARDING_KEY} gives {key!r} no offsets of {len(getattr(ref, 'shape', ()))} dims"
                )
            chunks.setdefault(key, []).append((tuple(offsets), ref))
    tree: dict[str, Any] = {}
    for key, pieces in chunks.items():
        if len({len(ref.shape) for _, ref in pieces}) != 1:  # chunks of different ranks
            raise _damaged(folder, f"the chunks of {key!r} have different numbers of dimensions")
        # the furthest extent, so every chunk (offsets checked non-negative above) lies inside it
        shape = tuple(
            max(offset[dim] + ref.shape[dim] for offset, ref in pieces) for dim in range(len(pieces[0][1].shape))
        )
        tree[key] = dcp.assembled(key, shape, pieces, lambda detail: _damaged(folder, detail))
    return ReadResult(FORMAT, tree, files=tuple(files))


def _sharding_info(path: str, metadata: Any) -> dict[str, Any]:
    text = metadata.get(SHARDING_KEY) if isinstance(metadata, dict) else None
    if not isinstance(text, str):
        raise _damaged(path, f"its metadata has no {SHARDING_KEY} (the chunks' offsets)")
    try:
        info = json_object(text)
    except ValueError as error:
        raise _damaged(path, f"its {SHARDING_KEY} is not JSON ({short_repr(str(error))})") from None
    if not isinstance(info, dict):
        raise _damaged(path, f"its {SHARDING_KEY} is not a JSON object")
    return info
