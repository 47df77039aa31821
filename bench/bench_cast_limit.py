"""Probe: where the float32 -> float16 cast's time goes, and what a second core adds to it.

Two measurements behind the float16 row of ``bench_convert`` (issue 15):

1. **The kernel's passes.** Each numpy pass of the tame float16 kernel
   (``float16._f32_to_f16_tame``, the path nearly every block of weights takes) timed
   alone on one block of :data:`~ckptconv.transforms.casts.BLOCK_ELEMENTS` values, and the whole
   kernel. The passes are replayed here in the kernel's order; their output is first
   compared, bit for bit, with the kernel's and with ``Tensor.to(torch.float16)``.
2. **Two cores.** A worker casts 4 MiB pieces (``CAST_PIECE_BYTES``) of weights
   through ``cast_counting_overflows``, as the streaming writers do: one worker alone,
   then N workers as threads of one process (sharing the GIL), then N workers as
   processes (sharing nothing but the machine), started together. Where threads reach
   what processes reach, the GIL is not what limits the casts; where processes fall
   short of N times one worker, the machine is.

    python bench/bench_cast_limit.py                  # 2 workers, 3 rounds
    python bench/bench_cast_limit.py --workers 4 --pieces 256
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from ckptconv.reading.streaming import CAST_PIECE_BYTES
from ckptconv.runtime.cores import SWITCH_INTERVAL_S, switching_often
from ckptconv.transforms import casts as _cast
from ckptconv.transforms.casts import buffers, float16

PIECE_ELEMENTS = CAST_PIECE_BYTES // 4


def weights(count: int, seed: int) -> np.ndarray:
    """float32 values spread like a layer's weights, in 64-byte-aligned memory (as the cast path reads them)."""
    generator = torch.Generator().manual_seed(seed)
    values = buffers.aligned_empty(count, np.float32)
    values[:] = (torch.randn(count, generator=generator) * 0.02).numpy()
    return values


def as_torch(values: np.ndarray) -> bytes:
    return torch.from_numpy(values).to(torch.float16).view(torch.uint16).numpy().tobytes()


# -- 1. the passes -------------------------------------------------------------------


def kernel_passes(source: np.ndarray, out: np.ndarray) -> list[tuple[str, Callable[[], object]]]:
    """The tame float16 kernel's passes (and the tameness test's reduction), in its order."""
    n = source.size
    bits = source.view(np.uint32)
    value = buffers.aligned_empty(n, np.uint32)
    bias = buffers.aligned_empty(n, np.uint32)
    floor = buffers._filled(0x38800000, n)
    half = out.view(np.uint16)
    sign = value.view(np.uint16)[:n]
    return [
        ("abs(x): bits & 0x7FFFFFFF", lambda: np.bitwise_and(bits, np.uint32(0x7FFFFFFF), out=value)),
        ("tameness test: max of abs(x)", value.max),
        ("exponent floor (maximum of two arrays)", lambda: np.maximum(value, floor, out=bias)),
        ("bias: & 0x7F800000", lambda: np.bitwise_and(bias, np.uint32(0x7F800000), out=bias)),
        ("bias: + 0x06800800", lambda: np.add(bias, np.uint32(0x06800800), out=bias)),
        (
            "rounding add (float32)",
            lambda: np.add(value.view(np.float32), bias.view(np.float32), out=value.view(np.float32)),
        ),
        ("v >> 13", lambda: np.right_shift(value, 13, out=bias)),
        ("v + (v >> 13)", lambda: np.add(bias, value, out=bias)),
        ("narrow to 16 bits", lambda: np.copyto(half, bias, casting="unsafe")),
        ("sign: bits >> 16, narrowing", lambda: np.right_shift(bits, 16, out=sign, casting="unsafe")),
        ("sign: & 0x8000 (16 bits)", lambda: np.bitwise_and(sign, np.uint16(0x8000), out=sign)),
        ("sign: or-ed into the output (16 bits)", lambda: np.bitwise_or(half, sign, out=half)),
    ]


