"""Pinned host memory for the GPU readers' staging buffers, registered with CUDA in one piece.

Why: torch's pinned allocations (``cudaHostAlloc``) pin at about 2 GB/s. A fresh process's twelve
8 MiB staging buffers took 43-56 ms on an H200 host, a fifth of an 8 GiB load, and the readers
waited for them. The same 96 MiB as one anonymous mapping with huge pages asked (``madvise``),
registered with ``cudaHostRegister``, took 7 ms (round 8 of bench/results/bench_gpu_load_h200.md).

The area is kept for the process's next loads, as torch's host allocator keeps its pinned blocks;
a load that finds it in use by another registers an area of its own and frees it after.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Area", "give_back", "take"]

# cudaHostRegisterPortable: pinned for every device's context, so one area serves loads to any GPU.
_PORTABLE = 1

_lock = threading.Lock()
_idle: list[Area] = []


class Area:
    """``nbytes`` of page-aligned host memory, pinned by CUDA, as a uint8 tensor."""

    def __init__(self, nbytes: int) -> None:
        import torch

        self.nbytes = nbytes
        self._mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # fewer pages to pin; the kernel may decline
            with contextlib.suppress(OSError):
                self._mapping.madvise(mmap.MADV_HUGEPAGE)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._mapping, dtype=torch.uint8)
        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        code = cudart.cudaHostRegister(self.tensor.data_ptr(), nbytes, _PORTABLE)
        if int(code) != 0:
            self.tensor = None
            self._mapping.close()
            raise OSError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(code)}")

    def buffers(self, count: int, size: int) -> list[torch.Tensor]:
        """``count`` consecutive buffers of ``size`` bytes (``count * size`` at most :attr:`nbytes`)."""
        assert self.tensor is not None and count * size <= self.nbytes
        return [self.tensor[index * size : (index + 1) * size] for index in range(count)]

    def release(self) -> None:
        """Unpin and unmap; the buffers handed out must no longer be used."""
        import torch

        if self.tensor is None:
            return
        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        cudart.cudaHostUnregister(self.tensor.data_ptr())
        self.tensor = None
        with contextlib.suppress(BufferError):  # a buffer still referenced: the mapping goes with it
            self._mapping.close()


def take(nbytes: int) -> Area | None:
    """A registered area of at least ``nbytes``: the process's idle one, or a new one; None where CUDA
    refuses (no CUDA build, a ROCm build, registration failed), and the caller pins another way."""
    with _lock:
        for area in _idle:
            if area.nbytes >= nbytes:
                _idle.remove(area)
                return area
    try:
        import torch

        if not torch.version.cuda or torch.version.hip:
            return None
        return Area(nbytes)
    except (OSError, RuntimeError, ValueError, AttributeError):
        return None


def give_back(area: Area) -> None:
    """Keep ``area`` for the next load, or free it when one is kept already."""
    with _lock:
        if not _idle:
            _idle.append(area)
            return
    area.release()
