"""Plain data that balloons: peak memory and time of ckptconv beside torch.load on the same files.

Each measurement is a fresh child process; its peak RSS is the kernel's VmHWM, which starts afresh at
exec (``resource.getrusage``'s ru_maxrss does not: Linux carries the parent's high-water mark across
exec, so a child of a process that imported torch reads at least that). torch.load's includes
importing torch; ckptconv imports no torch for these. Files are made in a child too, for that
reason. ``--before REV`` also runs the ckptconv of a commit (exported with ``git archive`` into a
temporary folder), side by side with this checkout.

    python bench/bench_plain_data.py                    # this checkout, 10 M elements
    python bench/bench_plain_data.py --before HEAD~3 --elements 4000000
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import sys, time
what, path = sys.argv[1], sys.argv[2]
start = time.perf_counter()
if what == "torch.load":
    import torch
    torch.load(path, weights_only=True)
elif what == "safe_open":
    from safetensors import safe_open
    with safe_open(path, "np") as f:
        list(f.keys())
elif what == "open+select":
    import ckptconv
    ckptconv.open(path).select()
elif what == "inspect":
    import ckptconv
    ckptconv.inspect(path)
elif what == "convert":
    from ckptconv.cli import main
    try:
        main(["convert", path, path + ".out.safetensors", "-q", "--overwrite"])
    except SystemExit as exit:
        if exit.code:
            raise
peak = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
print(peak, time.perf_counter() - start)
"""


def measure(what: str, path: Path, tree: Path) -> tuple[float, float]:
    """(peak MiB, seconds) of one child process doing ``what`` with the ckptconv under ``tree``."""
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, what, str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tree)},
        cwd=path.parent,  # not this checkout: python -c puts the working folder first on sys.path
        check=False,
    )
    if result.returncode:
        return float("nan"), float("nan")
    peak, seconds = result.stdout.split()[-2:]
    return int(peak) / 1024, float(seconds)


def make_files(folder: Path, elements: int) -> dict[str, Path]:
    import torch

    files = {}
    ints = folder / "ints.pt"
    torch.save({"w": torch.ones(2), "ints": [i % 100 for i in range(elements)]}, ints)
    files["list of small ints"] = ints
    nones = folder / "nones.pt"
    torch.save({"w": torch.ones(2), "nones": [None] * elements}, nones)
    files["list of None"] = nones
    header = {
        f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(elements // 33)
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    tensors = folder / "many_tensors.safetensors"
    tensors.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4 * (elements // 33)))
    files[f"safetensors header, {elements // 33} tensors"] = tensors
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=10_000_000)
    parser.add_argument("--before", metavar="REV", help="also measure the ckptconv of this commit")
    parser.add_argument("--make", metavar="FOLDER", help=argparse.SUPPRESS)  # the child that makes the files
    args = parser.parse_args()
    if args.make:
        print(json.dumps({name: str(path) for name, path in make_files(Path(args.make), args.elements).items()}))
        return
    with tempfile.TemporaryDirectory() as work:
        folder = Path(work)
        trees = {"after": ROOT}
        if args.before:
            before = folder / "before"
            before.mkdir()
            git = ["git", "-C", str(ROOT), "archive", args.before]
            archive = subprocess.run(git, capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)  # noqa: S607
            trees = {"before": before, "after": ROOT}
        made = subprocess.run(
            [sys.executable, __file__, "--make", str(folder), "--elements", str(args.elements)],
            capture_output=True,
            text=True,
            check=True,
        )
        for name, spelled in json.loads(made.stdout).items():
            path = Path(spelled)
            print(f"\n{name}: {path.stat().st_size / 1e6:.1f} MB on disk")
            reference = "safe_open" if path.suffix == ".safetensors" else "torch.load"
            peak, seconds = measure(reference, path, ROOT)
            print(f"  {reference:<12} {peak:8.0f} MiB {seconds:7.2f} s")
            for what in ("open+select", "inspect", "convert"):
                cells = []
                for label, tree in trees.items():
                    peak, seconds = measure(what, path, tree)
                    cells.append(f"{label}: {peak:6.0f} MiB {seconds:6.2f} s")
                print(f"  {what:<12} " + "   ".join(cells))


if __name__ == "__main__":
    main()
