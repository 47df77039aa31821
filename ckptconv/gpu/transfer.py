"""Move storage bytes from files into torch tensors, on the CPU or a GPU, with parallel readers.

Why: one thread copying from the page cache moves about 6 GB/s, while a
host-to-device copy from pinned memory runs at about 55 GB/s on an H200, so a
loader that reads with one thread is capped far below what the GPU takes.
Here every storage span is cut into pieces of at most :data:`PIECE_BYTES`
(:func:`plan_pieces`), and :func:`reader_threads` threads read pieces in any
order:

* to the CPU, straight into the destination tensor (``preadv`` releases the
  GIL, so the memory copies from the page cache run on several cores);
* to a GPU, into the thread's own :data:`DEPTH` pinned buffer (views of one area registered
  with CUDA, kept for the next load), each piece then copied to the
  device on the thread's own CUDA stream (a buffer is refilled only once its copy
  has finished, which a CUDA event tells); the copies overlap the other readers'
  reads. Host memory stays at ``threads * DEPTH * PIECE_BYTES`` whatever the
  checkpoint's size.

When the caller asks (``crcs``), the CRC-32 of every whole zip record read is
taken without a second read of the file: on a GPU, by one kernel over the
records once their copies are done (:mod:`ckptconv.gpu.crc`; 8 GiB in about
6 ms on an H200, where the readers spent 42-55 ms each checksumming their
pinned buffers); elsewhere, by the readers while a piece is in memory
(:func:`ckptconv.reading.integrity.crc32_combine` joins the pieces').

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
import dataclasses
import io
import os
import queue
import threading
from collections.abc import Container, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ckptconv.errors import LoadError, MalformedCheckpointError
from ckptconv.gpu import crc as _gpu_crc
from ckptconv.gpu import cuda_driver as _cuda_driver
from ckptconv.gpu import host_staging as _host_staging
from ckptconv.gpu.page_cache import resident_fraction
from ckptconv.reading import read_policy
from ckptconv.reading.checksums import crc32, crc32_combine
from ckptconv.reading.sources import FileRegion, read_exactly_into
from ckptconv.runtime import cores as _cores
from ckptconv.values.tensor import Storage

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEPTH",
    "PIECE_BYTES",
    "Span",
    "plan_pieces",
    "read_spans",
    "reader_threads",
    "resident_fraction",
]

#: Bytes each reader moves per step: a pinned staging buffer's size.
PIECE_BYTES = 8 << 20

#: Pinned buffers per reader thread. One: a reader waits for its own copy before it reads again,
#: and more readers keep the copy engine busy. Pinning is the largest first-use cost of a GPU load
#: (about 5 ms per 8 MiB buffer on an H200 host, during which the CUDA driver makes the readers'
#: copies and allocations wait), so buffers are worth more as readers than as depth: in fresh
#: processes on one H200, 8 GiB loads took 28.7 GB/s with 12 readers x 1 buffer against 24.5
#: with 8 x 2 and 22.9 with 16 x 1 (safetensors), and 19.4 with 16 x 1 against 16.7 with 16 x 2
#: (``.pt`` with CRC-32 checks); medians of 5 alternating rounds, round 4 of
#: bench/results/bench_gpu_load_h200.md. Host memory pinned: 96 MiB (was 128, and 256 for ``.pt``).
DEPTH = 1

#: The most reader threads of CPU loads, whatever the core count.
MAX_THREADS = 16

#: The most reader threads of GPU loads, whether they take CRC-32s or not: more of them contend
#: and each pins its staging; 12 with one buffer each measured best (see :data:`DEPTH`), also for
#: ``.pt`` with CRC-32 checks (25.5 GB/s against 23.3 with 16 readers and 20.1 with main's 16 x 2,
#: medians of 3 alternating rounds on one H200, round 4 of bench/results/bench_gpu_load_h200.md).
MAX_GPU_THREADS = 12

# O_DIRECT needs offsets, lengths and buffer addresses aligned to the logical
# block size; 4096 covers every common device. A piece's payload leaves room
# for rounding its start down and its end up.
_ALIGN = 4096

#: Take the CRC-32 of whole zip records loaded to a GPU on that GPU, after their copies
#: (:mod:`ckptconv.gpu.crc`), rather than on the readers' threads. For benchmarks and tests.
gpu_crc = True

#: Copy the readers' pieces to a GPU through the CUDA driver (:mod:`ckptconv.gpu.cuda_driver`), where
#: it can be had, rather than through torch's ``Tensor.copy_``. For benchmarks and tests.
driver_copies = True

#: Stage the readers' pieces in one area registered with CUDA (:mod:`ckptconv.gpu.host_staging`), where it
#: can be had, rather than in torch's pinned buffers made one by one. For benchmarks and tests.
registered_staging = True

#: When this fraction of a file or more is in the page cache, it is read through it.
WARM_FRACTION = 0.5

#: How files are read for GPU destinations: "auto" (``O_DIRECT`` for files mostly
#: not in the page cache), "buffered" or "direct". For benchmarks and tests.
direct_io = "auto"


def reader_threads(*, gpu: bool = False) -> int:
    """Reader threads: one per core, at least 2 and at most :data:`MAX_THREADS`, or at most
    :data:`MAX_GPU_THREADS` for loads to a GPU (``gpu``)."""
    return max(2, min(MAX_GPU_THREADS if gpu else MAX_THREADS, _cores.usable()))


def _payload() -> int:
    """The most bytes of a piece: a staging buffer less room to align an ``O_DIRECT`` read at both ends."""
    return PIECE_BYTES - 2 * _ALIGN


def plan_pieces(start: int, stop: int, payload: int) -> list[tuple[int, int]]:
    """``(position, count)`` pieces covering ``[start, stop)`` once, in order, each at most ``payload`` bytes.

    As few pieces as ``payload`` allows, of about equal size (a multiple of
    4096 bytes but the last), so no piece is a tiny remainder.
    """
    length = stop - start
    if length <= 0:
        return []
    count = -(-length // payload)
    size = -(-length // count)
    size = min(payload, -(-size // _ALIGN) * _ALIGN) if count > 1 else length
    return [(position, min(size, stop - position)) for position in range(start, stop, size)]


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
    span in order when ``count`` is None; ``crc`` when its CRC-32 is wanted."""

    span: Span
    position: int
    count: int | None
    crc: bool = False


