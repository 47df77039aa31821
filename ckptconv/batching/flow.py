"""Batch: convert every checkpoint under a folder the same way, with a manifest.

:func:`batch` is the whole flow in one call, and what ``ckptconv batch`` runs::

    discovery.py   discover() / plan_outputs()   the items, and where each output goes
    manifest.py    Manifest                      what is done already (resume); append each result
    executors.py   run_local() / run_dask()      convert items in workers that never raise
    report.py      BatchReport                   per-item results and the exit code

It prints nothing; progress is a parameter, and the report says what happened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import stat
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Union

from ckptconv._paths import PathLike, as_path
from ckptconv._text import plural
from ckptconv._version import __version__
from ckptconv.batching.executors import (
    SCHEDULER_TIMEOUT_S,
    Job,
    check_scheduler,
    check_sendable,
    run_dask,
    run_local,
)
from ckptconv.batching.manifest import MANIFEST_NAME, Manifest, latest_conversions, now, read_records
from ckptconv.batching.outputs import Planned, folds_case, plan_outputs
from ckptconv.batching.report import CANCELLED, FAILED, PLANNED, SKIPPED, UNSAFE, BatchReport, ItemResult
from ckptconv.batching.sharding import Shard, ShardPlan, manifest_name, plans
from ckptconv.errors import DestinationError, LoadError, WriteError
from ckptconv.options import ConversionOptions, fingerprint_defaults, fingerprint_flags
from ckptconv.reading.discovery import FILE, MODEL, Item, discover
from ckptconv.writing import write_policy
from ckptconv.writing.naming import output_format
from ckptconv.writing.provenance import file_sha256
from ckptconv.writing.transaction import locked

__all__ = ["batch"]

BatchProgress = Union[bool, Callable[[ItemResult], None]]

EXECUTORS = ("local", "dask")


def _output_options(options: ConversionOptions) -> dict[str, Any]:
    """What decides an output's bytes: a resumed item must have been made with the same."""
    return options.fingerprint()


def _fingerprint(options: ConversionOptions) -> str:
    return hashlib.sha256(json.dumps(_output_options(options), sort_keys=True).encode()).hexdigest()[:16]


# How each output option is spelled on the command line, for the message of a refused resume.
_FLAGS = fingerprint_flags()
_DEFAULTS = fingerprint_defaults()  # entries a fingerprint leaves out while they keep their default


def _shown(name: str, value: Any) -> str:
    if name == "transforms":
        return "; ".join(value) if value else "none"
    if _FLAGS[name].startswith("--no-"):  # --no-source-hash: "yes" when the hash was left out
        return "no" if value else "yes"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return "none" if value is None else str(value)


def _check_same_options(
    manifest_path: str,
    output_dir: str,
    done: dict[str, dict[str, Any]],
    planned: Sequence[Planned],
    options: ConversionOptions,
) -> None:
    """Refuse to resume into a folder whose outputs were made with other options.

    Without this, ``--resume`` with other options would convert every item again and
    silently replace the earlier outputs (bf16 files rewritten as fp32).

    Raises:
        DestinationError: a converted item on record was made with other options; the message
            names the options that differ and how to proceed.
    """
    fingerprint = _fingerprint(options)
    others = {
        str(record.get("options"))
        for plan in planned
        if (record := done.get(plan.item.name)) is not None and record.get("options") != fingerprint
    }
    if not others:
        return
    count = sum(1 for plan in planned if done.get(plan.item.name, {}).get("options", fingerprint) != fingerprint)
    recorded: dict[str, Any] | None = None
    for record in read_records(manifest_path):  # the latest run that made such an output
        run_options = record.get("options") if record.get("record") == "run" else None
        if isinstance(run_options, dict) and run_options.get("fingerprint") in others:
            recorded = record.get("output_options")
    now_options = _output_options(options)
    if isinstance(recorded, dict):
        differ = [
            f"  {_FLAGS[name]}: {_shown(name, then)} → {_shown(name, value)}"
            for name in _FLAGS
            if (value := now_options.get(name, _DEFAULTS.get(name)))
            != (then := recorded.get(name, _DEFAULTS.get(name)))
        ]
    else:
        differ = []
    what = " (recorded → now):\n" + "\n".join(differ) + "\n" if differ else " (the manifest does not say which); "
    items = plural(count, "item")
    raise DestinationError(
        f"cannot resume: {items} in {output_dir!r} {'was' if count == 1 else 'were'} converted with other "
        f"options{what}"
        "resume with the same options, choose another output folder, or pass --overwrite to convert "
        "them again with these options",
        path=output_dir,
    )


