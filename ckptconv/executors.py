"""Execute: convert the items of a batch, in this process, in worker processes, or on Dask.

A worker receives a small :class:`Job` (paths and options, never tensors),
converts one item with :func:`ckptconv.convert`, and returns a small
:class:`~ckptconv.report.ItemResult`. :func:`run_job` never raises: a bad file,
and even a bug, becomes a failed result, so one item cannot stop the batch.

Every runner is a generator of results in the order items finish, and stops
submitting work once its ``stop()`` callable says so (``fail_fast``), after
draining what is already running.

* :func:`run_local` with one worker converts in this process; with more, it
  uses a :class:`~concurrent.futures.ProcessPoolExecutor` on a ``forkserver``
  (or ``spawn``) context, so no torch or thread state is ever forked. Imports
  are paid once per worker, in its initializer. A worker that dies (killed,
  out of memory) breaks the pool: the items it may have held are retried one
  at a time in a fresh pool, and only the one that kills a worker on its own
  is failed. Workers exit when the batch process dies, even by SIGKILL.
* :func:`run_dask` submits the same jobs to a Dask ``distributed`` cluster.
"""

from __future__ import annotations

import dataclasses
import importlib
import multiprocessing
import os
import re
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable

from .discovery import DCP, FILE, RUN, Item
from .errors import CkptconvError, LoadError, WriteError
from .report import CONVERTED, FAILED, ItemResult, OutputFile
from .transforms import Pipeline

__all__ = ["Job", "Options", "run_dask", "run_job", "run_local"]

Stop = Callable[[], bool]


@dataclass(frozen=True)
class Options:
    """How every item of a batch is converted (the arguments of :func:`ckptconv.convert`)."""

    format: str
    transforms: Pipeline = Pipeline()
    select: str | None = None
    overwrite: bool = False
    trust: bool = False
    verify: bool = False
    fsync: bool = True
    checksums: bool = True
    keep_meta: bool = False
    source_hash: bool = True


@dataclass(frozen=True)
class Job:
    """One item to convert: all a worker needs, and small enough to pickle cheaply.

    Attributes:
        item: the input.
        output: the output's absolute path.
        output_name: the same, relative to the output folder.
        options: how to convert.
        replace: replace an existing output even without ``overwrite`` (``resume``:
            no record vouches for it, so an earlier run may have been killed
            after writing it but before recording it).
    """

    item: Item
    output: str
    output_name: str
    options: Options
    replace: bool = False


# ---------------------------------------------------------------------------------------
# The worker: one item in, one result out, never an exception
# ---------------------------------------------------------------------------------------


def _failed(job: Job, error_type: str, message: str, trace: str = "") -> ItemResult:
    item = job.item
    return ItemResult(
        source=item.name,
        status=FAILED,
        kind=item.kind,
        output=job.output_name,
        source_size=item.size,
        source_mtime_ns=item.mtime_ns,
        format=job.options.format,
        error=message,
        error_type=error_type,
        traceback=trace,
    )


def _qualified(error: BaseException) -> str:
    kind = type(error)
    return f"{kind.__module__}.{kind.__qualname__}"


def run_job(job: Job) -> ItemResult:
    """Convert one item; failures, expected or not, come back as a failed result.

    Example:
        >>> run_job(Job(item, "/out/model.safetensors", "model.safetensors", Options("safetensors")))  # doctest: +SKIP
        ItemResult(source='model.pt', status='converted', ...)
    """
    started = time.perf_counter()
    try:
        result = _convert(job)
    except CkptconvError as error:
        result = _failed(job, type(error).__name__, str(error))
    except Exception as error:  # a bug, or a hostile file finding one: record it, keep going
        result = _failed(
            job,
            _qualified(error),
            f"unexpected {type(error).__name__} while converting {job.item.name!r}: {error} "
            "(a bug in ckptconv; please report it with the traceback from the manifest)",
            traceback.format_exc(),
        )
    return dataclasses.replace(result, duration_s=time.perf_counter() - started)


def _snapshot(item: Item) -> tuple[int, int]:
    """Total size and latest mtime of an item's files, to notice a source changing under us."""
    if item.kind == FILE:
        info = os.stat(item.path)
        return info.st_size, info.st_mtime_ns
    root = os.path.dirname(item.path) if item.kind != DCP else item.path
    if item.kind == RUN:
        from .formats.deepspeed import checkpoint_files

        paths = checkpoint_files(item.path) or []
    else:
        paths = [os.path.join(root, os.path.basename(member)) for member in item.members]
    size = mtime = 0
    for path in paths:
        info = os.stat(path)
        size += info.st_size
        mtime = max(mtime, info.st_mtime_ns)
    return size, mtime


