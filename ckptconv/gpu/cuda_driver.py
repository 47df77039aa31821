"""The GPU readers' host-to-device copies, made through the CUDA driver with ctypes.

Why: each reader of a GPU load copies its pinned buffer to the device once per 8 MiB piece. Through
torch that is two tensor slices, ``Tensor.copy_(non_blocking=True)`` through the dispatcher, a new
``torch.cuda.Event`` and its record: about 50 µs of Python holding the GIL per piece, which twelve
readers take in turn. Through the driver it is ``cuMemcpyHtoDAsync`` and ``cuEventRecord``, ctypes
calls that release the GIL. On one H200 (bench/results/bench_gpu_load_h200.md, round 6) a reader's
upload time fell from 47-80 ms to 9-19 ms per 8 GiB load, and fresh-process loads of 8 GiB rose from
26.4 to 32.3 GB/s (safetensors) and from 25.3 to 31.6 GB/s (``.pt`` with its CRC-32s), medians of 5
alternating rounds.

The copies run on the reader's own torch stream (its handle), so torch's ordering still holds: the
stream waits for the caller's, and the load waits for the stream. Each call runs with the device's
primary context (the one torch uses) pushed on the calling thread, whatever device is current there.
Where the driver cannot be had (no ``libcuda.so.1``: ROCm builds, a CPU-only machine) or refuses a
call while a reader is set up, that reader copies through torch as before.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from ckptconv.errors import LoadError

__all__ = ["DeviceCopier", "driver"]

_DISABLE_TIMING = 0x2  # CU_EVENT_DISABLE_TIMING: events for ordering only are cheaper


@functools.cache
def driver() -> Any | None:
    """The CUDA driver library with the argument types of the calls made here, or None."""
    try:
        library = ctypes.CDLL("libcuda.so.1")
        entries = {
            "cuDeviceGet": [ctypes.c_void_p, ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.c_void_p, ctypes.c_int],
            "cuDevicePrimaryCtxRelease_v2": [ctypes.c_int],
            "cuCtxPushCurrent_v2": [ctypes.c_void_p],
            "cuCtxPopCurrent_v2": [ctypes.c_void_p],
            "cuEventCreate": [ctypes.c_void_p, ctypes.c_uint],
            "cuEventDestroy_v2": [ctypes.c_void_p],
            "cuEventRecord": [ctypes.c_void_p, ctypes.c_void_p],
            "cuEventSynchronize": [ctypes.c_void_p],
            "cuMemcpyHtoDAsync_v2": [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p],
            "cuGetErrorName": [ctypes.c_int, ctypes.c_void_p],
        }
        for name, argtypes in entries.items():
            function = getattr(library, name)  # AttributeError: a driver without it
            function.argtypes = argtypes
            function.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return library


def _error_name(library: Any, code: int) -> str:
    name = ctypes.c_char_p()
    if library.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode("ascii", "replace")
    return str(code)


class _SlotEvent:
    """The event of one staging buffer: ``synchronize`` waits for the buffer's last copy to finish."""

    __slots__ = ("copier", "handle")

    def __init__(self, copier: DeviceCopier, handle: ctypes.c_void_p) -> None:
        self.copier = copier
        self.handle = handle

    def synchronize(self) -> None:
        self.copier.wait(self.handle)


class DeviceCopier:
    """Copies from pinned host memory to one device on one stream, with one reusable event per staging buffer.

    Args:
        device: the CUDA device's index (as torch numbers it).
        stream: the stream's handle (``torch.cuda.Stream.cuda_stream``).
        slots: staging buffers, each with its own event.

    Raises:
        OSError: the driver cannot be had or refuses to set up (the caller copies through torch).
    """

    def __init__(self, device: int, stream: int, slots: int) -> None:
        library = driver()
        if library is None:
            raise OSError("no CUDA driver library")
        self.library = library
        self.device = device
        self.stream = ctypes.c_void_p(stream)
        handle = ctypes.c_int()
        context = ctypes.c_void_p()
        if library.cuDeviceGet(ctypes.byref(handle), device) or library.cuDevicePrimaryCtxRetain(
            ctypes.byref(context), handle
        ):
            raise OSError(f"the CUDA driver cannot open device {device}")
        self.handle = handle.value
        self.context = context
        self.events: list[_SlotEvent] = []
        try:
            self._push()
            try:
                for _ in range(slots):
                    event = ctypes.c_void_p()
                    if library.cuEventCreate(ctypes.byref(event), _DISABLE_TIMING):
                        raise OSError("the CUDA driver cannot make an event")
                    self.events.append(_SlotEvent(self, event))
            finally:
                self._pop()
        except LoadError as error:  # a context or event refused: this reader copies through torch
            self.close()
            raise OSError(str(error)) from error
        except BaseException:
            self.close()
            raise

    def _push(self) -> None:
        self.check(self.library.cuCtxPushCurrent_v2(self.context), "making the device current")

    def _pop(self) -> None:
        self.library.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise LoadError(f"{what} on cuda:{self.device} failed: CUDA error {_error_name(self.library, code)}")

    def copy(self, destination: int, source: int, count: int, slot: int) -> _SlotEvent:
        """Queue ``count`` bytes from host address ``source`` to device address ``destination``; the
        returned event is recorded after the copy."""
        event = self.events[slot]
        self._push()
        try:
            self.check(
                self.library.cuMemcpyHtoDAsync_v2(destination, source, count, self.stream), "a host-to-device copy"
            )
            self.check(self.library.cuEventRecord(event.handle, self.stream), "recording a copy's event")
        finally:
            self._pop()
        return event

    def wait(self, handle: ctypes.c_void_p) -> None:
        """Block (without the GIL) until the work recorded in event ``handle`` has finished."""
        self._push()
        try:
            self.check(self.library.cuEventSynchronize(handle), "waiting for a copy")
        finally:
            self._pop()

    def close(self) -> None:
        """Destroy the events (after the stream has finished) and let go of the context."""
        if self.events:
            self._push()
            try:
                for event in self.events:
                    self.library.cuEventDestroy_v2(event.handle)
            finally:
                self._pop()
        self.events = []
        if self.context:
            self.library.cuDevicePrimaryCtxRelease_v2(self.handle)
            self.context = ctypes.c_void_p()