def _still_done(plan: Planned, record: dict[str, Any] | None, output_dir: str, fingerprint: str) -> bool:
    """True if ``record`` vouches for this item's current output (see :func:`batch`, ``resume``)."""
    item = plan.item
    if record is None or record.get("options") != fingerprint or record.get("output") != plan.output:
        return False
    if record.get("source_size") != item.size:
        return False
    if record.get("source_mtime_ns") != item.mtime_ns:
        # Touched or copied: the same bytes still count, if we know them.
        recorded = record.get("source_sha256")
        if not recorded or item.kind != FILE:
            return False
        try:
            if file_sha256(item.path) != recorded:
                return False
        except OSError:
            return False
    # The outputs vouch only as this item's own file in DST: a record is data anyone may have edited,
    # and a path that leaves DST (``../x``, ``/abs``, a link) or names another file proves nothing.
    # A model folder's outputs are its files, each inside the folder it names (``hf/model.safetensors``).
    outputs = record.get("outputs")
    model = item.kind == MODEL
    if not isinstance(outputs, list) or not outputs or (len(outputs) != 1 and not model):
        return False
    for output in outputs:
        name = output.get("path") if isinstance(output, dict) else None
        if not isinstance(name, str) or not _vouches(output, name, plan.output, output_dir, model=model):
            return False
    return True


def _vouches(output: dict[str, Any], name: str, planned: str, output_dir: str, *, model: bool) -> bool:
    """True when the recorded output ``name`` is the planned output (a file inside it, for a model folder) and
    still has its recorded size and sha256."""
    if name != planned and not (model and name.startswith(planned) and ".." not in name.split("/")):
        return False
    path = os.path.join(output_dir, *name.split("/"))
    try:
        inside = os.path.realpath(path).startswith(os.path.join(os.path.realpath(output_dir), ""))
        info = os.lstat(path)
        if not inside or not stat.S_ISREG(info.st_mode) or info.st_size != output.get("size"):
            return False
        recorded = output.get("sha256")
        if recorded is not None and file_sha256(path) != recorded:
            return False
    except (OSError, ValueError, LoadError):
        return False
    return True


def _progress(
    progress: BatchProgress, total_bytes: int, total_items: int
) -> tuple[Callable[[ItemResult], None], Callable[[], None]]:
    if callable(progress):
        return progress, lambda: None
    if not progress:
        return (lambda result: None), (lambda: None)
    from tqdm.auto import tqdm

    bar = tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="ckptconv batch",
        dynamic_ncols=True,
        file=sys.stderr,
        smoothing=0.05,
    )
    counts = {"done": 0, "failed": 0}
    bar.set_postfix_str(f"0/{total_items} items", refresh=False)

    def update(result: ItemResult) -> None:
        counts["done"] += 1
        counts["failed"] += result.status == FAILED
        failed = f", {counts['failed']} failed" if counts["failed"] else ""
        bar.set_postfix_str(f"{counts['done']}/{total_items} items{failed}", refresh=False)
        bar.update(result.source_size)

    return update, bar.close


