"""Pausing Python's cyclic garbage collector while ckptconv builds or walks a checkpoint's tree.

For 10^5 tensors a reader builds millions of objects, none of them garbage, and the collector
walks all of them again each time their number has grown by a quarter, and again in every
full collection while they are alive: a third of the time of opening, converting or loading a
300,000-tensor ``.pt`` (bench/bench_many_tensors.py). Reference counting still frees
everything while the collector rests; what only it can free (a cycle a hostile pickle makes,
an exception that holds its own frame) waits until it runs again.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic collector for this block; nested blocks, and a collector someone else
    turned off, are left as they are (only the block that paused it restarts it)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
