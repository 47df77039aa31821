"""One sharded folder written by N processes at once (``convert SRC DST/ --max-shard-size S --part i/N``).

Every part plans the whole folder alike (:func:`~ckptconv.writing.shards.plan_shards` over the output
tensors, so any source works), gives the shards to parts byte-balanced
(:func:`~ckptconv.writing.shards.balance` over the shards' sizes, largest first, equal sizes by name), and
writes only its own shards, into a hidden folder shared by the parts of this plan:
``DST/.ckptconv-parts.<plan>/``, ``<plan>`` a digest of the shards' names and tensors (keys, dtypes,
shapes) and of the output's metadata, so the parts of another plan never mix with these. Then it writes
a completion record (``part-0002-of-0004.json``: each of its shards' size and sha256, its part of the
weight map and its bytes), atomically.

The part that, holding the folder's lock, finds every record present publishes: it checks each shard
against the size and sha256 its part recorded, writes the index, runs the write's check (``--verify``)
on the whole staged folder, and renames the shards into ``DST``, the index last, then removes the
hidden folder. The lock makes one part publish when two finish at once; the other then finds the
hidden folder gone. Until then ``DST`` holds only what it held before. A part killed half-way is run
again with the same arguments: it finds its plan's folder and writes its shards again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

from ckptconv._text import human_bytes, plural
from ckptconv.errors import DestinationError, WriteError
from ckptconv.reading.formats._base import MetadataValue, json_bytes, metadata_text
from ckptconv.runtime.signals import signals_deferred
from ckptconv.values.tensor import TensorRef
from ckptconv.writing import shards, write_policy
from ckptconv.writing.atomic import atomic_output
from ckptconv.writing.files import WriteReport
from ckptconv.writing.provenance import file_sha256

__all__ = ["Part", "PartsPlan", "parse_part", "plan_parts", "planned", "write_part"]

_FOLDER = ".ckptconv-parts."
_LOCK = "lock"


@dataclass(frozen=True)
class Part:
    """Part ``index`` (from 0) of ``count``."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_part(text: str) -> Part:
    """``"2/4"`` -> ``Part(2, 4)``.

    Raises:
        ValueError: not INDEX/COUNT with 0 <= INDEX < COUNT (a sentence saying so).
    """
    index, slash, count = text.strip().partition("/")
    if not (slash and index.isdigit() and count.isdigit()):
        raise ValueError(f"--part takes INDEX/COUNT (0/4 to 3/4), not {text!r}")
    part = Part(int(index), int(count))
    if not 0 <= part.index < part.count:
        raise ValueError(f"part {part.index} is not in 0..{part.count - 1} (of {part.count} parts)")
    return part


@dataclass(frozen=True)
class PartsPlan:
    """Which part writes which shard.

    Attributes:
        names: the shards' file names, in order; ``index``: the index's name ("" for one shard).
        sizes: each shard's tensor bytes.
        owner: for each shard, the part that writes it.
    """

    names: tuple[str, ...]
    index: str
    sizes: tuple[int, ...]
    owner: tuple[int, ...]

    def describe(self, count: int) -> list[str]:
        """One line per part: its shards and bytes (what ``--dry-run`` prints)."""
        lines = []
        for part in range(count):
            mine = [name for name, who in zip(self.names, self.owner) if who == part]
            size = sum(size for size, who in zip(self.sizes, self.owner) if who == part)
            shown = ", ".join(mine) if mine else "nothing"
            lines.append(f"part {part}/{count}: {plural(len(mine), 'shard')}, {human_bytes(size)}: {shown}")
        return lines


def plan_parts(plan: shards.ShardPlan, names: Sequence[str], index: str, count: int) -> PartsPlan:
    """Give the shards of ``plan`` (named ``names``) to ``count`` parts, byte-balanced."""
    owner = shards.balance(list(zip(names, plan.sizes)), count)
    return PartsPlan(tuple(names), index if len(names) > 1 else "", plan.sizes, tuple(owner))