def batch(
    source_dir: PathLike,
    output_dir: PathLike,
    *,
    options: ConversionOptions | None = None,
    glob: str | Sequence[str] | None = None,
    jobs: int = 1,
    executor: str = "local",
    scheduler: str | None = None,
    scheduler_timeout: float = SCHEDULER_TIMEOUT_S,
    resume: bool = False,
    fail_fast: bool = False,
    dry_run: bool = False,
    progress: BatchProgress = False,
    shard: Shard | None = None,
    **changes: Any,
) -> BatchReport:
    """Convert every checkpoint under ``source_dir`` into ``output_dir``, mirroring the tree.

    Items are found by content and name (see :mod:`ckptconv.reading.discovery`); a
    sharded checkpoint (index and shards) or a DCP folder is one item. Each
    item is converted as :func:`ckptconv.convert` would, in a worker that gets
    its paths, never tensors, and returns a result instead of raising: a bad
    file never stops the batch (unless ``fail_fast``). Each result is appended
    to ``output_dir/ckptconv-manifest.jsonl`` as soon as the item finishes.

    Args:
        source_dir: the folder to search, recursively.
        output_dir: where outputs go (created if missing); ``a/b/model.pth``
            becomes ``a/b/model.safetensors`` there.
        options: how to convert each item (:class:`~ckptconv.options.ConversionOptions`);
            ``to`` defaults to safetensors, and the folder layouts (``to="dcp"``,
            ``max_shard_size``) and ``fit_to`` are for :func:`ckptconv.convert`.
        glob: only items whose relative path matches (``"**/*.pth"``); several allowed.
        jobs: items converted at once: 1 converts in this process, more start
            that many worker processes (for ``executor="dask"`` without a
            scheduler, the local cluster's size).
        executor: ``"local"`` or ``"dask"`` (needs ``pip install 'ckptconv[dask]'``).
        scheduler: with ``executor="dask"``, the scheduler's address
            (``"tcp://host:8786"``); None starts a local cluster.
        scheduler_timeout: with ``executor="dask"``, seconds to wait for the scheduler to answer and
            for a worker to join it, before giving up with a :class:`~ckptconv.errors.CkptconvError`.
        resume: skip items whose latest manifest record says they were converted
            with the same options from a source of the same size and mtime (or,
            if the mtime changed, the same sha256) into an output that still
            exists with the recorded size. Other items are converted again,
            replacing an output no record vouches for (a killed run may have
            written it without recording it).
        fail_fast: stop starting items after the first failure; items never
            started are reported as cancelled.
        dry_run: find and plan, convert and write nothing (not even the manifest).
        progress: True for one progress bar on stderr (items, bytes, rate, ETA),
            or a callable given each :class:`ItemResult` as it finishes.
        shard: convert only this shard's items (:mod:`ckptconv.batching.sharding`: a size-balanced
            split that every shard computes alike), recorded in its own manifest
            (``ckptconv-manifest.shard-0003-of-0008.jsonl``) under its own lock, so N processes can
            run into one ``output_dir`` at once; ``resume`` reads that manifest only.
        **changes: fields of :class:`~ckptconv.options.ConversionOptions` to set
            on ``options`` (``transforms=[...]``, ``to="pt"``, ``verify=True``).

    Returns:
        A :class:`BatchReport`; its ``exit_code`` is 0 when every item was
        converted (now or before), 4 when any is unsafe (as ``scan``), else 3 when any failed.

    Raises:
        LoadError: ``source_dir`` is missing or not a folder.
        WriteError: ``output_dir`` cannot be created, is ``source_dir``, or is in
            use by another batch; the manifest cannot be written.
        CkptconvError: the dask executor is asked for but not installed or reachable, or no worker
            joined its scheduler within ``scheduler_timeout`` seconds.
        ValueError: invalid ``jobs``, ``executor`` or ``scheduler``; a folder layout or ``fit_to``.
        TypeError: a keyword that is not an options field.

    Example:
        >>> report = ckptconv.batch("zoo", "out", transforms=[ckptconv.Cast("bf16")], jobs=4)  # doctest: +SKIP
        >>> report.exit_code, [r.error for r in report.failed]                                 # doctest: +SKIP
        (3, ["'broken.pt' is truncated ..."])
    """
    started = time.perf_counter()
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, not {executor!r}")
    if scheduler is not None and executor != "dask":
        raise ValueError("a scheduler address needs executor='dask'")
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, not {jobs}")
    if not scheduler_timeout > 0:
        raise ValueError(f"scheduler_timeout must be more than 0 seconds, not {scheduler_timeout}")
    options = (options or ConversionOptions()).with_changes("batch", **changes)
    if (options.to or "").lower() == "dcp" or options.max_shard_size is not None:
        raise ValueError("batch writes one file per item; convert DCP outputs one by one with ckptconv convert")
    if options.fit_to is not None:
        raise ValueError("batch does not fit keys to a reference; use ckptconv.convert(..., fit_to=...) per file")
    kind = output_format("", options.to or "safetensors")
    options = options.with_changes(to=kind)
    source_dir, output_dir = as_path(source_dir), as_path(output_dir)
    source = os.path.abspath(source_dir)
    output = os.path.abspath(output_dir)
    # Compare real paths: SRC or DST spelled through a link is still the same folder.
    if os.path.realpath(output) == os.path.realpath(source):
        raise WriteError(f"the output folder {output_dir!r} is the source folder; choose another one", path=output)
    if os.path.exists(output) and not os.path.isdir(output):
        raise WriteError(f"{output_dir!r} is a file; the output must be a folder", path=output)
    # One writer per output, the lock convert takes: a batch running into DST is named before DST's outputs are.
    # Shards run into one DST at once: each holds its own manifest's lock instead (two runs of one shard: refused).
    with locked(None if dry_run or shard is not None else output, what="ckptconv batch"):
        return _batch_locked(
            source_dir,
            output_dir,
            source,
            output,
            options,
            kind,
            glob,
            jobs,
            executor,
            scheduler,
            scheduler_timeout,
            resume,
            fail_fast,
            dry_run,
            progress,
            started,
            shard,
        )


