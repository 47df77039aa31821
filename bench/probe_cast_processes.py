"""Probe: the float16 cast of a whole ``.pt`` with two cast *threads*, or two forked cast *processes*.

Casting alone, two processes beat two threads of one process (``bench_cast_limit.py``: the GIL is
taken between the dozen numpy calls of each block). This asks whether that survives in a conversion,
where the same two cores also read the source and write the output. Both ways run the same pipeline:
worker ``w`` reads and casts pieces ``w``, ``w + N``, ... (4 MiB, through ``cast_counting_overflows``)
into its own ring of shared-memory output slots and says so on a pipe; the main thread writes the
outputs in order and hands each slot back. Only the workers differ: threads, or processes forked once
the source is open (no interpreter or numpy import to pay). Each run is a fresh process; the two ways
alternate in a random order each round, with ``cp`` of the source, and the outputs are compared.

    PYTHONPATH=. python bench/probe_cast_processes.py /path/to/model_1gib.pt --rounds 11

Only the float32 tensors are cast and written (one after another, no file format around them):
this is the cast's pipeline, not a converter.
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import mmap
import os
import random
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PIECE_BYTES = 4 << 20
SLOTS = 3  # output slots per worker: pieces a worker may have done before the writer takes them
FAILED = 0xFFFFFFFF


def float32_weights(source: str) -> dict[str, object]:
    """The tensors cast, by name, in the order they are written: contiguous float32 ones."""
    import ckptconv

    weights = ckptconv.open(source).select().weights
    return {name: ref for name, ref in weights.items() if ref.dtype.name == "float32" and ref.is_contiguous}


def pieces(source: str) -> tuple[contextlib.ExitStack, list[tuple[object, int, int]]]:
    """``(readers, [(read_into, position, length)])`` over the float32 tensors' bytes, in order."""
    readers = contextlib.ExitStack()
    jobs = []
    for ref in float32_weights(source).values():
        read_into = readers.enter_context(ref.storage.reader())
        start, end = ref.byte_span
        jobs += [(read_into, position, min(PIECE_BYTES, end - position)) for position in range(start, end, PIECE_BYTES)]
    return readers, jobs


def run(way: str, source: str, output: str, workers: int) -> None:
    import numpy as np

    from ckptconv._cast import aligned_empty, cast_counting_overflows

    readers, jobs = pieces(source)
    slot_bytes = PIECE_BYTES // 2
    shared = mmap.mmap(-1, workers * SLOTS * slot_bytes)  # MAP_SHARED: seen by forked workers too
    slots = np.frombuffer(shared, np.float16)
    done = [os.pipe() for _ in range(workers)]  # worker -> writer: a piece's output bytes are ready
    free = [os.pipe() for _ in range(workers)]  # writer -> worker: a slot may be used again

    def work(w: int) -> None:
        try:
            cast_pieces(w)
        except BaseException:
            os.write(done[w][1], struct.pack("<I", FAILED))  # the writer stops instead of waiting forever
            raise

    def cast_pieces(w: int) -> None:
        raw = aligned_empty(PIECE_BYTES, np.uint8)
        for count, index in enumerate(range(w, len(jobs), workers)):
            if count >= SLOTS:
                os.read(free[w][0], 1)
            read_into, position, length = jobs[index]
            read_into(position, raw[:length].data)
            values = raw[:length].view(np.float32)
            slot = (w * SLOTS + count % SLOTS) * (slot_bytes // 2)
            cast_counting_overflows(values, "float32", "float16", out=slots[slot : slot + values.size])
            os.write(done[w][1], struct.pack("<I", values.size * 2))

    started: list[threading.Thread] = []
    children = []
    for w in range(workers):
        if way == "threads":
            thread = threading.Thread(target=work, args=(w,))
            thread.start()
            started.append(thread)
            continue
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            status = 0
            try:
                work(w)
            except BaseException:
                status = 1
            os._exit(status)
        children.append(pid)
    view = memoryview(shared)
    with open(output, "wb", buffering=0) as out:
        for index in range(len(jobs)):
            w, count = index % workers, index // workers
            (nbytes,) = struct.unpack("<I", os.read(done[w][0], 4))
            assert nbytes != FAILED, f"cast worker {w} failed"
            slot = (w * SLOTS + count % SLOTS) * slot_bytes
            out.write(view[slot : slot + nbytes])
            if count + SLOTS < len(range(w, len(jobs), workers)):
                os.write(free[w][1], b"x")
    for thread in started:
        thread.join()
    for pid in children:
        _, status = os.waitpid(pid, 0)
        assert status == 0, "a cast process failed"
    view.release()
    readers.close()


def check_against_torch(source: str, output: str) -> None:
    """The output is ``Tensor.to(torch.float16)`` of each tensor, as ``torch.load`` reads the source."""
    import torch

    state = torch.load(source, weights_only=True, mmap=True)
    expected = (state[name].to(torch.float16).view(torch.uint8).numpy().tobytes() for name in float32_weights(source))
    with open(output, "rb") as written:
        for chunk in expected:
            assert written.read(len(chunk)) == chunk, "a cast differs from Tensor.to(torch.float16)"
        assert not written.read(1), "more bytes than the tensors"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a .pt checkpoint (torch.save's zip format)")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--way", choices=["threads", "processes"], help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.way:
        sys.setswitchinterval(1e-4)  # as the command line casts (ckptconv._cores.switching_often)
        run(args.way, args.source, args.output, args.workers)
        return
    with tempfile.TemporaryDirectory(dir=Path(args.source).parent) as folder:
        outputs = {way: str(Path(folder) / f"{way}.bin") for way in ("threads", "processes")}
        commands = {
            way: [sys.executable, __file__, args.source, "--way", way, "--output", path, "--workers", str(args.workers)]
            for way, path in outputs.items()
        }
        commands["cp"] = ["cp", args.source, str(Path(folder) / "copy.pt")]
        for command in commands.values():  # untimed: caches, bytecode
            subprocess.run(command, check=True)
        same = filecmp.cmp(outputs["threads"], outputs["processes"], shallow=False)
        assert same, "the two ways wrote different bytes"
        check_against_torch(args.source, outputs["threads"])
        walls: dict[str, list[float]] = {name: [] for name in commands}
        order = list(commands)
        for _ in range(args.rounds):
            random.shuffle(order)
            for name in order:
                os.sync()  # no other run's writeback throttles this one
                began = time.perf_counter()
                subprocess.run(commands[name], check=True)
                walls[name].append(time.perf_counter() - began)
        for name, times in walls.items():
            print(f"{name:10s} median {statistics.median(times):.3f} s  best {min(times):.3f} s")


if __name__ == "__main__":
    main()
