"""The page cache: how much of a file is already in memory (mincore over a sample of its pages), which
decides how a GPU load reads it (buffered when warm, direct I/O when cold)."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from typing import TYPE_CHECKING, Any

from ckptconv.errors import LoadError
from ckptconv.reading import read_policy

if TYPE_CHECKING:
    pass


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)  # the C library the interpreter already uses
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


#: Pages :func:`resident_fraction` asks about in a big file: runs of :data:`SAMPLE_RUN` pages spread
#: evenly over it. Asking about every page of an 8 GiB file took about 50 ms on an H200 host (the
#: readers waited for it), some 15% of a warm load (bench/results/bench_gpu_load_h200.md, round 3).
SAMPLE_PAGES = 1 << 14

SAMPLE_RUN = 64


def resident_fraction(path: str, *, sample: bool = True) -> float:
    """The fraction of ``path``'s pages in the page cache (1.0 when it cannot be told).

    For files of more than :data:`SAMPLE_PAGES` pages it is estimated from that
    many pages, in runs spread evenly over the file, unless ``sample`` is False.
    """
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    try:
        libc = _libc()
    except (OSError, AttributeError):  # pragma: no cover - no C library to ask
        return 1.0
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    if sample and pages > SAMPLE_PAGES:
        runs = SAMPLE_PAGES // SAMPLE_RUN
        starts = [(pages - SAMPLE_RUN) * i // (runs - 1) for i in range(runs)]
        counts = [SAMPLE_RUN] * runs
    else:
        starts, counts = [0], [pages]
    try:
        fd = read_policy.open_descriptor(path)  # regular files only (ckptconv.reading.read_policy)
    except (OSError, LoadError):
        return 1.0
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            return 1.0
        try:
            import numpy as np

            resident = 0
            vector = (ctypes.c_ubyte * max(counts))()
            for start, count in zip(starts, counts):
                length = min(count * page, size - start * page)
                if libc.mincore(address + start * page, length, vector) != 0:
                    return 1.0
                flags = np.frombuffer(memoryview(vector).cast("B"), dtype=np.uint8)[:count]
                resident += int(np.count_nonzero(flags & 1))
            return resident / sum(counts)
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