def planned(
    entries: Sequence[tuple[str, TensorRef]], kind: str, part: str | None, max_shard_size: int | None
) -> tuple[str, ...]:
    """What ``convert --part i/N --dry-run`` says: every part's shards and bytes, one sentence each (the shards named
    as a plain folder names them; a PEFT or diffusers model folder names them after its own stem)."""
    if part is None or kind == "dcp":
        return ()
    this = parse_part(part)
    plan = shards.plan_shards(entries, max_shard_size)
    names, index = shards.shard_names(kind, len(plan.shards))
    lines = plan_parts(plan, names, index, this.count).describe(this.count)
    return tuple(line.replace(f"part {this}:", f"part {this} (this one):", 1) for line in lines)


def _plan_digest(plan: shards.ShardPlan, names: Sequence[str], metadata: Mapping[str, MetadataValue] | None) -> str:
    """What every part of one output agrees on: the shards' names and tensors, and the metadata that is known
    before the write (a source digest computed during it is left out; the tensors' keys and dtypes are in)."""
    described: list[Any] = []
    for name, shard in zip(names, plan.shards):
        described.append([name, [[key, str(ref.dtype), list(ref.shape), ref.nbytes] for key, ref in shard]])
    known = {key: value for key, value in (metadata or {}).items() if isinstance(value, str)}
    text = json.dumps([described, sorted(known.items())], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _hidden_folder(path: str) -> None:
    """Make the parts' folder, or find it made by another part; never a link or a file in its place."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise WriteError(f"{path!r} is not a folder; remove it (ckptconv keeps a part's shards there)", path=path)


def write_part(
    plan: shards.ShardPlan,
    names: Sequence[str],
    index_file: str,
    folder: str,
    part: Part,
    *,
    kind: str,
    metadata: Mapping[str, MetadataValue] | None,
    write_shard: Callable[[Sequence[tuple[str, TensorRef]], str], WriteReport],
    check: Callable[[str], None] | None,
    inputs: write_policy.Inputs,
    removed: Sequence[str],
    fsync: bool,
) -> WriteReport:
    """Write part ``part`` of the sharded folder ``folder``; publish the whole folder if it is the last.

    Args:
        plan, names, index_file: the folder's shards, their file names and the index's.
        write_shard: writes one shard's entries to a path, as the one-process write does.
        check: the write's check, given the staged index (or only shard) before anything is published.
        removed: the previous output's files to remove once the new one is published.

    Returns:
        The write's report; ``pending`` says how many parts are still to come (0: published).

    Raises:
        DestinationError: the output is a DCP folder or a single file.
        WriteError: a file cannot be written; a part's shard no longer matches its record.
    """
    parts = plan_parts(plan, names, index_file, part.count)
    staging = os.path.join(folder, _FOLDER + _plan_digest(plan, names, metadata))
    _hidden_folder(staging)
    record: dict[str, Any] = {"part": part.index, "count": part.count, "shards": {}, "weight_map": {}, "bytes": 0}
    record["aliases"] = {}
    written = 0
    for shard, name, owner in zip(plan.shards, names, parts.owner):
        if owner != part.index:
            continue
        report = write_shard(shard, os.path.join(staging, name))
        path = os.path.join(staging, name)
        record["shards"][name] = {"size": os.path.getsize(path), "sha256": file_sha256(path)}
        record["weight_map"].update({key: name for key, _ in shard if key not in report.aliases})
        record["aliases"].update(report.aliases)
        record["bytes"] += report.bytes
        written += 1
    with atomic_output(os.path.join(staging, _record_name(part)), overwrite=True, fsync=fsync, inputs=inputs) as file:
        file.write(json_bytes(record))
    return _publish_if_last(parts, part, folder, staging, kind, metadata, check, removed, fsync, inputs, record)


def _record_name(part: Part) -> str:
    return f"part-{part.index:04d}-of-{part.count:04d}.json"


def _publish_if_last(
    parts: PartsPlan,
    part: Part,
    folder: str,
    staging: str,
    kind: str,
    metadata: Mapping[str, MetadataValue] | None,
    check: Callable[[str], None] | None,
    removed: Sequence[str],
    fsync: bool,
    inputs: write_policy.Inputs,
    mine: Mapping[str, Any],
) -> WriteReport:
    import fcntl

    published = [os.path.join(folder, name) for name in (*parts.names, *([parts.index] if parts.index else []))]
    try:
        lock = os.open(os.path.join(staging, _LOCK), os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except FileNotFoundError:  # another part published and removed the folder meanwhile
        return _report(folder, kind, mine, published, 0)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(staging):
            return _report(folder, kind, mine, published, 0)
        records = [_read_record(staging, Part(index, part.count)) for index in range(part.count)]
        missing = sum(record is None for record in records)
        if missing:
            return _report(folder, kind, mine, [os.path.join(staging, name) for name in mine["shards"]], missing)
        weight_map: dict[str, str] = {}
        aliases: dict[str, str] = {}
        total = 0
        for record in [record for record in records if record is not None]:
            for name, expected in record["shards"].items():
                path = os.path.join(staging, name)
                if (
                    not os.path.isfile(path)
                    or os.path.getsize(path) != expected["size"]
                    or file_sha256(path) != expected["sha256"]
                ):
                    raise WriteError(
                        f"the shard {name!r} of part {record['part']}/{part.count} in {staging!r} is not what that "
                        "part recorded; run that part again",
                        path=path,
                    )
            weight_map.update(record["weight_map"])
            aliases.update(record["aliases"])
            total += int(record["bytes"])
        order = list(parts.names)
        if parts.index:
            index_metadata = {k: metadata_text(v) for k, v in (metadata or {}).items() if k.startswith("ckptconv.")}
            document = shards.index_document(weight_map, total, index_metadata)
            with atomic_output(os.path.join(staging, parts.index), overwrite=True, fsync=fsync, inputs=inputs) as file:
                file.write(document)
            order.append(parts.index)
        if check is not None:
            check(os.path.join(staging, order[-1]))
        with signals_deferred():
            for name in order:
                os.replace(os.path.join(staging, name), os.path.join(folder, name))
            for path in removed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            for name in os.listdir(staging):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(staging, name))
            with contextlib.suppress(OSError):
                os.rmdir(staging)
        return _report(folder, kind, {"weight_map": weight_map, "aliases": aliases, "bytes": total}, published, 0)
    except OSError as error:
        if isinstance(error, WriteError):
            raise
        raise write_policy.os_error(error, staging) from None
    finally:
        os.close(lock)


def _read_record(staging: str, part: Part) -> dict[str, Any] | None:
    path = os.path.join(staging, _record_name(part))
    try:
        with open(path, "rb") as file:
            record = json.loads(file.read())
    except (OSError, ValueError):
        return None
    shards_ok = isinstance(record, dict) and isinstance(record.get("shards"), dict)
    return (
        record
        if shards_ok and record.get("count") == part.count and isinstance(record.get("weight_map"), dict)
        else None
    )


def _report(folder: str, kind: str, record: Mapping[str, Any], files: Sequence[str], pending: int) -> WriteReport:
    """The report of a part (its shards; ``pending``: parts still to come), or of the whole folder it published."""
    return WriteReport(
        folder,
        kind,
        len(record["weight_map"]) + len(record["aliases"]),
        int(record["bytes"]),
        dict(record["aliases"]),
        tuple(files),
        pending=pending,
    )


def refuse_parts(kind: str, folder_output: bool) -> None:
    """``--part`` writes part of a sharded folder: refused for a single file or a DCP folder."""
    if kind == "dcp" or not folder_output:
        raise DestinationError(
            "--part writes part of a sharded folder: give a folder DST with --max-shard-size (not --to dcp)"
        )