def _wants_crc(span: Span) -> bool:
    """True when the span is a whole zip record read in pieces, whose CRC-32 the archive records."""
    source = span.storage.source
    return (
        isinstance(source, FileRegion)
        and source.crc32 is not None
        and span.storage.byteorder == "little"
        and span.start == 0
        and span.stop == span.storage.nbytes
    )


def _tasks(spans: Sequence[Span], crcs: bool, on_gpu: Container[int] = ()) -> Iterator[_Task]:
    """Pieces of file regions, and whole spans of every other source, in file order; the CRC-32s of
    the spans numbered in ``on_gpu`` are left to the GPU (not taken by the readers)."""
    payload = _payload()
    for number, span in enumerate(spans):
        if span.stop <= span.start:
            continue
        if isinstance(span.storage.source, FileRegion) and span.storage.byteorder == "little":
            crc = crcs and _wants_crc(span) and number not in on_gpu
            for position, count in plan_pieces(span.start, span.stop, payload):
                yield _Task(span, position, count, crc)
        else:
            yield _Task(span, span.start, None)


class _Files:
    """Descriptors of the files read, opened once and shared by the readers: buffered ones, and
    ``O_DIRECT`` ones for cold files where the mode allows (None where refused)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.buffered: dict[str, io.BufferedReader] = {}
        self.direct: dict[str, int | None] = {}
        self.lock = threading.Lock()

    def fd(self, path: str) -> int:
        with self.lock:
            if path not in self.buffered:
                self.buffered[path] = read_policy.open_file(path)
            return self.buffered[path].fileno()

    def direct_fd(self, path: str) -> int | None:
        with self.lock:
            if path not in self.direct:
                self.direct[path] = self._open_direct(path)
            return self.direct[path]

    def _open_direct(self, path: str) -> int | None:
        if self.mode == "buffered" or not hasattr(os, "O_DIRECT"):
            return None
        if self.mode == "auto" and resident_fraction(path) >= WARM_FRACTION:
            return None
        try:
            return read_policy.open_descriptor(path, flags=os.O_DIRECT)
        except (OSError, LoadError):
            return None

    def close(self) -> None:
        for file in self.buffered.values():
            file.close()
        for fd in self.direct.values():
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


def _staging(nbytes: int) -> torch.Tensor:
    """One pinned host buffer of ``nbytes`` (PyTorch's host allocator keeps it for the next load)."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class _Pinned:
    """The readers' pinned buffers: views of one registered area (:mod:`ckptconv.gpu.host_staging`), all
    ready at once; or, where CUDA refuses to register one, torch's pinned buffers made one by one on a
    thread of their own while the readers read.

    torch pins at about 2 GB/s (0.13 s for 256 MiB, measured on an H200 host), a
    sixth of a whole 8 GiB load; made up front it would delay every first read.
    There a reader starts once it holds one buffer and takes more as they come,
    up to :data:`DEPTH`.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self.ready: queue.SimpleQueue[torch.Tensor | None] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.area = _host_staging.take(count * PIECE_BYTES) if registered_staging else None
        if self.area is not None:  # every buffer at once, from one registration (see host_staging)
            for buffer in [*self.area.buffers(count, PIECE_BYTES), *[None] * count]:  # None: no reader waits
                self.ready.put(buffer)
            self.thread: threading.Thread | None = None
            return
        self.thread = threading.Thread(target=self._make, name="ckptconv-pinning", daemon=True)
        self.thread.start()

    def _make(self) -> None:
        try:
            for _ in range(self.count):
                if self.done.is_set():
                    break
                self.ready.put(_staging(PIECE_BYTES))
        except BaseException as error:
            self.error = error
        finally:
            for _ in range(2 * self.count):  # wakes every reader still waiting
                self.ready.put(None)

    def first(self) -> torch.Tensor:
        buffer = self.ready.get()
        if buffer is None:
            raise self.error or RuntimeError("no pinned staging buffer could be made")
        return buffer

    def more(self) -> torch.Tensor | None:
        with contextlib.suppress(queue.Empty):
            return self.ready.get_nowait()
        return None

    def close(self, *, reusable: bool = True) -> None:
        """Once every reader is done with its buffers; not ``reusable`` where some may not be (interrupted)."""
        self.done.set()
        if self.thread is not None:
            self.thread.join()
        if self.area is not None and reusable:
            _host_staging.give_back(self.area)


@dataclasses.dataclass
class _Shared:
    """What the readers share: the files, the callers' streams, the pinned staging, the pieces' CRCs."""

    files: _Files
    callers: dict[Any, Any]
    pinned: _Pinned | None
    crcs: dict[Storage, list[tuple[int, int, int]]]


class _Worker:
    """One reader thread's state: its pinned buffers, their pending copies, its CUDA streams."""

    def __init__(self, shared: _Shared, index: int) -> None:
        self.shared = shared
        self.index = index
        self.buffers: list[torch.Tensor] = []
        self.views: list[memoryview] = []
        self.events: list[Any] = []
        self.turn = 0
        self.wants_more = True
        self.streams: dict[Any, Any] = {}
        self.copiers: dict[Any, _cuda_driver.DeviceCopier | None] = {}
        self.addresses: list[int] = []

    def run(self, task: _Task) -> None:
        span = task.span
        if span.out.device.type == "cpu":
            self._run_cpu(task)
            return
        self._take_buffers()
        if task.count is None:
            with span.storage.reader() as read_into:
                for position in range(span.start, span.stop, PIECE_BYTES):
                    count = min(PIECE_BYTES, span.stop - position)
                    slot = self._free_slot()
                    read_into(position, self.views[slot][:count])
                    self._upload(span, position, slot, 0, count)
            return
        slot = self._free_slot()
        source = span.storage.source
        assert isinstance(source, FileRegion)  # _tasks cuts file regions only
        view = self.views[slot]
        fd = self.shared.files.direct_fd(source.path)
        if fd is not None:
            skip = _read_direct(fd, source.path, source.offset + task.position, task.count, view)
        else:
            skip = 0
            self._check(span, task.position, task.count)
            read_exactly_into(
                self.shared.files.fd(source.path), source.offset + task.position, view[: task.count], source.path
            )
        self._upload(span, task.position, slot, skip, task.count)
        if task.crc:  # while the copy runs: both only read the buffer
            self._record_crc(task, view[skip : skip + task.count])

    def _run_cpu(self, task: _Task) -> None:
        span = task.span
        out = span.out.numpy()
        if task.count is None:
            span.storage.read_into(span.start, out.data)
            return
        source = span.storage.source
        assert isinstance(source, FileRegion)  # _tasks cuts file regions only
        self._check(span, task.position, task.count)
        piece = out[task.position - span.start :][: task.count].data
        read_exactly_into(self.shared.files.fd(source.path), source.offset + task.position, piece, source.path)
        if task.crc:
            self._record_crc(task, piece)

    def _take_buffers(self) -> None:
        """One pinned buffer to start with (waiting for it), then more as they are made, up to DEPTH."""
        pinned = self.shared.pinned
        assert pinned is not None  # read_spans makes it when any span is on a GPU
        while self.wants_more and len(self.buffers) < DEPTH:
            buffer = pinned.first() if not self.buffers else pinned.more()
            if buffer is None:
                self.wants_more = False
                return
            self.buffers.append(buffer)
            self.addresses.append(buffer.data_ptr())
            self.views.append(buffer.numpy().data)
            self.events.append(None)
        self.wants_more = len(self.buffers) < DEPTH

    @staticmethod
    def _check(span: Span, position: int, count: int) -> None:
        if position < 0 or position + count > span.storage.nbytes:  # pragma: no cover - spans come from refs
            raise ValueError(f"byte range {position}+{count} outside storage of {span.storage.nbytes} bytes")

    def _record_crc(self, task: _Task, data: memoryview) -> None:
        assert task.count is not None
        # list.append is atomic; read_spans joins the pieces once every reader is done.
        self.shared.crcs.setdefault(task.span.storage, []).append((task.position, task.count, crc32(data)))

    def _free_slot(self) -> int:
        """The buffer to fill next, once the device has finished copying out of it."""
        slot = self.turn % len(self.buffers)
        self.turn = slot + 1
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
            stream.wait_stream(self.shared.callers[device])
            # This reader thread's current stream on that device from now on (PyTorch keeps
            # current streams per thread), so no stream context is entered per piece.
            torch.cuda.set_stream(stream)
            self.copiers[device] = self._copier(device, stream)
        offset = position - span.start
        copier = self.copiers[device]
        if copier is not None and span.out.is_contiguous():
            # Raw addresses: a piece outside either tensor would write where nothing checks it.
            outside = offset < 0 or offset + count > span.out.numel() or skip + count > self.buffers[slot].numel()
            if outside:  # pragma: no cover - pieces come from the spans
                raise ValueError(f"copy of {count} bytes at {offset} outside its destination or staging buffer")
            self.events[slot] = copier.copy(span.out.data_ptr() + offset, self.addresses[slot] + skip, count, slot)
            return
        destination = span.out[offset : offset + count]
        destination.copy_(self.buffers[slot][skip : skip + count], non_blocking=True)
        # Any: torch 2.4's stubs leave Event.record untyped (mypy --strict: no-untyped-call).
        event: Any = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        self.events[slot] = event

    def _copier(self, device: Any, stream: Any) -> _cuda_driver.DeviceCopier | None:
        """This reader's driver copier for ``device`` (:mod:`ckptconv.gpu.cuda_driver`), or None: copy through torch."""
        import torch

        if not driver_copies or torch.version.hip or not torch.version.cuda:  # ROCm's streams are HIP's
            return None
        try:
            copier = _cuda_driver.DeviceCopier(device.index, stream.cuda_stream, DEPTH)
        except OSError:
            return None
        return copier

    def finish(self) -> None:
        try:
            for stream in self.streams.values():
                stream.synchronize()
        finally:
            for copier in self.copiers.values():
                if copier is not None:
                    copier.close()


def _join_crcs(pieces: list[tuple[int, int, int]], nbytes: int) -> int | None:
    """The CRC-32 of ``nbytes`` bytes from its pieces' ``(position, count, crc)``; None unless they cover them once."""
    crc = 0
    end = 0
    for position, count, piece in sorted(pieces):
        if position != end:
            return None
        crc = crc32_combine(crc, piece, count)
        end += count
    return crc if end == nbytes else None


def read_spans(spans: Sequence[Span], *, threads: int | None = None, crcs: dict[Storage, int] | None = None) -> None:
    """Fill every span's ``out`` tensor with its bytes, using parallel reader threads.

    Returns when every byte is on its device (all copies have finished).

    Args:
        spans: what to read, and where to.
        threads: reader threads; :func:`reader_threads` when None.
        crcs: when given, receives the CRC-32 of every whole zip record read in
            pieces (``FileRegion`` with a recorded ``crc32``), keyed by storage,
            taken from the bytes as they were read, or on the GPU from the bytes
            that landed there. Records not in it (where the GPU's kernel could
            not be had) were not checked here.

    Raises:
        MalformedCheckpointError: a file is shorter than its header says (the
            first error any reader met; the others stop at their next piece).
    """
    on_gpu = _gpu_checked(spans) if crcs is not None else {}
    compilers = [
        threading.Thread(target=_gpu_crc.kernel, args=(index,), name="ckptconv-crc-kernel", daemon=True)
        for index in on_gpu
    ]
    for compiler in compilers:  # NVRTC compiles while the readers read (it releases the GIL)
        compiler.start()
    tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
    count = 0
    for task in _tasks(spans, crcs is not None, {number for numbers in on_gpu.values() for number in numbers}):
        tasks.put(task)
        count += 1
    if count == 0:
        return
    callers: dict[Any, Any] = {}
    for span in spans:
        if span.out.device.type == "cuda" and span.out.device not in callers:
            import torch

            callers[span.out.device] = torch.cuda.current_stream(span.out.device)
    threads = max(1, min(threads or reader_threads(gpu=bool(callers)), count))
    shared = _Shared(_Files(direct_io), callers, _Pinned(threads * DEPTH) if callers else None, {})
    errors: list[BaseException] = []
    failed = threading.Event()
    finished: list[int] = []  # readers done with their buffers (is_alive() lies after an interrupted join)

    def work(index: int) -> None:
        worker = _Worker(shared, index)
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
            finished.append(index)

    for _ in range(threads):
        tasks.put(None)
    pool = [threading.Thread(target=work, args=(i,), name=f"ckptconv-reader-{i}", daemon=True) for i in range(threads)]
    try:
        for thread in pool:
            thread.start()
        for thread in pool:
            _cores.join(thread)  # in turns: a Ctrl-C that lands just before an unbounded wait would be missed
    finally:
        # Interrupted (Ctrl-C in a join): readers still at work stop at their next piece; their area is not kept.
        at_work = len(finished) < len(pool)
        if at_work:
            failed.set()
        if shared.pinned is not None:
            shared.pinned.close(reusable=not at_work)
        shared.files.close()
    if errors:
        raise errors[0]
    if crcs is not None:
        for storage, pieces in shared.crcs.items():
            joined = _join_crcs(pieces, storage.nbytes)
            if joined is not None:
                crcs[storage] = joined
        for compiler in compilers:
            compiler.join()
        for index, numbers in on_gpu.items():
            kernel = _gpu_crc.kernel(index)
            if kernel is None:  # check_record_crcs reads these records again
                continue
            outs = [spans[number] for number in numbers]
            try:
                found = _gpu_crc.record_crcs([span.out for span in outs], kernel)
            except RuntimeError:  # the launch was refused: check_record_crcs reads these records again
                continue
            for span, crc in zip(outs, found):
                crcs[span.storage] = crc


def _gpu_checked(spans: Sequence[Span]) -> dict[int, list[int]]:
    """The spans whose CRC-32 the GPU takes (whole records, where its kernel works), numbered, by device."""
    found: dict[int, list[int]] = {}
    if not gpu_crc:
        return found
    for number, span in enumerate(spans):
        device = span.out.device
        if device.type == "cuda" and span.stop > span.start and _wants_crc(span):
            index = device.index if device.index is not None else _current_device()
            if not _gpu_crc.known_unavailable(index):
                found.setdefault(index, []).append(number)
    return found


def _current_device() -> int:
    import torch

    return int(torch.cuda.current_device())