def _batch_locked(
    source_dir: str,
    output_dir: str,
    source: str,
    output: str,
    options: ConversionOptions,
    kind: str,
    glob: str | Sequence[str] | None,
    jobs: int,
    executor: str,
    scheduler: str | None,
    scheduler_timeout: float,
    resume: bool,
    fail_fast: bool,
    dry_run: bool,
    progress: BatchProgress,
    started: float,
    shard: Shard | None,
) -> BatchReport:
    """:func:`batch`, under the lock on its output folder (a shard: its manifest's lock)."""
    globs = [glob] if isinstance(glob, str) else list(glob or ())
    notes: list[str] = []
    items = discover(source_dir, globs=globs, exclude=[output], notes=notes, models=True)
    planned = plan_outputs(items, kind, fold_case=folds_case(output))
    shard_plans: tuple[ShardPlan, ...] = ()
    if shard is not None:  # every shard plans the whole batch alike, then keeps its own items
        shard_plans = plans([(plan.item.name, plan.item.size) for plan in planned], shard.count)
        mine = set(shard_plans[shard.index].items)
        planned = [plan for plan in planned if plan.item.name in mine]
    manifest_path = os.path.join(output, MANIFEST_NAME if shard is None else manifest_name(shard))
    fingerprint = _fingerprint(options)
    done = latest_conversions(manifest_path) if resume else {}
    if resume and not options.overwrite:
        _check_same_options(manifest_path, output_dir, done, planned, options)

    results: dict[str, ItemResult] = {}
    refused: list[ItemResult] = []
    existing: list[str] = []  # outputs there already, without --resume or --overwrite
    todo: list[Job] = []
    for plan in planned:
        item = plan.item
        if plan.problem:
            refused.append(_not_run(item, plan.output, kind, FAILED, error=plan.problem, error_type="WriteError"))
        elif not (resume or options.overwrite) and os.path.lexists(os.path.join(output, *plan.output.split("/"))):
            existing.append(plan.output)
        elif resume and _still_done(plan, done.get(item.name), output, fingerprint):
            previous = ItemResult.from_record(done[item.name])
            results[item.name] = dataclasses.replace(previous, status=SKIPPED, duration_s=0.0)
        else:
            todo.append(Job(item, os.path.join(output, *plan.output.split("/")), plan.output, options, replace=resume))
    if existing:  # a batch ran there before: one line saying what to pass, and nothing recorded as failed
        if len(existing) == len(planned):
            which, why = f"the outputs of all {plural(len(planned), 'item')}", "a batch ran there before"
        else:
            which, why = f"{len(existing)} of {len(planned)} outputs", f"e.g. {existing[0]!r}; a batch ran there before"
        raise DestinationError(
            f"{which} exist already in {output_dir!r} ({why}); "
            "pass --resume to skip what it converted, or --overwrite to convert them again",
            path=output_dir,
        )
    results.update((result.source, result) for result in refused)

    if dry_run or not planned:  # nothing to do: no output folder, no manifest
        for job in todo:
            results[job.item.name] = _not_run(job.item, job.output_name, kind, PLANNED)
        return _report(
            source, output, "", planned, results, started, notes=notes, dry_run=dry_run, shard=shard, shards=shard_plans
        )
    if executor == "local" and jobs > 1 and len(todo) > 1:
        check_sendable(options)  # before the output folder and the manifest exist
    if executor == "dask" and scheduler is not None and todo:
        check_scheduler(scheduler, timeout=scheduler_timeout)  # likewise: a scheduler without workers

    created = _make_output_folder(output_dir)
    run = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + os.urandom(3).hex()
    with contextlib.ExitStack() as stack:
        try:
            manifest = stack.enter_context(Manifest(manifest_path, run=run, fingerprint=fingerprint))
        except BaseException:
            write_policy.remove_folders(created)  # nothing was written: leave no empty folder behind
            raise
        manifest.append(
            "run",
            {
                "started_at": now(),
                "ckptconv_version": __version__,
                "source_dir": source,
                "output_dir": output,
                "options": {
                    "fingerprint": fingerprint,
                    "select": options.select,
                    "transforms": options.transforms.describe(),
                    "format": kind,
                    "trust": options.trust,
                    "verify": options.verify,
                    "overwrite": options.overwrite,
                    "resume": resume,
                    "fail_fast": fail_fast,
                    "glob": globs,
                    "checksums": options.checksums,
                },
                "output_options": _output_options(options),
                "executor": executor,
                "scheduler": scheduler,
                "jobs": jobs,
                "items": len(planned),
                "to_convert": len(todo),
                **({"shard": _shard_record(shard, shard_plans)} if shard is not None else {}),
                "notes": list(notes),
            },
        )
        for result in refused:
            manifest.item(result)
        stopping = threading.Event()  # read by the executor between items
        if fail_fast and refused:
            stopping.set()
        update, close = _progress(progress, sum(job.item.size for job in todo), len(todo))
        made = _make_item_folders(todo, output)
        try:
            for result in _execute(
                todo, executor=executor, scheduler=scheduler, timeout=scheduler_timeout, jobs=jobs, stop=stopping.is_set
            ):
                manifest.item(result)
                results[result.source] = result
                update(result)
                if fail_fast and result.status in (FAILED, UNSAFE):
                    stopping.set()
        finally:
            close()
            # Only now, with every worker done, can a folder no output went into be removed; never while
            # other shards may be about to write into it (it stays, empty).
            if shard is None:
                write_policy.remove_folders(made)
        for job in todo:
            if job.item.name not in results:
                results[job.item.name] = _not_run(job.item, job.output_name, kind, CANCELLED)
        report = _report(
            source, output, manifest_path, planned, results, started, notes=notes, shard=shard, shards=shard_plans
        )
        manifest.append(
            "end",
            {
                "finished_at": now(),
                "converted": len(report.converted),
                "skipped": len(report.skipped),
                "failed": len(report.failed),
                "unsafe": len(report.unsafe),
                "cancelled": len(report.cancelled),
                "duration_s": round(report.duration_s, 3),
            },
        )
    return report


