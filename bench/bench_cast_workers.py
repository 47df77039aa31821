"""Benchmark: one pool of cast threads for a whole write, against a pool started per tensor.

Streams every tensor of a ``.pt`` checkpoint of many float32 tensors through the float16 cast
(``TensorRef.iter_bytes``, as the writers do) in one process, inside
:func:`ckptconv.reading.streaming.keeping_workers` and outside it, alternating within each round, and
reports wall and CPU time (medians). The cast bytes of each tensor are first compared with
``Tensor.to(torch.float16)``.

    python bench/bench_cast_workers.py                      # 64 tensors of 4 MiB, 9 rounds
    python bench/bench_cast_workers.py --tensors 256 --mib 1
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import ckptconv
from ckptconv.reading.streaming import keeping_workers


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--mib", type=float, default=4, help="size of each float32 tensor")
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(int(args.mib * 2**18)) * 0.02 for i in range(args.tensors)}
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "model.pt"
        torch.save(state, source)
        fp16 = ckptconv.Cast("fp16").target
        refs = {key: ref.cast(fp16) for key, ref in ckptconv.open(source).select().weights.items()}
        for key, ref in refs.items():
            streamed = b"".join(bytes(chunk) for chunk in ref.iter_bytes())
            assert streamed == state[key].to(torch.float16).view(torch.uint8).numpy().tobytes(), key

        def stream_all(scope: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
            with scope():
                for ref in refs.values():
                    for _ in ref.iter_bytes():
                        pass

        ways: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
            "a pool per tensor": contextlib.nullcontext,
            "one pool (keeping_workers)": keeping_workers,
        }
        walls: dict[str, list[float]] = {name: [] for name in ways}
        cpus: dict[str, list[float]] = {name: [] for name in ways}
        for round_number in range(args.runs):
            order = list(ways) if round_number % 2 == 0 else list(reversed(ways))
            for name in order:
                wall, cpu = time.perf_counter(), cpu_seconds()
                stream_all(ways[name])
                walls[name].append(time.perf_counter() - wall)
                cpus[name].append(cpu_seconds() - cpu)
    print(f"{args.tensors} float32 tensors of {args.mib:g} MiB cast to float16, medians of {args.runs}\n")
    print("| threads | wall (s) | CPU (s) |\n|---|---:|---:|")
    for name in ways:
        print(f"| {name} | {statistics.median(walls[name]):.3f} | {statistics.median(cpus[name]):.3f} |")


if __name__ == "__main__":
    main()
