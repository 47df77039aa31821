"""Shard planning for sharded folder outputs: which tensors go in which shard, the shards' names and the
index, as Hugging Face writes them. Pure: no bytes move here (:mod:`ckptconv.writing.folders` writes)."""

from __future__ import annotations

import heapq
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ckptconv.reading.formats._base import json_bytes
from ckptconv.values.tensor import TensorRef


@dataclass(frozen=True)
class ShardPlan:
    """Which keys go into which shard.

    Attributes:
        shards: one list of ``(key, tensor)`` per shard, in order.
        sizes: bytes each shard's tensors take (tied tensors counted once).
    """

    shards: tuple[tuple[tuple[str, TensorRef], ...], ...]
    sizes: tuple[int, ...]


def plan_shards(entries: Sequence[tuple[str, TensorRef]], max_bytes: int | None) -> ShardPlan:
    """Split a state dict into shards of at most ``max_bytes``; pure, no I/O.

    Every key lands in exactly one shard; tensors sharing a storage (tied
    weights, views) land in the same shard so they stay shared; a shard is
    over the limit only when one such group alone is larger. Order is kept.
    """
    groups: dict[int, list[tuple[str, TensorRef]]] = {}
    for key, ref in entries:
        groups.setdefault(id(ref.storage), []).append((key, ref))

    def group_bytes(group: list[tuple[str, TensorRef]]) -> int:
        distinct = {ref for _, ref in group}
        return sum(ref.nbytes for ref in distinct)

    shards: list[list[tuple[str, TensorRef]]] = [[]]
    sizes = [0]
    for group in groups.values():
        size = group_bytes(group)
        if max_bytes is not None and shards[-1] and sizes[-1] + size > max_bytes:
            shards.append([])
            sizes.append(0)
        shards[-1].extend(group)
        sizes[-1] += size
    return ShardPlan(tuple(tuple(shard) for shard in shards), tuple(sizes))


def balance(sizes: Sequence[tuple[str, int]], count: int) -> list[int]:
    """Which of ``count`` bins each ``(name, bytes)`` goes to: largest first (equal sizes by name), each to the
    bin with the fewest bytes so far (equal loads: the lowest index). Pure, and independent of the input's order,
    so processes that compute it apart agree (``batch --shard``, ``convert --part``).

    Example:
        >>> balance([("a", 5), ("b", 3), ("c", 3), ("d", 1)], 2)
        [0, 1, 1, 0]
    """
    order = sorted(range(len(sizes)), key=lambda index: (-sizes[index][1], sizes[index][0]))
    loads = [(0, bin) for bin in range(count)]  # (bytes so far, bin): the heap's least is the lightest
    heapq.heapify(loads)
    owner = [0] * len(sizes)
    for index in order:
        load, bin = heapq.heappop(loads)
        owner[index] = bin
        heapq.heappush(loads, (load + sizes[index][1], bin))
    return owner


def _stem_suffix(kind: str, stem: str | None) -> tuple[str, str]:
    default, suffix = ("model", "safetensors") if kind == "safetensors" else ("pytorch_model", "bin")
    return stem or default, suffix


def shard_names(kind: str, count: int, stem: str | None = None) -> tuple[list[str], str]:
    """File names for ``count`` shards and the index, as transformers names them (``stem``: another name than
    ``model``/``pytorch_model``, such as PEFT's ``adapter_model`` or diffusers' ``diffusion_pytorch_model``)."""
    stem, suffix = _stem_suffix(kind, stem)
    if count == 1:
        return [f"{stem}.{suffix}"], f"{stem}.{suffix}.index.json"
    return [f"{stem}-{i:05d}-of-{count:05d}.{suffix}" for i in range(1, count + 1)], f"{stem}.{suffix}.index.json"


def family_pattern(kind: str, stem: str | None = None) -> re.Pattern[str]:
    """File names a sharded write of ``kind`` may have left in a folder (this run's or an earlier one's)."""
    stem, suffix = _stem_suffix(kind, stem)
    return re.compile(rf"^{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?\.{suffix}(\.index\.json)?$")


def index_document(weight_map: dict[str, str], total_size: int, metadata: dict[str, str]) -> bytes:
    document = {"metadata": {"total_size": total_size, **metadata}, "weight_map": dict(sorted(weight_map.items()))}
    return json_bytes(document, indent=2) + b"\n"
