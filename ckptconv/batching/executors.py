"""Execute: convert the items of a batch, in this process, in worker processes, or on Dask.

A worker receives a small :class:`Job` (paths and options, never tensors),
converts one item with :func:`ckptconv.convert`, and returns a small
:class:`~ckptconv.batching.report.ItemResult`. :func:`run_job` never raises: a bad file,
and even a bug, becomes a failed result, so one item cannot stop the batch.

Every runner is a generator of results in the order items finish, and stops
submitting work once its ``stop()`` callable says so (``fail_fast``), after
draining what is already running.

* :func:`run_local` with one worker converts in this process; with more, it
  starts fresh Python processes that run :mod:`ckptconv.batching.worker` (never ``fork``, and never
  importing the caller's main module, see :mod:`ckptconv.batching.worker`). Imports
  are paid once per worker. A worker that dies (killed, out of memory) fails
  only the item it was converting; a fresh worker takes over. Workers exit
  when the batch process dies, even by SIGKILL.
* :func:`run_dask` submits the same jobs to a Dask ``distributed`` cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import io
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from queue import Queue
from typing import IO, Any, Callable

from ckptconv.batching.frames import read_frame, write_frame
from ckptconv.batching.report import CONVERTED, FAILED, SCHEDULER_TIMEOUT_S, SKIPPED, UNSAFE, ItemResult, OutputFile
from ckptconv.errors import (
    CkptconvError,
    LoadError,
    TrainingStateError,
    TransformError,
    UnsafeCheckpointError,
    interruption,
)
from ckptconv.options import ConversionOptions
from ckptconv.reading import read_policy
from ckptconv.reading.discovery import FILE, MODEL, Item, folder_above, member_paths, refusal
from ckptconv.runtime import cores as _cores
from ckptconv.writing import write_policy

__all__ = ["SCHEDULER_TIMEOUT_S", "Job", "check_scheduler", "check_sendable", "run_dask", "run_job", "run_local"]

Stop = Callable[[], bool]


@dataclass(frozen=True)
class Job:
    """One item to convert: all a worker needs, and small enough to pickle cheaply.

    Attributes:
        item: the input.
        output: the output's absolute path.
        output_name: the same, relative to the output folder.
        options: how to convert, as :func:`ckptconv.batch` got it (``to`` is the
            output's format name).
        replace: replace an existing output even without ``overwrite`` (``resume``:
            no record vouches for it, so an earlier run may have been killed
            after writing it but before recording it).
    """

    item: Item
    output: str
    output_name: str
    options: ConversionOptions
    replace: bool = False


# ---------------------------------------------------------------------------------------
# The worker: one item in, one result out, never an exception
# ---------------------------------------------------------------------------------------


def _failed(job: Job, error_type: str, message: str, trace: str = "", status: str = FAILED) -> ItemResult:
    item = job.item
    return ItemResult(
        source=item.name,
        status=status,
        kind=item.kind,
        output=job.output_name,
        source_size=item.size,
        source_mtime_ns=item.mtime_ns,
        source_sha256=_source_digest(job),
        format=job.options.to or "",
        error=message,
        error_type=error_type,
        traceback=trace,
    )


def _source_digest(job: Job) -> str | None:
    """The sha256 of an item that was not converted, as a converted one records it, so a manifest says which
    bytes failed (or were unsafe); None with checksums off, or where its files cannot be read. Hashing reads
    bytes and runs nothing; it is held to the source folder as the conversion is (no link out is followed)."""
    if not job.options.checksums:
        return None
    from ckptconv.writing.provenance import file_sha256, source_sha256

    try:
        with read_policy.confined(
            folder_above(job.item.path, job.item.name), output=folder_above(job.output, job.output_name)
        ):
            _check_still_readable(job)
            # A file's digest is its bytes', as a converted file's is (source_sha256 also asks what the file
            # is, which a broken one cannot say); a folder's needs its files named.
            digest = file_sha256(job.item.path) if job.item.kind == FILE else source_sha256(job.item.path)
            return digest or None
    except (CkptconvError, OSError, ValueError):
        return None


def _qualified(error: BaseException) -> str:
    kind = type(error)
    return f"{kind.__module__}.{kind.__qualname__}"


def run_job(job: Job) -> ItemResult:
    """Convert one item; failures, expected or not, come back as a failed result.

    Example:
        >>> options = ConversionOptions(to="safetensors")
        >>> run_job(Job(item, "/out/model.safetensors", "model.safetensors", options))  # doctest: +SKIP
        ItemResult(source='model.pt', status='converted', ...)
    """
    started = time.perf_counter()
    try:
        result = _convert(job)
    except Exception as error:
        interrupt = interruption(error)
        if interrupt is not None:  # raised while Ctrl-C or SIGTERM unwound the work: that is what happened
            raise interrupt from None
        if isinstance(error, TrainingStateError):
            # An optimizer.pt beside the model of a training run: nothing to convert, nothing wrong.
            result = dataclasses.replace(_failed(job, type(error).__name__, str(error)), status=SKIPPED)
        elif isinstance(error, UnsafeCheckpointError):
            # What scan calls unsafe: counted apart from failures, and the batch exits 4 as scan does.
            result = _failed(job, type(error).__name__, str(error), status=UNSAFE)
        elif isinstance(error, CkptconvError):
            result = _failed(job, type(error).__name__, str(error))
        else:  # a bug, or a hostile file finding one: record it, keep going
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
    size = mtime = 0
    for member in member_paths(item):  # shards in subfolders included
        info = os.stat(member)
        size += info.st_size
        mtime = max(mtime, info.st_mtime_ns)
    return size, mtime


def _check_still_readable(job: Job) -> None:
    """Refuse an item that became something discovery never takes (a link out of the source folder,
    a FIFO) between discovery and now."""
    reason = refusal(job.item, [folder_above(job.output, job.output_name)])
    if reason:
        raise LoadError(f"{job.item.name!r} is now {reason}", path=job.item.path)


def _convert(job: Job) -> ItemResult:
    """Convert one item; sharded checkpoints and DCP folders are one item each, never split. Every file
    read meanwhile must stay inside the source folder (:func:`ckptconv.reading.read_policy.confined`; the output
    folder's files apart): the check below is asked again at each open, so a file swapped for a link after
    it is not read either."""
    output_folder = folder_above(job.output, job.output_name)
    with read_policy.confined(folder_above(job.item.path, job.item.name), output=output_folder):
        return _convert_confined(job)


def _convert_confined(job: Job) -> ItemResult:
    from ckptconv.conversion import convert
    from ckptconv.writing.provenance import file_sha256, source_sha256

    item, options = job.item, job.options
    _check_still_readable(job)
    created = _prepare_folder(job)
    try:
        before = _snapshot(item) if os.path.exists(item.path) else None
        report = convert(item.path, job.output, options=options, overwrite=options.overwrite or job.replace)
    except BaseException:
        write_policy.remove_folders(created)  # the folders made for an output that was not written
        raise
    # The provenance hash convert() already took covers the source; hash only if it did not.
    source_sha = (report.source_sha256 or source_sha256(item.path)) if options.checksums else None
    after = _snapshot(item)
    # A model folder out is several files (weights, index, configs); any other output is one file.
    written = list(report.files) if item.kind == MODEL else [job.output]
    if before is None or after != before:
        for path in written:
            os.unlink(path)
        raise LoadError(
            f"{item.name!r} changed while it was being converted; run the batch again with --resume", path=item.path
        )
    outputs = tuple(
        OutputFile(
            job.output_name + os.path.relpath(path, job.output).replace(os.sep, "/")  # hf/ + model.safetensors
            if item.kind == MODEL
            else job.output_name,
            os.stat(path).st_size,
            file_sha256(path) if options.checksums else None,
        )
        for path in written
    )
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
        outputs=outputs,
        tensors=report.tensors,
        bytes=report.bytes,
        notes=report.notes,
    )


def _prepare_folder(job: Job) -> list[str]:
    """Create the output's folders inside DST (never through a link), and remove what an earlier,
    killed run left there half-written; return the folders created."""
    root = job.output
    for _ in job.output_name.split("/"):
        root = os.path.dirname(root)
    from ckptconv.writing.atomic import remove_abandoned

    folder = os.path.dirname(job.output)
    created = write_policy.make_folders(folder, root=root)
    if job.item.kind != MODEL:  # a model folder's writer removes its own abandoned files
        remove_abandoned(folder, os.path.basename(job.output))
    return created


# ---------------------------------------------------------------------------------------
# Local execution: this process, or a pool of worker processes
# ---------------------------------------------------------------------------------------


_DIED = "the worker process died while converting it ({how}); nothing was written for it"
_RESULTS = "ckptconv-results"


class _MainModuleObject(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _Pickler(pickle.Pickler):
    """Refuses objects of the script being run: workers never import ``__main__`` (see _worker.py)."""

    def persistent_id(self, obj: Any) -> None:
        kind = obj if isinstance(obj, type) or callable(obj) else type(obj)
        if getattr(kind, "__module__", None) == "__main__":
            raise _MainModuleObject(getattr(kind, "__qualname__", repr(kind)))


def check_sendable(options: Any) -> None:
    """Refuse, before anything starts, options that local worker processes cannot receive."""
    try:
        _Pickler(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(options)
    except _MainModuleObject as error:
        raise TransformError(
            f"{error.name} is defined in the script being run (__main__), which worker processes do not "
            "import; move it into a module the script imports, or convert with jobs=1"
        ) from None
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        raise TransformError(
            f"the options cannot be sent to worker processes ({error}); define transforms at the top level "
            "of a module, or convert with jobs=1"
        ) from None


class _Worker:
    """One :mod:`ckptconv.batching.worker` process and the jobs sent to it, in order."""

    def __init__(self, events: Queue[tuple[_Worker, Any]], cores: int) -> None:
        # This very ckptconv, first on the path: not one a folder named ckptconv in the current
        # folder would shadow it with (as `python -m` would put the current folder first).
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        start = f"import sys; sys.path[0] = {package_root!r}; from ckptconv.batching.worker import main; main()"
        # Its stderr, read only to say why it died; closed in close().
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the worker, not a block
        # The machine's cores are shared between the workers: none takes a second copying thread
        # (ckptconv.runtime.cores) from a core that another worker's conversion is using.
        environment = {**os.environ, _cores.CORES_VARIABLE: str(cores)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", start],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=environment,
        )
        self.pending: deque[tuple[int, Job]] = deque()
        self.ready = False
        stdin, stdout = self.process.stdin, self.process.stdout
        if stdin is None or stdout is None:  # cannot happen with PIPE; says so to the type checker
            raise RuntimeError("subprocess.PIPE gave no pipe")
        self.stdin: IO[bytes] = stdin
        self._events = events
        threading.Thread(target=self._read, args=(stdout,), name=_RESULTS, daemon=True).start()
        self._write(list(sys.path))

    def _write(self, value: Any) -> None:
        # If it died, its reader thread sees the end of its output and reports it.
        with contextlib.suppress(OSError):
            write_frame(self.stdin, value)

    def _read(self, stdout: IO[bytes]) -> None:
        try:
            while True:
                self._events.put((self, read_frame(stdout)))
        except (EOFError, OSError):
            self._events.put((self, None))

    def send(self, sequence: int, job: Job) -> None:
        self.pending.append((sequence, job))
        self._write((sequence, pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)))

    def why(self) -> str:
        """How the process ended, and the last line it wrote to stderr."""
        code = self.process.wait()
        if code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exit status {code}"
        self.log.seek(0)
        lines = [line.strip() for line in self.log.read().decode(errors="replace").splitlines() if line.strip()]
        return f"{how}: {lines[-1]}" if lines else how

    def close(self, wait: bool) -> None:
        with contextlib.suppress(OSError):
            self.stdin.close()  # the worker exits when its stdin closes, even mid-item
        try:
            self.process.wait(timeout=10 if wait else 1)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self.log.close()


def run_local(jobs: Sequence[Job], *, workers: int = 1, stop: Stop = lambda: False) -> Iterator[ItemResult]:
    """Convert jobs in this process (``workers=1``) or in worker processes.

    Workers are fresh Python processes running :mod:`ckptconv.batching.worker`: they never import the
    caller's main module, so a plain script, a notebook or an interactive
    session may call :func:`ckptconv.batch` with ``jobs > 1`` without an
    ``if __name__ == "__main__":`` guard. A worker that dies fails only the
    item it was converting; a fresh one takes over.

    Yields:
        One result per job, in the order they finish; fewer once ``stop()`` is true.

    Raises:
        TransformError: the transforms cannot be sent to worker processes (a
            lambda, or a class defined in the script being run).
        CkptconvError: a worker process cannot start (its reason is in the message).
    """
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            if stop():
                return
            yield run_job(job)
        return

    check_sendable(jobs[0].options)
    size = min(workers, len(jobs))
    # One queued job per worker besides the running one, so no worker idles while this process
    # records a result (an fsync). A worker answers in order, so the first pending job is the running one.
    window = 2
    queue = deque(enumerate(jobs))
    events: Queue[tuple[_Worker, Any]] = Queue()
    pool: list[_Worker] = []
    clean = False
    try:
        cores = max(_cores.usable() // size, 1)
        pool = [_Worker(events, cores) for _ in range(size)]
        while queue or any(worker.pending for worker in pool):
            if not stop():
                for worker in pool:
                    while worker.ready and queue and len(worker.pending) < window:
                        worker.send(*queue.popleft())
            elif not any(worker.pending for worker in pool):
                break
            worker, message = events.get()
            if message is None:  # it died (or could not start)
                reason = worker.why()
                if not worker.ready:
                    raise CkptconvError(
                        f"a batch worker process could not start ({sys.executable}: {reason}); "
                        "convert with jobs=1, or fix the environment"
                    )
                pool.remove(worker)
                worker.close(wait=False)
                if worker.pending:
                    _, job = worker.pending.popleft()
                    queue.extendleft(reversed(worker.pending))  # sent, never started
                    yield _failed(job, "WorkerDied", _DIED.format(how=reason))
                if queue and not stop():
                    pool.append(_Worker(events, cores))
            elif message[0] == "ready":
                worker.ready = True
            else:
                _, result, error = message
                _, job = worker.pending.popleft()  # a worker answers in the order it was sent jobs
                if result is None:
                    result = _failed(job, "WorkerError", f"a worker process cannot receive this item ({error})")
                yield result
        clean = True
    finally:
        # Interrupted (Ctrl-C, or the consumer gave up): do not wait for running items; their
        # workers exit when their stdin closes, and an unfinished output is only a .partial file.
        for worker in pool:
            worker.close(wait=clean)


# ---------------------------------------------------------------------------------------
# Dask
# ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """While Dask starts its local worker processes, hide the caller's main script from multiprocessing.

    Dask's nannies start workers with multiprocessing's ``spawn``, which imports the caller's
    ``__main__`` file in each (as ``__mp_main__``): a script that calls ``ckptconv.batch(...,
    executor="dask")`` without ``if __name__ == "__main__":`` would run again there and fail to
    start them. Without ``__file__`` (and with ``__spec__`` None), multiprocessing imports nothing
    of it, as for an interactive session. Jobs never refer to ``__main__``: run_job lives here.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved: dict[str, Any] = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _distributed() -> Any:
    try:
        # Typed as Any: distributed is an optional extra without complete annotations.
        return importlib.import_module("distributed")
    except ImportError:
        raise CkptconvError(
            "the dask executor needs the 'distributed' package; install it with: pip install 'ckptconv[dask]'"
        ) from None


# Before Python 3.11 asyncio's TimeoutError (which distributed raises) is not the built-in one.
_TIMEOUTS = (TimeoutError, asyncio.TimeoutError)


def _client(distributed: Any, address: str, timeout: float) -> Any:
    """A client of the scheduler at ``address`` once a worker has joined it, within ``timeout`` seconds each:
    a scheduler without workers would hold the tasks forever, printing nothing."""
    try:
        client = distributed.Client(address, set_as_default=False, timeout=f"{timeout}s")
    except (OSError, *_TIMEOUTS) as error:
        raise CkptconvError(f"cannot reach the Dask scheduler at {address!r} ({error}); check --scheduler") from None
    try:
        client.wait_for_workers(1, timeout=timeout)
    except (OSError, *_TIMEOUTS):
        client.close()
        raise CkptconvError(
            f"no Dask worker joined the scheduler at {address!r} within {timeout:g} s; start workers "
            f"(dask worker {address}) or pass a longer --scheduler-timeout"
        ) from None
    return client


def check_scheduler(scheduler: str, *, timeout: float = SCHEDULER_TIMEOUT_S) -> None:
    """Refuse, before anything is written, a scheduler that cannot be reached or that no worker joins within
    ``timeout`` seconds (:func:`run_dask` asks again when it starts: a worker may leave meanwhile).

    Raises:
        CkptconvError: ``distributed`` is not installed, the scheduler cannot be reached, or has no worker.
    """
    _client(_distributed(), scheduler, timeout).close()


def run_dask(
    jobs: Sequence[Job],
    *,
    scheduler: str | None = None,
    workers: int = 1,
    stop: Stop = lambda: False,
    timeout: float = SCHEDULER_TIMEOUT_S,
) -> Iterator[ItemResult]:
    """Convert jobs on a Dask ``distributed`` cluster.

    Args:
        jobs: what to convert. The workers must see the same paths (a shared
            file system) and have ckptconv installed.
        scheduler: the scheduler's address (``"tcp://host:8786"``); None starts a
            ``LocalCluster`` of ``workers`` processes on this machine.
        workers: processes of the local cluster (ignored with ``scheduler``).
        stop: once true, the remaining tasks are cancelled.
        timeout: seconds to wait for the scheduler to answer and for its first worker to join: a
            scheduler without workers would otherwise hold the tasks forever.

    Raises:
        CkptconvError: ``distributed`` is not installed, the scheduler cannot be reached, or no worker
            joined it within ``timeout`` seconds.
    """
    distributed = _distributed()
    cluster: Any = None
    if scheduler is None:
        with _main_module_hidden():
            cluster = distributed.LocalCluster(
                n_workers=max(1, workers),
                threads_per_worker=1,
                processes=True,
                host="127.0.0.1",
                dashboard_address=None,
            )
        address = cluster.scheduler_address
    else:
        address = scheduler
    try:
        client = _client(distributed, address, timeout)
    except CkptconvError:
        if cluster is not None:
            cluster.close()
        raise
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
