"""Plain data that balloons: peak memory and time of ckptconv beside torch.load on the same files.

Each measurement is a fresh child process; its peak RSS is the kernel's VmHWM, which starts afresh at
exec (``resource.getrusage``'s ru_maxrss does not: Linux carries the parent's high-water mark across
exec, so a child of a process that imported torch reads at least that). torch.load's includes
importing torch; ckptconv imports no torch for these. Files are made in a child too, for that
reason. ``--before REV`` also runs the ckptconv of a commit (exported with ``git archive`` into a
temporary folder), side by side with this checkout.

    python bench/bench_plain_data.py                    # this checkout, 10 M elements
    python bench/bench_plain_data.py --before HEAD~3 --elements 4000000
    python bench/bench_plain_data.py --headers --before 06f9d48   # safetensors headers and shard indexes

``--headers`` measures safetensors headers instead (issue #31): a file of 300,000 tensors of 4 float32
(written by the safetensors library, named as a model's), the same tensors in 8 shards with their
``model.safetensors.index.json``, and a 99 MB header of 1.67 million empty tensors, against
``safetensors.safe_open`` (every key and the metadata listed; each shard in turn for the folder) and
``safetensors.torch.load_file``.
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
import json, sys, time
what, path = sys.argv[1], sys.argv[2]
start = time.perf_counter()
import os
shards = [path]
if what in ("safe_open", "load_file") and os.path.isdir(path):  # a sharded folder: the index, then each shard
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    shards = [os.path.join(path, name) for name in dict.fromkeys(index["weight_map"].values())]
if what == "torch.load":
    import torch
    torch.load(path, weights_only=True)
elif what == "safe_open":
    from safetensors import safe_open
    for shard in shards:
        with safe_open(shard, "np") as f:
            list(f.keys())
            f.metadata()
elif what == "load_file":
    from safetensors.torch import load_file
    state = {}
    for shard in shards:
        state.update(load_file(shard))
elif what == "open+select":
    import ckptconv
    ckptconv.open(path).select()
elif what == "inspect":
    import ckptconv
    ckptconv.inspect(path)
elif what in ("convert", "convert .pt", "verify"):
    from ckptconv.cli import main
    out = path.rstrip("/") + (".out.pt" if what == "convert .pt" else ".out.safetensors")
    argv = ["verify", path, out] if what == "verify" else ["convert", path, out, "-q", "--overwrite"]
    try:
        main(argv)
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


_HEADERS_SCRIPT = """
import json, os, struct, sys
import numpy as np
from safetensors.numpy import save_file
folder, n, empty = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
state = {f"layers.{i // 8}.block{i % 8}.weight": np.arange(4, dtype=np.float32) + i for i in range(n)}
save_file(state, f"{folder}/many.safetensors")
os.makedirs(f"{folder}/sharded")
keys, weight_map = list(state), {}
for shard in range(8):
    name = f"model-{shard + 1:05d}-of-00008.safetensors"
    part = keys[shard * -(-n // 8) : (shard + 1) * -(-n // 8)]
    save_file({key: state[key] for key in part}, f"{folder}/sharded/{name}")
    weight_map.update(dict.fromkeys(part, name))
index = {"metadata": {"total_size": 16 * n}, "weight_map": weight_map}
json.dump(index, open(f"{folder}/sharded/model.safetensors.index.json", "w"))
header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(empty)}
raw = json.dumps(header, separators=(",", ":")).encode()
raw += b" " * (-len(raw) % 8)
open(f"{folder}/empty.safetensors", "wb").write(struct.pack("<Q", len(raw)) + raw)
print(json.dumps({
    f"safetensors, {n:,} tensors": f"{folder}/many.safetensors",
    f"8 shards and their index, {n:,} tensors": f"{folder}/sharded",
    f"safetensors, {empty:,} empty tensors": f"{folder}/empty.safetensors",
}))
"""

#: What is measured of each kind of file: the references, then ckptconv.
_ROWS = {
    "plain": (("torch.load",), ("open+select", "inspect", "convert")),
    "headers": (("safe_open", "load_file"), ("open+select", "inspect", "convert", "convert .pt", "verify")),
    "empty": (("safe_open",), ("open+select", "inspect", "convert")),
}


def _print_rows(name: str, path: Path, rows: tuple[tuple[str, ...], tuple[str, ...]], trees: dict[str, Path]) -> None:
    size = sum(p.stat().st_size for p in path.iterdir()) if path.is_dir() else path.stat().st_size
    print(f"\n{name}: {size / 1e6:.1f} MB on disk")
    references, cases = rows
    for reference in references:
        peak, seconds = measure(reference, path, ROOT)
        print(f"  {reference:<12} {peak:8.0f} MiB {seconds:7.2f} s")
    for what in cases:
        cells = []
        for label, tree in trees.items():
            peak, seconds = measure(what, path, tree)
            cells.append(f"{label}: {peak:6.0f} MiB {seconds:6.2f} s")
        print(f"  {what:<12} " + "   ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=10_000_000)
    parser.add_argument("--before", metavar="REV", help="also measure the ckptconv of this commit")
    parser.add_argument("--make", metavar="FOLDER", help=argparse.SUPPRESS)  # the child that makes the files
    parser.add_argument("--headers", action="store_true", help="safetensors headers and shard indexes instead")
    parser.add_argument("--tensors", type=int, default=300_000, help="--headers: tensors of the file and the shards")
    parser.add_argument("--empty", type=int, default=1_670_000, help="--headers: empty tensors of the 99 MB header")
    parser.add_argument("--only", nargs="+", help="only the files whose description holds one of these")
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
        if args.headers:
            maker = [sys.executable, "-c", _HEADERS_SCRIPT, str(folder), str(args.tensors), str(args.empty)]
        else:
            maker = [sys.executable, __file__, "--make", str(folder), "--elements", str(args.elements)]
        made = subprocess.run(maker, capture_output=True, text=True, check=True)
        for name, spelled in json.loads(made.stdout).items():
            if args.only and not any(text in name for text in args.only):
                continue
            path = Path(spelled)
            kind = "plain" if path.suffix == ".pt" else "empty" if "empty" in name else "headers"
            if not args.headers and path.suffix == ".safetensors":
                kind = "empty"  # the one-element tensors of the plain run: the same rows
            _print_rows(name, path, _ROWS[kind], trees)


if __name__ == "__main__":
    main()