def _make_item_folders(jobs: Sequence[Job], output: str) -> list[str]:
    """Create every output subfolder once, before any worker runs; the folders created, outermost first.

    Workers then find their folders made and remove none: a failed item's cleanup must never remove
    a folder a sibling is about to write into (``--jobs 2``: "folder ... does not exist"). A folder
    that cannot be made (a link in the way) is left to the item's worker, which fails it in its words.
    """
    made: list[str] = []
    for job in jobs:
        folder = os.path.dirname(job.output)
        if folder != output and not os.path.isdir(folder):
            with contextlib.suppress(WriteError):
                made.extend(write_policy.make_folders(folder, root=output))
    return made


def _make_output_folder(output: str) -> list[str]:
    """Create DST (and missing parents, below the part of it that exists, as convert does:
    :func:`~ckptconv.writing.write_policy.make_folders`); the folders created, so a failed start can remove them."""
    return write_policy.make_folders(output)


def _execute(
    todo: Sequence[Job], *, executor: str, scheduler: str | None, timeout: float, jobs: int, stop: Callable[[], bool]
) -> Iterator[ItemResult]:
    if not todo:
        return iter(())
    if executor == "dask":
        return run_dask(todo, scheduler=scheduler, workers=jobs, stop=stop, timeout=timeout)
    return run_local(todo, workers=jobs, stop=stop)


def _not_run(item: Item, output: str, kind: str, status: str, *, error: str = "", error_type: str = "") -> ItemResult:
    """The result of an item no worker converted: refused up front, only planned, or cancelled."""
    return ItemResult(
        source=item.name,
        status=status,
        kind=item.kind,
        output=output,
        source_size=item.size,
        source_mtime_ns=item.mtime_ns,
        format=kind,
        error=error,
        error_type=error_type,
    )


def _report(
    source: str,
    output: str,
    manifest: str,
    planned: Sequence[Planned],
    results: dict[str, ItemResult],
    started: float,
    *,
    notes: Sequence[str] = (),
    dry_run: bool = False,
    shard: Shard | None = None,
    shards: tuple[ShardPlan, ...] = (),
) -> BatchReport:
    ordered = tuple(results[plan.item.name] for plan in planned if plan.item.name in results)
    return BatchReport(
        source_dir=source,
        output_dir=output,
        manifest=manifest,
        results=ordered,
        duration_s=time.perf_counter() - started,
        dry_run=dry_run,
        notes=tuple(notes),
        shard=shard,
        shards=shards,
    )


def _shard_record(shard: Shard, shards: Sequence[ShardPlan]) -> dict[str, Any]:
    """The run record's ``shard``: which one, and its items (what ``batch --report`` counts on)."""
    mine = shards[shard.index]
    return {"index": shard.index, "count": shard.count, "from": shard.source, "items": list(mine.items)}