def time_passes(rounds: int) -> None:
    n = buffers.BLOCK_ELEMENTS
    source = weights(n, seed=0)
    replayed = buffers.aligned_empty(n, np.float16)
    passes = kernel_passes(source, replayed)
    for _, run in passes:
        run()
    kernel_out = buffers.aligned_empty(n, np.float16)
    scratch = buffers._Scratch(n)
    scratch.tame = True

    def whole_kernel() -> None:
        scratch.forget()
        float16._f32_to_f16_tame(source, kernel_out, scratch, complex32=None)

    whole_kernel()
    assert replayed.tobytes() == kernel_out.tobytes() == as_torch(source), "the replayed passes drifted from the kernel"
    timed = [*passes, ("the whole kernel (one call)", whole_kernel)]
    samples: dict[str, list[float]] = {name: [] for name, _ in timed}
    for _ in range(rounds * 100):
        for name, run in timed:
            started = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - started)
    total = sum(statistics.median(samples[name]) for name, _ in passes)
    print(f"\n### The tame float16 kernel, one block of {n} values ({n * 4 >> 20} MiB of float32), medians\n")
    print("| pass | us | share |")
    print("|---|---:|---:|")
    for name, _ in passes:
        median = statistics.median(samples[name])
        print(f"| {name} | {median * 1e6:.1f} | {median / total:.0%} |")
    print(f"| sum of the passes | {total * 1e6:.1f} | |")
    whole = statistics.median(samples["the whole kernel (one call)"])
    print(f"| the whole kernel (one call) | {whole * 1e6:.1f} | |")
    print(f"\nkernel alone: {n * 4 / whole / 1e9:.2f} GB/s of float32 on one core")


# -- 2. two cores ----------------------------------------------------------------------


def cast_pieces(pieces: int, seed: int) -> Callable[[], float]:
    """A worker: ``run()`` casts ``pieces`` pieces (two sources, in turn) and gives its seconds."""
    sources = [weights(PIECE_ELEMENTS, seed=seed * 2 + k) for k in range(2)]
    out = buffers.aligned_empty(PIECE_ELEMENTS, np.float16)
    for source in sources:
        _cast.cast_counting_overflows(source, "float32", "float16", out=out)
        assert out.tobytes() == as_torch(source)

    def run() -> float:
        started = time.perf_counter()
        for index in range(pieces):
            _cast.cast_counting_overflows(sources[index & 1], "float32", "float16", out=out)
        return time.perf_counter() - started

    return run


def in_threads(workers: int, pieces: int) -> list[float]:
    runs = [cast_pieces(pieces, seed=k) for k in range(workers)]
    seconds: list[float] = []
    barrier = threading.Barrier(workers)

    def thread(run: Callable[[], float]) -> None:
        barrier.wait()
        seconds.append(run())

    threads = [threading.Thread(target=thread, args=(run,)) for run in runs]
    for started in threads:
        started.start()
    for started in threads:
        started.join()
    return seconds


def in_processes(workers: int, pieces: int) -> list[float]:
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(k), "--pieces", str(pieces)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for k in range(workers)
    ]
    for child in children:  # each has made its data and is waiting
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    seconds = []
    for child in children:
        assert child.stdout is not None
        seconds.append(float(child.stdout.readline()))
        child.wait()
    return seconds


def worker(index: int, pieces: int) -> None:
    run = cast_pieces(pieces, seed=index)
    print("ready", flush=True)
    sys.stdin.readline()
    print(run(), flush=True)


def time_workers(workers: int, pieces: int, rounds: int) -> None:
    gigabytes = pieces * CAST_PIECE_BYTES / 1e9
    ways: dict[str, Callable[[], list[float]]] = {
        "one worker": lambda: [cast_pieces(pieces, seed=0)()],
        f"{workers} threads": lambda: in_threads(workers, pieces),
        f"{workers} processes": lambda: in_processes(workers, pieces),
    }
    rows: dict[str, list[list[float]]] = {name: [] for name in ways}
    order = list(ways)
    for _ in range(rounds):
        random.shuffle(order)  # a slow spell of the machine then hits every way alike
        for name in order:
            rows[name].append(ways[name]())
    print(f"\n### {workers} workers, each casting {pieces} pieces of {CAST_PIECE_BYTES >> 20} MiB, {rounds} rounds\n")
    print("| workers | GB/s per worker (each round) | GB/s in all (median) |")
    print("|---|---|---:|")
    for name, trials in rows.items():
        rates = [[gigabytes / seconds for seconds in trial] for trial in trials]
        each = "; ".join(" + ".join(f"{rate:.2f}" for rate in trial) for trial in rates)
        print(f"| {name} | {each} | {statistics.median(sum(trial) for trial in rates):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pieces", type=int, default=128, help="4 MiB pieces each worker casts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.pieces)
        return
    with switching_often():  # as the command line runs its casts
        block = buffers.BLOCK_ELEMENTS
        print(f"numpy {np.__version__}, block of {block} values, GIL switch interval {SWITCH_INTERVAL_S} s")
        time_passes(args.rounds)
        time_workers(args.workers, args.pieces, args.rounds)


if __name__ == "__main__":
    main()
