"""One sharded folder written by N processes at once (``convert SRC DST/ --max-shard-size S --part i/N``).

Every part plans the whole folder alike (:func:`~ckptconv.writing.shards.plan_shards` over the output
tensors, so any source works), gives the shards to parts byte-balanced
(:func:`~ckptconv.writing.shards.balance` over the shards' sizes, largest first, equal sizes by name), and
writes only its own shards, into a hidden folder beside DST shared by the parts of this plan:
``.DST.ckptconv-parts-<plan>``, ``<plan>`` a digest of the shards' names and tensors (keys, dtypes,
shapes) and of the output's metadata, so the parts of another plan never mix with these. Then it writes
a completion record (``part-0002-of-0004.json``: each of its shards' size, sha256, bytes and aliases),
atomically. No part holds DST's output lock (:mod:`.locks`) while it writes its shards.

The part that, holding the hidden folder's lock, finds every record present publishes: it checks each
shard against the size and sha256 its part recorded, then writes the folder as one process would, in one
transaction under DST's lock (:mod:`.transaction`), each shard linked in from the hidden folder instead of
written again; the index, a model folder's carried files and the write's check (``--verify``) on the whole
staged folder follow as they do for one process. Then it removes the hidden folder. The lock makes one part
publish when two finish at once; the other then finds the hidden folder gone. Until then ``DST`` holds only
what it held before. A part killed half-way is run again with the same arguments: it finds its plan's folder
and writes its shards again; a publish that failed (an existing DST without ``--overwrite``) leaves the
hidden folder whole, and the last part run again publishes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

from ckptconv._text import human_bytes, plural
from ckptconv.errors import CkptconvError, DestinationError, WriteError
from ckptconv.reading import read_policy
from ckptconv.reading.formats._base import MetadataValue, json_bytes
from ckptconv.values.tensor import TensorRef
from ckptconv.writing import shards, write_policy
from ckptconv.writing.atomic import atomic_output
from ckptconv.writing.files import WriteReport
from ckptconv.writing.locks import short_name
from ckptconv.writing.naming import FOLDER_FORMATS
from ckptconv.writing.provenance import file_sha256

__all__ = ["Part", "PartsPlan", "WrittenBefore", "parse_part", "plan_parts", "planned", "refuse_parts", "write_part"]

_FOLDER = ".ckptconv-parts-"
#: Puts the shard a part wrote in the staging folder: ``(shard entries, name, path) -> its WriteReport``.
WrittenBefore = Callable[[Any, str, str], WriteReport]
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
    if not (slash and index.isdecimal() and count.isdecimal()):
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
    if part is None or kind in FOLDER_FORMATS:
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
    publish: Callable[[WrittenBefore], WriteReport],
    inputs: write_policy.Inputs,
    fsync: bool,
) -> WriteReport:
    """Write part ``part`` of the sharded folder ``folder``; publish the whole folder if it is the last.

    Args:
        plan, names, index_file: the folder's shards, their file names and the index's.
        write_shard: writes one shard's entries to a path, as the one-process write does.
        publish: writes and publishes the folder as one process does, given how to put each shard in place.

    Returns:
        The write's report; ``pending`` says how many parts are still to come (0: published).

    Raises:
        WriteError: a file cannot be written; a part's shard no longer matches its record; and what
            ``publish`` raises.
    """
    parts = plan_parts(plan, names, index_file, part.count)
    parent, name = os.path.split(folder.rstrip("/" + os.sep))
    hidden = os.path.join(parent, f".{short_name(name)}{_FOLDER}{_plan_digest(plan, names, metadata)}")
    _hidden_folder(hidden)
    record: dict[str, Any] = {"part": part.index, "count": part.count, "shards": {}}
    for shard, shard_name, owner in zip(plan.shards, names, parts.owner):
        if owner != part.index:
            continue
        path = os.path.join(hidden, shard_name)
        report = write_shard(shard, path)
        record["shards"][shard_name] = {
            "size": os.path.getsize(path),
            "sha256": file_sha256(path),
            "bytes": report.bytes,
            "aliases": dict(report.aliases),
        }
    with atomic_output(os.path.join(hidden, _record_name(part)), overwrite=True, fsync=fsync, inputs=inputs) as file:
        file.write(json_bytes(record))
    mine = record["shards"]
    waiting = WriteReport(
        folder,
        kind,
        sum(len(shard) for shard, owner in zip(plan.shards, parts.owner) if owner == part.index),
        sum(int(entry["bytes"]) for entry in mine.values()),
        {alias: key for entry in mine.values() for alias, key in entry["aliases"].items()},
        tuple(os.path.join(hidden, shard_name) for shard_name in mine),
    )
    return _publish_if_last(part, hidden, waiting, publish)


def _record_name(part: Part) -> str:
    return f"part-{part.index:04d}-of-{part.count:04d}.json"


def _publish_if_last(
    part: Part, hidden: str, waiting: WriteReport, publish: Callable[[WrittenBefore], WriteReport]
) -> WriteReport:
    import fcntl

    try:
        lock = os.open(os.path.join(hidden, _LOCK), os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except FileNotFoundError:  # another part published and removed the folder meanwhile
        return dataclasses.replace(waiting, files=())
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(hidden):
            return dataclasses.replace(waiting, files=())
        records = [_read_record(hidden, Part(index, part.count)) for index in range(part.count)]
        missing = sum(record is None for record in records)
        if missing:
            return dataclasses.replace(waiting, pending=missing)
        recorded: dict[str, dict[str, Any]] = {}
        for record in [record for record in records if record is not None]:
            for name, expected in record["shards"].items():
                path = os.path.join(hidden, name)
                if not _matches(path, expected):
                    raise WriteError(
                        f"the shard {name!r} of part {record['part']}/{part.count} in {hidden!r} is not what that "
                        "part recorded; run that part again",
                        path=path,
                    )
                recorded[name] = expected

        def written_before(shard: Any, name: str, path: str) -> WriteReport:
            entry = recorded.get(name)
            if entry is None:
                raise WriteError(
                    f"no part recorded the shard {name!r} in {hidden!r}; run every part again", path=hidden
                )
            try:
                os.link(os.path.join(hidden, name), path)  # the part's file stays until the folder is published
            except OSError:
                shutil.copyfile(os.path.join(hidden, name), path)
            return WriteReport(path, "", len(shard), int(entry["bytes"]), dict(entry["aliases"]), (path,))

        report = publish(written_before)
        for name in os.listdir(hidden):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(hidden, name))
        with contextlib.suppress(OSError):
            os.rmdir(hidden)
        return report
    except OSError as error:
        if isinstance(error, WriteError):
            raise
        raise write_policy.os_error(error, hidden) from None
    finally:
        os.close(lock)


def _matches(path: str, expected: Any) -> bool:
    try:
        return (
            isinstance(expected, dict)
            and os.path.isfile(path)
            and os.path.getsize(path) == expected.get("size")
            and file_sha256(path) == expected.get("sha256")
        )
    except (OSError, CkptconvError):
        return False


def _read_record(hidden: str, part: Part) -> dict[str, Any] | None:
    path = os.path.join(hidden, _record_name(part))
    try:
        record = json.loads(read_policy.read_limited(path, folder=hidden, what="part record"))
    except (OSError, ValueError, CkptconvError):
        return None
    if not isinstance(record, dict) or record.get("count") != part.count or not isinstance(record.get("shards"), dict):
        return None
    return record


def refuse_parts(kind: str, folder_output: bool) -> None:
    """``--part`` writes part of a sharded folder: refused for a single file, a DCP folder, a folder of models."""
    if kind in FOLDER_FORMATS or not folder_output:
        raise DestinationError(
            "--part writes part of a sharded folder: give a folder DST with --max-shard-size (not --to dcp)"
        )
