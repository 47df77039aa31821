"""What ``ckptconv --help`` and ``ckptconv convert --help`` cost: wall time of a fresh process, warm.

Each run is a new ``python -m ckptconv ...``; the page cache is warm after the first. ``--before REV``
also runs the ckptconv of a commit (exported with ``git archive`` into a temporary folder), alternating
with this checkout run by run, so both see the same machine. Bytecode is compiled once into a folder
of its own (``PYTHONPYCACHEPREFIX``), as an installed package has it, unless ``--no-bytecode``.

    python bench/bench_help.py                   # this checkout, 20 runs of each
    python bench/bench_help.py --before main --runs 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = (("--help",), ("convert", "--help"))


def _run(tree: Path, command: tuple[str, ...], cache: Path | None) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    if cache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(cache)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ckptconv", *command], env=env, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", metavar="REV", help="also measure the ckptconv of this commit")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--no-bytecode", action="store_true", help="compile every module on every run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        trees = {"after": ROOT}
        if args.before:
            before = folder / "before"
            before.mkdir()
            git = ["git", "-C", str(ROOT), "archive", args.before]
            archive = subprocess.run(git, check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)  # noqa: S607
            trees = {"before": before, "after": ROOT}
        for command in COMMANDS:
            times: dict[str, list[float]] = {name: [] for name in trees}
            for run in range(args.runs + 1):
                for name, tree in trees.items():
                    cache = None if args.no_bytecode else folder / f"pycache-{name}"
                    took = _run(tree, command, cache)
                    if run:  # the first run of each compiles the bytecode and warms the page cache
                        times[name].append(took)
            for name, values in times.items():
                print(
                    f"ckptconv {' '.join(command):<14} {name:>6}: median {statistics.median(values) * 1000:.0f} ms, "
                    f"best {min(values) * 1000:.0f} ms ({len(values)} runs)"
                )


if __name__ == "__main__":
    main()
