"""Probe: a 4 GiB ``--dtype`` conversion with different numbers of cast threads, in fresh processes.

For many-core hosts, where :func:`ckptconv.streaming.cast_workers` gives more than two threads.
Builds a 4 GiB ``.pt`` of float32 transformer-like tensors (20 layers of 2048-wide weights), then
runs ``ckptconv strip-module SRC OUT --dtype fp16|bf16 --no-fsync --no-source-hash`` with each
thread count, the cases shuffled in every round, and prints the medians beside one ``cp``.

    PYTHONPATH=. python bench/probe_cast_workers.py --rounds 5 --workers default 2 3 4 6
    PYTHONPATH=. python bench/probe_cast_workers.py --dtypes fp16 --blocks 131072 262144 524288
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

BUILD = textwrap.dedent(
    """
    import sys, torch
    torch.manual_seed(0)
    d, state = 2048, {}
    for i in range(20):
        for name in "qkvo":
            state[f"l{i}.{name}"] = torch.randn(d, d) * 0.02
        state[f"l{i}.up"] = torch.randn(4 * d, d) * 0.02
        state[f"l{i}.down"] = torch.randn(d, 4 * d) * 0.02
        state[f"l{i}.norm"] = torch.ones(d)
    torch.save(state, sys.argv[1])
    """
)

FAST = ["--no-fsync", "--no-source-hash", "-q"]
# The command line, with cast_workers() replaced unless W is "default".
RUN = textwrap.dedent(
    """
    import os, sys
    import ckptconv.streaming
    if os.environ["W"] != "default":
        ckptconv.streaming.cast_workers = lambda: int(os.environ["W"])
    if os.environ["ML"] == "1":  # loaded, as by a program that uses it: the casts may take it
        import ml_dtypes
    if os.environ["BLOCK"] != "default":
        import ckptconv._cast
        ckptconv._cast.BLOCK_ELEMENTS = int(os.environ["BLOCK"])
    from ckptconv.cli import main
    sys.argv = ["ckptconv", *sys.argv[1:]]
    main()
    """
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", nargs="+", default=["default", "2"], help="thread counts, or 'default'")
    parser.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"])
    parser.add_argument("--blocks", nargs="+", default=["default"], help="cast block sizes (elements), or 'default'")
    parser.add_argument("--ml-dtypes", action="store_true", help="also each case with ml_dtypes loaded first")
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "ckptconv-cast-workers"))
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    source, output = os.path.join(args.dir, "model_4gib.pt"), os.path.join(args.dir, "out.pt")
    if not os.path.exists(source):
        subprocess.run([sys.executable, "-c", BUILD, source], check=True)
    with open(source, "rb") as file:  # into the page cache
        while file.read(1 << 24):
            pass
    walls: dict[tuple[str, str, str, str], list[float]] = {}
    loaded = ["0", "1"] if args.ml_dtypes else ["0"]
    cases = [(d, w, b, ml) for d in args.dtypes for w in args.workers for b in args.blocks for ml in loaded]
    for _ in range(args.rounds):
        random.shuffle(cases)
        for dtype, workers, block, ml in cases:
            if os.path.exists(output):
                os.unlink(output)
            argv = [sys.executable, "-c", RUN, "strip-module", source, output, "--dtype", dtype, *FAST]
            started = time.perf_counter()
            subprocess.run(argv, env={**os.environ, "W": workers, "BLOCK": block, "ML": ml}, check=True)
            walls.setdefault((dtype, workers, block, ml), []).append(time.perf_counter() - started)
    copy = os.path.join(args.dir, "copy.pt")
    started = time.perf_counter()
    subprocess.run(["/bin/cp", source, copy], check=True)
    cp = time.perf_counter() - started
    os.unlink(copy)

    from ckptconv.streaming import cast_workers

    size = os.path.getsize(source) / 1e9
    print(f"4 GiB .pt, {os.cpu_count()} CPUs, cast_workers() = {cast_workers()}; one cp: {cp:.2f} s\n")
    print("| dtype | threads | block | ml_dtypes loaded | median wall (s) | GB/s in | runs |")
    print("|---|---|---|---|---:|---:|---|")
    for (dtype, workers, block, ml), times in sorted(walls.items()):
        median = statistics.median(times)
        runs = " / ".join(f"{t:.2f}" for t in times)
        loaded_text = "yes" if ml == "1" else "no"
        print(f"| {dtype} | {workers} | {block} | {loaded_text} | {median:.2f} | {size / median:.2f} | {runs} |")


if __name__ == "__main__":
    main()
