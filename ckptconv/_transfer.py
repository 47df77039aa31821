"""Move storage bytes from files into torch tensors, on the CPU or a GPU, with parallel readers.

Why: one thread copying from the page cache moves about 6 GB/s, while a
host-to-device copy from pinned memory runs at about 55 GB/s on an H200, so a
loader that reads with one thread is capped far below what the GPU takes.
Here every storage span is cut into pieces of :data:`PIECE_BYTES`, and
:func:`reader_threads` threads read pieces in any order:

* to the CPU, straight into the destination tensor (``preadv`` releases the
  GIL, so the memory copies from the page cache run on several cores);
* to a GPU, into the thread's own two pinned buffers, each piece then copied
  to the device on the thread's own CUDA stream while the thread reads the
  next one (a buffer is refilled only once its copy has finished, which a CUDA
  event tells). Host memory stays at ``2 * PIECE_BYTES`` per thread whatever
  the checkpoint's size.

Files that are not in the page cache (cold; :func:`resident_fraction` asks the
kernel with ``mincore``) are read with ``O_DIRECT`` into the pinned buffers,
which skips the page cache's extra copy; where ``O_DIRECT`` is refused
(tmpfs, some network filesystems) the ordinary reads are used.

Sources that must be read in order (compressed zip records) or that are not
plain file regions (DCP chunks, bytes in memory) are read by one thread each,
through the storage's own reader, still in parallel with everything else.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import mmap
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from . import read_policy
from .errors import LoadError, MalformedCheckpointError
from .tensor import FileRegion, Storage

if TYPE_CHECKING:
    import torch

__all__ = ["PIECE_BYTES", "Span", "read_spans", "reader_threads", "resident_fraction"]

#: Bytes each reader moves per step: a pinned staging buffer's size. 8 MiB pieces
#: keep 16 threads' staging at 256 MiB of host memory while each step is long
#: enough (over 1 ms) that per-piece costs (a syscall, a copy launch) stay small.
PIECE_BYTES = 8 << 20

# O_DIRECT needs offsets, lengths and buffer addresses aligned to the logical
# block size; 4096 covers every common device. A piece's payload leaves room
# for rounding its start down and its end up.
_ALIGN = 4096
_PAYLOAD = PIECE_BYTES - 2 * _ALIGN

#: When this fraction of a file or more is in the page cache, it is read through it.
WARM_FRACTION = 0.5

#: How files are read for GPU destinations: "auto" (``O_DIRECT`` for files mostly
#: not in the page cache), "buffered" or "direct". For benchmarks and tests.
direct_io = "auto"


def reader_threads() -> int:
    """Reader threads: one per core, at least 2 and at most 16 (page-cache copies stop scaling near 16)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 2
    return max(2, min(16, cores))


@dataclasses.dataclass(frozen=True)
class Span:
    """Bytes ``[start, stop)`` of ``storage``, to land in ``out`` (a uint8 tensor of ``stop - start`` bytes)."""

    storage: Storage
    start: int
    stop: int
    out: torch.Tensor


@dataclasses.dataclass(frozen=True)
class _Task:
    """A piece to read: ``count`` bytes of ``span`` from ``position`` (storage numbering), or the whole
    span in order when ``count`` is None."""

    span: Span
    position: int
    count: int | None


