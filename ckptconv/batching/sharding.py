"""Sharding: which items of a batch each of N processes converts (``batch --shard i/N``).

Planning only, no I/O: N processes, each started with the same SRC, DST and options and its own
index, discover the same items and compute the same assignment, so between them they convert every
item exactly once without talking to each other. Only the shared file system joins them: each shard
keeps its own manifest (:func:`manifest_name`) under its own lock.

The assignment (:func:`assign`) balances bytes: items sorted by size, largest first (equal sizes by
path), each given to the shard with the fewest bytes so far (equal loads: the lowest index). It
depends only on the items' paths and sizes, so the sources must not change while the shards run.

Where the index comes from (:func:`parse_shard`): ``i/N`` (0-based, ``0/4`` to ``3/4``), or ``auto``:
a Slurm job array (``SLURM_ARRAY_TASK_ID`` minus ``SLURM_ARRAY_TASK_MIN``, divided by
``SLURM_ARRAY_TASK_STEP``, of ``SLURM_ARRAY_TASK_COUNT``) or torchrun / torchelastic (``RANK`` of
``WORLD_SIZE``). Both present, or neither, is refused: the caller says which.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["MANIFEST_GLOB", "Shard", "ShardPlan", "assign", "manifest_name", "parse_shard", "plans"]

# A shard's manifest, beside the unsharded one (batching.manifest.MANIFEST_NAME).
_MANIFEST = "ckptconv-manifest.shard-{index:04d}-of-{count:04d}.jsonl"
MANIFEST_GLOB = re.compile(r"ckptconv-manifest\.shard-(\d{4,})-of-(\d{4,})\.jsonl")
_SPELLED = re.compile(r"(\d+)/(\d+)")
MAX_SHARDS = 9999  # four digits in the manifest's name, and more processes than a batch has items anyway


@dataclass(frozen=True)
class Shard:
    """One of ``count`` shards, ``index`` counted from 0.

    Attributes:
        index: 0 to ``count - 1``.
        count: the number of shards the batch is split into.
        source: where it came from: ``"--shard"``, ``"Slurm array"`` or ``"torchrun"``.
    """

    index: int
    count: int
    source: str = "--shard"

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_SHARDS:
            raise ValueError(f"a batch splits into 1 to {MAX_SHARDS} shards, not {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard index {self.index} is not in 0..{self.count - 1} (of {self.count} shards)")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass(frozen=True)
class ShardPlan:
    """What one shard converts.

    Attributes:
        shard: which shard.
        items: the items' relative paths, in the order of the batch.
        bytes: their source bytes in all.
    """

    shard: Shard
    items: tuple[str, ...]
    bytes: int


def manifest_name(shard: Shard) -> str:
    """The file name of a shard's manifest: ``ckptconv-manifest.shard-0003-of-0008.jsonl``."""
    return _MANIFEST.format(index=shard.index, count=shard.count)


def parse_shard(text: str, environ: Mapping[str, str]) -> Shard:
    """A shard from ``i/N`` or from ``auto`` (the scheduler's variables in ``environ``).

    Raises:
        ValueError: a malformed spelling, an index out of range, or ``auto`` without exactly one
            scheduler's variables (one sentence, saying what to pass instead).
    """
    text = text.strip()
    if text == "auto":
        return _from_environment(environ)
    match = _SPELLED.fullmatch(text)
    if match is None:
        raise ValueError(f"--shard takes INDEX/COUNT (0/4 to 3/4) or 'auto', not {text!r}")
    return Shard(int(match.group(1)), int(match.group(2)))


def _integer(environ: Mapping[str, str], name: str) -> int:
    value = environ[name].strip()
    if not value.isdecimal():
        raise ValueError(f"{name}={value!r} is not a whole number; pass --shard INDEX/COUNT instead of auto")
    return int(value)


def _from_environment(environ: Mapping[str, str]) -> Shard:
    slurm = "SLURM_ARRAY_TASK_ID" in environ
    torchrun = "RANK" in environ and "WORLD_SIZE" in environ
    if slurm and torchrun:
        raise ValueError(
            "--shard auto found both a Slurm array (SLURM_ARRAY_TASK_ID) and torchrun's RANK/WORLD_SIZE; "
            "pass --shard INDEX/COUNT to say which"
        )
    if torchrun:
        return _checked(_integer(environ, "RANK"), _integer(environ, "WORLD_SIZE"), "torchrun")
    if slurm:
        if "SLURM_ARRAY_TASK_COUNT" not in environ:
            raise ValueError("--shard auto found SLURM_ARRAY_TASK_ID without SLURM_ARRAY_TASK_COUNT; pass --shard")
        task = _integer(environ, "SLURM_ARRAY_TASK_ID")
        count = _integer(environ, "SLURM_ARRAY_TASK_COUNT")
        first = _integer(environ, "SLURM_ARRAY_TASK_MIN") if "SLURM_ARRAY_TASK_MIN" in environ else 0
        step = _integer(environ, "SLURM_ARRAY_TASK_STEP") if "SLURM_ARRAY_TASK_STEP" in environ else 1
        offset = task - first
        if step < 1 or offset < 0 or offset % step or offset // step >= count:
            raise ValueError(
                f"the Slurm array's task {task} is not one of {count} evenly spaced from {first} by {step} "
                "(an array such as -a 1,4,9); pass --shard INDEX/COUNT"
            )
        return _checked(offset // step, count, "Slurm array")
    raise ValueError(
        "--shard auto found no Slurm array (SLURM_ARRAY_TASK_ID) or torchrun (RANK, WORLD_SIZE) variables; "
        "pass --shard INDEX/COUNT"
    )


def _checked(index: int, count: int, source: str) -> Shard:
    try:
        return Shard(index, count, source)
    except ValueError as error:
        raise ValueError(f"--shard auto ({source}): {error}; pass --shard INDEX/COUNT") from None


def assign(sizes: Sequence[tuple[str, int]], count: int) -> list[int]:
    """The shard of each item: largest first (equal sizes by path), each to the lightest shard so far.

    Args:
        sizes: ``(path, bytes)`` of every item, in any order; paths are unique.
        count: the number of shards.

    Returns:
        For each entry of ``sizes``, in the same order, the index of the shard that converts it
        (:func:`ckptconv.writing.shards.balance`, which ``convert --part`` uses too).

    Example:
        >>> assign([("a", 5), ("b", 3), ("c", 3), ("d", 1)], 2)
        [0, 1, 1, 0]
    """
    # Imported here: the command line reads this module's values for --help, which imports no stage.
    from ckptconv.writing.shards import balance

    return balance(sizes, count)


def plans(sizes: Sequence[tuple[str, int]], count: int) -> tuple[ShardPlan, ...]:
    """Every shard's items and bytes (what ``batch --shard i/N --dry-run`` prints)."""
    owner = assign(sizes, count)
    return tuple(
        ShardPlan(
            Shard(shard, count),
            tuple(name for (name, _), who in zip(sizes, owner) if who == shard),
            sum(size for (_, size), who in zip(sizes, owner) if who == shard),
        )
        for shard in range(count)
    )