def _convert(job: Job) -> ItemResult:
    """Convert one item; sharded checkpoints and DCP folders are one item each, never split."""
    from .conversion import convert
    from .metadata import file_sha256, source_sha256

    item, options = job.item, job.options
    _prepare_folder(job.output)
    before = _snapshot(item) if os.path.exists(item.path) else None
    report = convert(
        item.path,
        job.output,
        select=options.select,
        transforms=options.transforms,
        to=options.format,
        overwrite=options.overwrite or job.replace,
        trust=options.trust,
        verify=options.verify,
        fsync=options.fsync,
        keep_meta=options.keep_meta,
        source_hash=options.source_hash,
    )
    # The provenance hash convert() already took covers the source; hash only if it did not.
    source_sha = (report.source_sha256 or source_sha256(item.path)) if options.checksums else None
    after = _snapshot(item)
    if before is None or after != before:
        os.unlink(job.output)
        raise LoadError(
            f"{item.name!r} changed while it was being converted; run the batch again with --resume", path=item.path
        )
    output_size = os.stat(job.output).st_size
    output_sha = file_sha256(job.output) if options.checksums else None
    return ItemResult(
        source=item.name,
        status=CONVERTED,
        kind=item.kind,
        output=job.output_name,
        source_size=after[0],
        source_mtime_ns=after[1],
        source_sha256=source_sha,
        source_format=report.source_format,
        format=report.format,
        outputs=(OutputFile(job.output_name, output_size, output_sha),),
        tensors=report.tensors,
        bytes=report.bytes,
        notes=report.notes,
    )


def _prepare_folder(output: str) -> None:
    """Create the output's folder, and remove what an earlier, killed run left there half-written."""
    folder, name = os.path.split(output)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise WriteError(
            f"cannot create the folder {folder!r}: {error.strerror or error}; nothing was written", path=output
        ) from None
    # writing.atomic_output writes to tempfile.mkstemp(prefix=".NAME.", suffix=".partial"): 8 random
    # characters. The batch holds the manifest's lock and gives each output to one job, so these are ours.
    stale = re.compile(rf"\.{re.escape(name)}\.[a-z0-9_]{{8}}\.partial\Z")
    for entry in os.listdir(folder):
        if stale.match(entry):
            try:
                os.unlink(os.path.join(folder, entry))
            except FileNotFoundError:
                pass


# ---------------------------------------------------------------------------------------
# Local execution: this process, or a pool of worker processes
# ---------------------------------------------------------------------------------------


def _start_worker() -> None:
    """Pool initializer: pay the imports once per worker, and die with the batch process."""
    from . import conversion  # noqa: F401 - imports numpy and every format reader, once

    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is not None:
        threading.Thread(target=_exit_with_parent, args=(sentinel,), name="ckptconv-watchdog", daemon=True).start()


def _exit_with_parent(sentinel: int) -> None:
    from multiprocessing.connection import wait as wait_for

    wait_for([sentinel])
    # The batch is gone (killed, even by SIGKILL): stop now. An unfinished output is only a
    # hidden .partial file, which the next run removes.
    os._exit(1)


def _context() -> Any:
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


_DIED = (
    "the worker process died while converting it (killed, out of memory, or a crash in native code); "
    "nothing was written for it"
)


def _outcome(future: Future[ItemResult], job: Job, alone: bool, suspects: deque[Job]) -> tuple[ItemResult | None, bool]:
    """A finished future's result (None if its job must be retried), and whether the pool broke."""
    try:
        return future.result(), False
    except BrokenProcessPool:
        if alone:
            return _failed(job, "WorkerDied", _DIED), True
        suspects.append(job)
        return None, True
    except Exception as error:  # e.g. a job that cannot be pickled: a bug
        message = f"unexpected {type(error).__name__}: {error}"
        return _failed(job, _qualified(error), message, traceback.format_exc()), False