def resident_fraction(path: str) -> float:
    """The fraction of ``path``'s pages in the page cache (1.0 when it cannot be told)."""
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:  # pragma: no cover - no C library to ask
        return 1.0
    libc = ctypes.CDLL(libc_name, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    try:
        fd = read_policy.open_descriptor(path)  # regular files only (ckptconv.read_policy)
    except (OSError, LoadError):
        return 1.0
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            return 1.0
        try:
            vector = (ctypes.c_ubyte * pages)()
            if libc.mincore(address, size, vector) != 0:
                return 1.0
            import numpy as np

            resident = int(np.count_nonzero(np.frombuffer(memoryview(vector).cast("B"), dtype=np.uint8) & 1))
            return resident / pages
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def _tasks(spans: Sequence[Span]) -> Iterator[_Task]:
    """Pieces of file regions, and whole spans of every other source; big pieces first in file order."""
    for span in spans:
        if span.stop <= span.start:
            continue
        if isinstance(span.storage.source, FileRegion) and span.storage.byteorder == "little":
            for position in range(span.start, span.stop, _PAYLOAD):
                yield _Task(span, position, min(_PAYLOAD, span.stop - position))
        else:
            yield _Task(span, span.start, None)


class _DirectFiles:
    """``O_DIRECT`` descriptors of the cold files, opened on first use; None where refused."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.fds: dict[str, int | None] = {}
        self.lock = threading.Lock()

    def fd(self, path: str) -> int | None:
        with self.lock:
            if path not in self.fds:
                self.fds[path] = self._open(path)
            return self.fds[path]

    def _open(self, path: str) -> int | None:
        if self.mode == "buffered" or not hasattr(os, "O_DIRECT"):
            return None
        if self.mode == "auto" and resident_fraction(path) >= WARM_FRACTION:
            return None
        try:
            return read_policy.open_descriptor(path, flags=os.O_DIRECT)
        except (OSError, LoadError):
            return None

    def close(self) -> None:
        for fd in self.fds.values():
            if fd is not None:
                os.close(fd)


def _read_direct(fd: int, path: str, offset: int, count: int, buffer: memoryview) -> int:
    """Read ``count`` bytes at file ``offset`` with aligned ``O_DIRECT`` reads into ``buffer``.

    Returns where the requested bytes start in ``buffer``.
    """
    first = offset - offset % _ALIGN
    last = -(-(offset + count) // _ALIGN) * _ALIGN
    need = offset + count - first
    filled = 0
    while filled < need:
        got = os.preadv(fd, [buffer[filled : last - first]], first + filled)
        if got <= 0:
            raise MalformedCheckpointError(
                f"{path!r} is truncated: {need - filled} bytes missing at offset {first + filled}; "
                "the file is damaged or still being written",
                path=path,
            )
        filled += got
    return offset - first


class _Worker:
    """One reader thread's state: its pinned buffers, their pending copies, its CUDA streams."""

    def __init__(self, direct: _DirectFiles, callers: dict[Any, Any]) -> None:
        self.direct = direct
        self.callers = callers
        self.buffers: list[torch.Tensor] = []
        self.events: list[Any] = [None, None]
        self.turn = 0
        self.streams: dict[Any, Any] = {}

    def run(self, task: _Task) -> None:
        import torch

        span = task.span
        if span.out.device.type == "cpu":
            out = span.out.numpy()
            if task.count is None:
                span.storage.read_into(span.start, out.data)
            else:
                span.storage.read_into(task.position, out[task.position - span.start :][: task.count].data)
            return
        if not self.buffers:
            self.buffers = [torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        if task.count is None:
            with span.storage.reader() as read_into:
                for position in range(span.start, span.stop, PIECE_BYTES):
                    count = min(PIECE_BYTES, span.stop - position)
                    slot = self._free_slot()
                    read_into(position, self.buffers[slot][:count].numpy().data)
                    self._upload(span, position, slot, 0, count)
            return
        slot = self._free_slot()
        source = span.storage.source
        assert isinstance(source, FileRegion)
        fd = self.direct.fd(source.path)
        if fd is not None:
            view = self.buffers[slot].numpy().data
            skip = _read_direct(fd, source.path, source.offset + task.position, task.count, view)
        else:
            skip = 0
            span.storage.read_into(task.position, self.buffers[slot][: task.count].numpy().data)
        self._upload(span, task.position, slot, skip, task.count)

    def _free_slot(self) -> int:
        """The buffer to fill next, once the device has finished copying out of it."""
        slot = self.turn
        self.turn ^= 1
        event = self.events[slot]
        if event is not None:
            event.synchronize()  # releases the GIL
            self.events[slot] = None
        return slot

    def _upload(self, span: Span, position: int, slot: int, skip: int, count: int) -> None:
        import torch

        device = span.out.device
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            # After whatever the caller queued before (the destinations were allocated on its stream).
            stream.wait_stream(self.callers[device])
        with torch.cuda.stream(stream):
            destination = span.out[position - span.start : position - span.start + count]
            destination.copy_(self.buffers[slot][skip : skip + count], non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        self.events[slot] = event

    def finish(self) -> None:
        for stream in self.streams.values():
            stream.synchronize()


def read_spans(spans: Sequence[Span], *, threads: int | None = None) -> None:
    """Fill every span's ``out`` tensor with its bytes, using parallel reader threads.

    Returns when every byte is on its device (all copies have finished).

    Raises:
        MalformedCheckpointError: a file is shorter than its header says (the
            first error any reader met; the others stop at their next piece).
    """
    tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
    count = 0
    for task in _tasks(spans):
        tasks.put(task)
        count += 1
    if count == 0:
        return
    threads = max(1, min(threads or reader_threads(), count))
    direct = _DirectFiles(direct_io)
    callers: dict[Any, Any] = {}
    for span in spans:
        if span.out.device.type == "cuda" and span.out.device not in callers:
            import torch

            callers[span.out.device] = torch.cuda.current_stream(span.out.device)
    errors: list[BaseException] = []
    failed = threading.Event()

    def work() -> None:
        worker = _Worker(direct, callers)
        try:
            while not failed.is_set():
                task = tasks.get()
                if task is None:
                    return
                worker.run(task)
        except BaseException as error:
            errors.append(error)
            failed.set()
        finally:
            with contextlib.suppress(BaseException):
                worker.finish()

    for _ in range(threads):
        tasks.put(None)
    pool = [threading.Thread(target=work, name=f"ckptconv-reader-{i}", daemon=True) for i in range(threads)]
    try:
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
    finally:
        direct.close()
    if errors:
        raise errors[0]
