"""A batch worker process: a fresh Python that runs only this module, started by
:func:`ckptconv.batching.executors.run_local` (``python -m ckptconv.batching.worker`` runs one too).

Why not :mod:`multiprocessing`: its ``spawn`` and ``forkserver`` start methods
import the caller's main script in every worker (as ``__mp_main__``), so a
script that calls ``ckptconv.batch(..., jobs=4)`` without an
``if __name__ == "__main__":`` guard runs again in each worker, whose own
``batch()`` call then kills it. A worker started as a module of ckptconv
imports ckptconv and nothing of the caller, whether the caller is a script, a
notebook or an interactive session.

The protocol: frames of an 8-byte big-endian length and a pickle. The parent
sends the worker its ``sys.path`` first, then ``(sequence, job)`` pairs, the
job pickled on its own so that a job the worker cannot unpickle fails alone.
The worker answers ``("ready", pid)`` once its imports are done, then one
``(sequence, result, error)`` per job, in order. Its file descriptor 1 points
at stderr, so a stray ``print`` cannot corrupt the results channel. The worker
exits as soon as its stdin closes: when the batch finishes, is interrupted, or
its process dies (even by SIGKILL).
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import sys
import threading
from typing import IO

from ckptconv.batching.frames import read_frame, write_frame


def _read_jobs(stdin: IO[bytes], jobs: queue.Queue[tuple[int, bytes]]) -> None:
    try:
        while True:
            jobs.put(read_frame(stdin))
    except EOFError:
        pass
    # The batch is done, interrupted or dead: stop now, even in the middle of an item. An
    # unfinished output is only a hidden .partial file, which the next run removes.
    os._exit(0)


def main() -> None:
    """Serve jobs until stdin closes."""
    results = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    # Ctrl-C reaches the whole process group; the batch process decides, and closes our stdin.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    try:
        sys.path[:] = read_frame(stdin)
    except EOFError:
        return
    from ckptconv.batching.executors import run_job
    from ckptconv.runtime import cores as _cores

    write_frame(results, ("ready", os.getpid()))
    jobs: queue.Queue[tuple[int, bytes]] = queue.Queue()
    threading.Thread(target=_read_jobs, args=(stdin, jobs), name="ckptconv-jobs", daemon=True).start()
    sys.setswitchinterval(_cores.SWITCH_INTERVAL_S)  # this process is ckptconv's (see _cores)
    while True:
        sequence, data = jobs.get()
        try:
            job = pickle.loads(data)  # noqa: S301 - from the batch process, see read_frame
        except Exception as error:
            write_frame(results, (sequence, None, f"{type(error).__name__}: {error}"))
            continue
        write_frame(results, (sequence, run_job(job), None))


if __name__ == "__main__":
    main()
