"""Holding Ctrl-C and SIGTERM back while C++ code calls into Python."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["signals_deferred"]

_HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Run the block with SIGINT and SIGTERM held back, then deliver them to their handlers when it ends.

    ``torch.save`` to a file object calls back into Python to write: the KeyboardInterrupt a signal
    handler raised there crossed C++ code that cannot unwind it, and the process aborted (SIGABRT,
    "terminate called after throwing pybind11::error_already_set"). Held back, the signal reaches
    its handler once the block is done, where the exception unwinds as anywhere else. Only the main
    thread runs signal handlers (and may change them); in another thread the block just runs. A
    signal whose handler was not set from Python (``signal.getsignal`` gives None) is left alone.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        pending.append(signum)

    previous: dict[signal.Signals, Any] = {}
    for held in _HELD:
        if signal.getsignal(held) is not None:
            previous[held] = signal.signal(held, hold)
    try:
        yield
    finally:
        for held, handler in previous.items():
            signal.signal(held, handler)
        for signum in dict.fromkeys(pending):  # each once, in the order they came
            signal.raise_signal(signum)