def run_local(jobs: Sequence[Job], *, workers: int = 1, stop: Stop = lambda: False) -> Iterator[ItemResult]:
    """Convert jobs in this process (``workers=1``) or in a pool of worker processes.

    Yields:
        One result per job, in the order they finish; fewer once ``stop()`` is true.
    """
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            if stop():
                return
            yield run_job(job)
        return

    size = min(workers, len(jobs))
    # One queued job per worker besides the running one, so no worker idles while this process
    # records a result (an fsync); few enough that a broken pool has little to retry.
    window = 2 * size
    queue = deque(jobs)
    suspects: deque[Job] = deque()  # submitted when a worker died; retried one at a time
    running: dict[Future[ItemResult], tuple[Job, bool]] = {}
    pool: ProcessPoolExecutor | None = None
    context = _context()
    clean = False
    try:
        while queue or suspects or running:
            if pool is None:
                pool = ProcessPoolExecutor(max_workers=size, mp_context=context, initializer=_start_worker)
            broken = False
            if stop():
                for future in [f for f in running if f.cancel()]:  # queued, not started: cancelled
                    del running[future]
                if not running:
                    break
            else:
                try:  # submit, then take off the queue: a job a broken pool refused stays queued
                    if suspects:
                        if not running:
                            running[pool.submit(run_job, suspects[0])] = (suspects[0], True)
                            suspects.popleft()
                    else:
                        while queue and len(running) < window:
                            running[pool.submit(run_job, queue[0])] = (queue[0], False)
                            queue.popleft()
                except BrokenProcessPool:
                    broken = True
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            outcomes = [_outcome(future, *running.pop(future), suspects) for future in done]
            if broken or any(broke for _, broke in outcomes):
                # A worker died: every other job the pool held fails the same way. Collect them, and
                # start a fresh pool that retries them one by one.
                outcomes += [_outcome(future, job, alone, suspects) for future, (job, alone) in running.items()]
                running.clear()
                pool.shutdown(wait=True, cancel_futures=True)
                pool = None
            yield from (result for result, _ in outcomes if result is not None)
        clean = True
    finally:
        if pool is not None:
            # Interrupted (Ctrl-C, or the consumer gave up): do not wait for running items; their
            # workers exit with this process, and an unfinished output is only a .partial file.
            pool.shutdown(wait=clean, cancel_futures=True)


# ---------------------------------------------------------------------------------------
# Dask
# ---------------------------------------------------------------------------------------


def run_dask(
    jobs: Sequence[Job],
    *,
    scheduler: str | None = None,
    workers: int = 1,
    stop: Stop = lambda: False,
) -> Iterator[ItemResult]:
    """Convert jobs on a Dask ``distributed`` cluster.

    Args:
        jobs: what to convert. The workers must see the same paths (a shared
            file system) and have ckptconv installed.
        scheduler: the scheduler's address (``"tcp://host:8786"``); None starts a
            ``LocalCluster`` of ``workers`` processes on this machine.
        workers: processes of the local cluster (ignored with ``scheduler``).
        stop: once true, the remaining tasks are cancelled.

    Raises:
        CkptconvError: ``distributed`` is not installed, or the scheduler cannot be reached.
    """
    try:
        # Typed as Any: distributed is an optional extra without complete annotations.
        distributed: Any = importlib.import_module("distributed")
    except ImportError:
        raise CkptconvError(
            "the dask executor needs the 'distributed' package; install it with: pip install 'ckptconv[dask]'"
        ) from None
    cluster: Any = None
    if scheduler is None:
        cluster = distributed.LocalCluster(
            n_workers=max(1, workers), threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None
        )
        address = cluster.scheduler_address
    else:
        address = scheduler
    try:
        client = distributed.Client(address, set_as_default=False)
    except (OSError, TimeoutError) as error:
        if cluster is not None:
            cluster.close()
        raise CkptconvError(f"cannot reach the Dask scheduler at {address!r} ({error}); check --scheduler") from None
    token = uuid.uuid4().hex[:8]
    try:
        futures = {
            client.submit(run_job, job, pure=False, key=f"ckptconv-{token}-{index}"): job
            for index, job in enumerate(jobs)
        }
        for future in distributed.as_completed(futures, loop=client.loop):
            job = futures[future]
            if future.cancelled():
                continue
            try:
                result = future.result()
            except Exception as error:  # KilledWorker, a lost worker, ...: this item failed
                result = _failed(job, _qualified(error), f"the Dask task failed: {type(error).__name__}: {error}")
            yield result
            if stop():
                client.cancel([f for f in futures if not f.done()])
                break
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
