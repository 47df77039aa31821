"""Benchmark `ckptconv batch`: throughput for --jobs 1 and --jobs 2, and the per-item overhead.

Builds a zoo of equal-sized checkpoints in mixed formats (torch zip with a
`module.` prefix, legacy torch, safetensors) and converts it to safetensors
with `--strip-prefix module`, timing the whole command in a fresh process, so
start-up (interpreter, imports, worker pool) is counted as a user sees it.

Then it times two zoos of tiny files (a few KB each) of different sizes; the
slope between them is the cost of one more item, the intercept the fixed cost
of a run. Start-up paid per item instead of per worker would show up in the
slope.

    python bench/bench_batch.py                       # 48 x 8 MiB, 3 runs, tiny zoos of 25 and 250
    python bench/bench_batch.py --items 96 --size-mb 32 --runs 5
    python bench/bench_batch.py --smoke --json        # seconds; what the test suite runs

Inputs are in the page cache after the first run (warm cache); outputs are
fsynced and checksummed as in normal use (pass --extra '--no-fsync
--no-checksums' to see the conversion alone). Each figure is the median of
the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CKPTCONV = [sys.executable, "-m", "ckptconv"]


def build_zoo(folder: Path, count: int, size_mb: float, *, seed: int = 0) -> int:
    """``count`` checkpoints of about ``size_mb`` MiB each in nested folders; returns their total bytes."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    elements = max(16, int(size_mb * 2**20 / 4))
    width = 256 if elements >= 4096 else 4
    rows = max(1, elements // width)
    from safetensors.torch import save_file

    for index in range(count):
        sub = folder / f"group{index % 4}" / f"run{index % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        state = {
            "module.embed.weight": torch.randn(rows // 2 or 1, width, generator=generator),
            "module.head.weight": torch.randn(rows - rows // 2 or 1, width, generator=generator),
            "module.head.bias": torch.zeros(width),
            "module.bn.num_batches_tracked": torch.tensor(index),
        }
        kind = index % 4
        if kind == 2:
            save_file({k: v.contiguous() for k, v in state.items()}, sub / f"model_{index}.safetensors")
        elif kind == 3:
            torch.save(state, sub / f"model_{index}.pth", _use_new_zipfile_serialization=False)
        else:
            torch.save(state, sub / f"model_{index}.pt")
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def time_batch(zoo: Path, out: Path, jobs: int, extra: list[str]) -> float:
    if out.exists():
        shutil.rmtree(out)
    if hasattr(os, "sync"):
        os.sync()  # the previous run's dirty pages must not be written back during this one
    command = [*CKPTCONV, "batch", str(zoo), str(out), "--jobs", str(jobs), "--strip-prefix", "module", "-q", *extra]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr}")
    return elapsed


def median_time(zoo: Path, out: Path, jobs: int, runs: int, extra: list[str]) -> float:
    return statistics.median(time_batch(zoo, out, jobs, extra) for _ in range(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=48, help="checkpoints in the throughput zoo")
    parser.add_argument("--size-mb", type=float, default=8.0, help="MiB per checkpoint")
    parser.add_argument(
        "--tiny", type=int, nargs=2, default=(25, 250), metavar=("FEW", "MANY"), help="sizes of the two tiny-file zoos"
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--extra", default="", help="more batch options, e.g. '--dtype bf16 --no-checksums'")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one run (for the test suite)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    parser.add_argument("--workdir", type=Path, help="where to build the zoos (default: a temporary folder)")
    args = parser.parse_args()
    if args.smoke:
        args.items, args.size_mb, args.tiny, args.runs = 4, 0.25, (3, 9), 1
    extra = args.extra.split()

    work = Path(tempfile.mkdtemp(prefix="ckptconv-bench-", dir=args.workdir))
    figures: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "items": args.items,
        "size_mb": args.size_mb,
        "runs": args.runs,
        "extra": extra,
        "jobs": {},
        "tiny": {},
    }
    try:
        zoo = work / "zoo"
        total = build_zoo(zoo, args.items, args.size_mb)
        figures["zoo_mb"] = round(total / 2**20, 1)
        if not args.smoke:
            time_batch(zoo, work / "out", 1, extra)  # warm the page cache and the interpreter's files
        for jobs in args.jobs:
            seconds = median_time(zoo, work / "out", jobs, args.runs, extra)
            figures["jobs"][str(jobs)] = {
                "seconds": round(seconds, 3),
                "items_per_s": round(args.items / seconds, 2),
                "mb_per_s": round(total / 2**20 / seconds, 1),
            }
        if len(args.jobs) > 1:
            first, last = str(args.jobs[0]), str(args.jobs[-1])
            figures["speedup"] = round(figures["jobs"][first]["seconds"] / figures["jobs"][last]["seconds"], 2)

        few, many = args.tiny
        tiny = {count: work / f"tiny{count}" for count in (few, many)}
        for count, folder in tiny.items():
            build_zoo(folder, count, 0.001, seed=count)
        figures["tiny"] = {"files": [few, many], "per_item_ms": {}, "fixed_s": {}}
        for jobs in args.jobs:
            t_few = median_time(tiny[few], work / "out", jobs, args.runs, extra)
            t_many = median_time(tiny[many], work / "out", jobs, args.runs, extra)
            per_item = (t_many - t_few) / (many - few)
            figures["tiny"]["per_item_ms"][str(jobs)] = round(per_item * 1000, 2)
            figures["tiny"]["fixed_s"][str(jobs)] = round(t_few - few * per_item, 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(
        f"zoo: {args.items} checkpoints, {figures['zoo_mb']} MiB, {figures['cpus']} CPUs, "
        f"median of {args.runs} runs, options: --strip-prefix module {' '.join(extra)}"
    )
    print(f"{'jobs':>4}  {'seconds':>8}  {'items/s':>8}  {'MiB/s':>8}")
    for jobs, row in figures["jobs"].items():
        print(f"{jobs:>4}  {row['seconds']:>8.2f}  {row['items_per_s']:>8.1f}  {row['mb_per_s']:>8.1f}")
    if "speedup" in figures:
        print(f"speed-up --jobs {args.jobs[-1]} over --jobs {args.jobs[0]}: {figures['speedup']:.2f}x")
    print(f"tiny files ({few} vs {many} items):")
    for jobs in figures["tiny"]["per_item_ms"]:
        print(
            f"  --jobs {jobs}: {figures['tiny']['per_item_ms'][jobs]:.2f} ms per item, "
            f"{figures['tiny']['fixed_s'][jobs]:.2f} s fixed per run (start-up)"
        )


if __name__ == "__main__":
    main()
