"""Merging: one report from the manifests in a batch's output folder (``ckptconv batch --report DST``).

A batch split with ``--shard i/N`` leaves one manifest per shard
(``ckptconv-manifest.shard-0003-of-0008.jsonl``). :func:`merged_report` reads them all, never
anything else, and gives the :class:`~ckptconv.batching.report.BatchReport` one process would have
given: each item's latest record, and the exit code that follows. A shard with no manifest, or
whose latest run has no ``end`` record (still running, or killed), and an item that two shards both
planned, are ``problems``: the exit code is then 3 until they are resolved (run the shard, or run it
again with ``--resume``). A plain batch's manifest is reported the same way.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from ckptconv._paths import PathLike, as_path
from ckptconv.batching.manifest import MANIFEST_NAME, read_records
from ckptconv.batching.report import CANCELLED, BatchReport, ItemResult
from ckptconv.batching.sharding import MANIFEST_GLOB, Shard, manifest_name
from ckptconv.errors import DestinationError, LoadError

__all__ = ["merged_report"]


def merged_report(output_dir: PathLike) -> BatchReport:
    """The report of the batch (all its shards) whose outputs are in ``output_dir``.

    Args:
        output_dir: a batch's DST.

    Returns:
        A :class:`BatchReport` with each item's latest result, sorted by source path;
        ``problems`` names the shards not run or not finished.

    Raises:
        LoadError: ``output_dir`` is not a folder or holds no batch manifest.
        DestinationError: it holds manifests of batches split in different ways (``--shard i/4``
            and ``--shard i/8``, or none): one report would mix them.

    Example:
        >>> report = merged_report("out")      # doctest: +SKIP
        >>> report.exit_code, report.problems  # doctest: +SKIP
        (3, ('shard 2/4 has not run: no ckptconv-manifest.shard-0002-of-0004.jsonl in the folder',))
    """
    output = os.path.abspath(as_path(output_dir))
    if not os.path.isdir(output):
        raise LoadError(f"{output_dir!r} is not a folder; pass the output folder of a batch", path=output)
    names = sorted(os.listdir(output))
    counts = {int(match.group(2)) for name in names if (match := MANIFEST_GLOB.fullmatch(name))}
    layouts = sorted(counts) + ([0] if MANIFEST_NAME in names else [])
    if not layouts:
        raise LoadError(
            f"{output_dir!r} holds no ckptconv batch manifest ({MANIFEST_NAME} or one per shard); "
            "run ckptconv batch into it first",
            path=output,
        )
    if len(layouts) > 1:
        shown = ", ".join("unsplit" if count == 0 else f"in {count} shards" for count in layouts)
        raise DestinationError(
            f"{output_dir!r} holds the manifests of batches split in different ways ({shown}); "
            "report on a folder that one of them wrote",
            path=output,
        )
    (count,) = layouts
    if count == 0:
        return _report(output, [(None, os.path.join(output, MANIFEST_NAME))], os.path.join(output, MANIFEST_NAME))
    shards = [(Shard(index, count), os.path.join(output, manifest_name(Shard(index, count)))) for index in range(count)]
    pattern = os.path.join(output, manifest_name(Shard(0, count)).replace("shard-0000", "shard-*"))
    return _report(output, shards, pattern)


def _report(output: str, manifests: Iterable[tuple[Shard | None, str]], shown: str) -> BatchReport:
    results: dict[str, ItemResult] = {}
    owners: dict[str, list[Shard]] = {}
    problems: list[str] = []
    source_dir = ""
    duration = 0.0
    for shard, path in manifests:
        what = "the batch" if shard is None else f"shard {shard}"
        if not os.path.lexists(path):
            problems.append(f"{what} has not run: no {os.path.basename(path)} in the folder")
            continue
        records = list(read_records(path))
        runs = [index for index, record in enumerate(records) if record.get("record") == "run"]
        if not runs:
            problems.append(f"{what} has not run: {os.path.basename(path)} records no run")
            continue
        run = records[runs[-1]]
        source_dir = str(run.get("source_dir") or source_dir)
        latest = _latest_items(records)
        ended = [record for record in records[runs[-1] :] if record.get("record") == "end"]
        if ended:
            duration = max(duration, float(ended[-1].get("duration_s") or 0.0))
        else:
            problems.append(
                f"{what} has not finished: its latest run ({run.get('run')}) has no end record (still running, or "
                "killed: run it again with --resume)"
            )
        planned = _planned(run) if shard is not None else sorted(latest)
        for name in planned:
            owners.setdefault(name, []).append(shard or Shard(0, 1))
            if name in latest:
                results[name] = ItemResult.from_record(latest[name])
            else:
                why = "it has not finished" if not ended else "it stopped first (--fail-fast)"
                results[name] = ItemResult(name, CANCELLED, error=f"not converted: {what} did not reach it ({why})")
    for name, shards in sorted(owners.items()):
        if len(shards) > 1:
            problems.append(
                f"{name!r} was planned by shards {', '.join(map(str, shards))} (the sources changed while the shards "
                "planned); check its output, and run the batch again with --resume"
            )
    return BatchReport(
        source_dir=source_dir,
        output_dir=output,
        manifest=shown,
        results=tuple(results[name] for name in sorted(results)),
        duration_s=duration,
        problems=tuple(problems),
    )


def _latest_items(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each source's latest item record (a resumed run skips, and so keeps, what an earlier one converted)."""
    latest: dict[str, dict[str, Any]] = {}
    for record in records:
        if record.get("record") == "item" and isinstance(record.get("source"), str):
            try:
                ItemResult.from_record(record)
            except (KeyError, TypeError, ValueError):
                continue  # a record someone edited into nonsense: not a result
            latest[record["source"]] = record
    return latest


def _planned(run: dict[str, Any]) -> list[str]:
    shard = run.get("shard")
    items = shard.get("items") if isinstance(shard, dict) else None
    return [name for name in items if isinstance(name, str)] if isinstance(items, list) else []
