"""CPU cores: how many this process may keep busy, how many its background work takes, and how
often its threads hand the GIL on (:func:`switching_often`).

A copy through Python takes a second thread only where a core would otherwise
idle. Alone, two threads copied 1 GiB 1.5x faster than one on the 2-core
development VM (one waits for the kernel to fill page-cache pages while the
other reads); beside the source's sha256 on the same two cores, the second
thread only slowed the hash, which then set the conversion's pace.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

__all__ = [
    "CORES_VARIABLE",
    "JOIN_TURN_S",
    "SWITCH_INTERVAL_S",
    "busy",
    "in_background",
    "join",
    "join_uninterrupted",
    "spare",
    "switching_often",
    "usable",
]

#: Caps the cores one ckptconv process keeps busy; ``ckptconv batch`` sets it for its worker
#: processes (the machine's cores shared between them).
CORES_VARIABLE = "CKPTCONV_CORES"

#: The GIL switch interval of ckptconv's own processes, the command line and ``batch``'s workers
#: (seconds; CPython's default is 0.005). The cast threads take the GIL between numpy passes. One
#: that wants it while another holds it waits up to the interval before CPython makes the holder let
#: go, and the holder lets go and takes it back between its passes (every 20-60 us) faster than a
#: futex wake reaches the waiter on a VM, so the waiter can wait the whole interval. At 0.1 ms,
#: 1 GiB to fp16 on the 2-core VM took 0.47 s against 0.57 s from the first cast to the last write
#: (medians of 3 pairs; whole commands 9% less, bench/results/bench_convert_round8_2core_vm.md).
#: A library caller's interpreter is theirs: ``ckptconv.convert`` leaves its interval alone.
SWITCH_INTERVAL_S = 0.0001


@contextlib.contextmanager
def switching_often() -> Iterator[None]:
    """Run the block with :data:`SWITCH_INTERVAL_S`, then give the interpreter its interval back."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


_lock = threading.Lock()
_busy = [0]  # threads doing background CPU work now, counted under _lock

T = TypeVar("T")


@functools.cache
def usable() -> int:
    """Cores this process may run on (its CPU affinity), capped by ``CKPTCONV_CORES`` when set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    cap = os.environ.get(CORES_VARIABLE, "")
    if cap.isdecimal() and int(cap) > 0:
        cores = min(cores, int(cap))
    return max(cores, 1)


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """Count the calling thread's CPU-bound work (a hash, a CRC check) as taking a core while it runs."""
    with _lock:
        _busy[0] += 1
    try:
        yield
    finally:
        with _lock:
            _busy[0] -= 1


def in_background(function: Callable[..., T]) -> Callable[..., T]:
    """``function``, counted as taking a core (:func:`busy`) while it runs: for a worker thread's task."""

    @functools.wraps(function)
    def counted(*args: object, **kwargs: object) -> T:
        with busy():
            return function(*args, **kwargs)

    return counted


def spare() -> int:
    """Cores left idle by the calling thread and the background work running now (0 or more)."""
    with _lock:
        return max(usable() - 1 - _busy[0], 0)


# join() waits in turns this long. A SIGINT (Ctrl-C) that reaches the waiting thread after it let the GIL go
# and before its wait has begun interrupts nothing: CPython's handler only flags it, and an unbounded join
# sleeps on until the thread ends. The thread that sends such a signal often runs in exactly that gap (it
# was waiting for the GIL): on Python 3.12 an interrupted load went on to its end in 3 of 10 runs. At the
# next turn the flag is seen, and KeyboardInterrupt raised.
JOIN_TURN_S = 0.1


def join(thread: threading.Thread) -> None:
    """``thread.join()``, which Ctrl-C always interrupts (within :data:`JOIN_TURN_S`); a thread that has
    ended ends the wait at once, as with a plain join."""
    while thread.is_alive():
        thread.join(JOIN_TURN_S)


def join_uninterrupted(thread: threading.Thread) -> None:
    """Wait for ``thread`` to end, even through Ctrl-C, then re-raise what interrupted the wait.

    A copying or reading thread uses descriptors its caller closes once it
    returns: left running, it could write into whatever file reuses the number.
    It ends within one run of work once told to stop.
    """
    interruption: BaseException | None = None
    while thread.is_alive():
        try:
            thread.join()
        except BaseException as error:  # KeyboardInterrupt, or SIGTERM's handler raising
            interruption = error
    if interruption is not None:
        raise interruption
