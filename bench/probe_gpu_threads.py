"""Probe: how many reader threads a GPU load wants. Alternates ckptconv loads with other reader counts
and buffer depths (knobs of ckptconv._transfer) over 3 rounds, with instanttensor's buffered back end in
every round, on the files of bench_gpu_load.py. Run on a CUDA machine from the repository root:

    PYTHONPATH=. python bench/probe_gpu_threads.py 8      # GiB

Results: bench/results/bench_gpu_load_h200x2.md (round 2b).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_load import PEER_PROBE
from probe_gpu_phases import BUILD, LOAD, LOADERS, child, warm

VARIANTS = [
    ("st x16", ".safetensors", {"MAX_THREADS": 16, "MAX_GPU_THREADS": 16}, True),
    ("st x8", ".safetensors", {"MAX_THREADS": 8, "MAX_GPU_THREADS": 8}, True),
    ("st x12", ".safetensors", {"MAX_THREADS": 12, "MAX_GPU_THREADS": 12}, True),
    ("st x8 depth3", ".safetensors", {"MAX_THREADS": 8, "MAX_GPU_THREADS": 8, "DEPTH": 3}, True),
    ("st x24", ".safetensors", {"MAX_THREADS": 24, "MAX_GPU_THREADS": 24}, True),
    ("pt crc x16", ".pt", {"MAX_GPU_THREADS": 16}, True),
    ("pt crc x8", ".pt", {"MAX_GPU_THREADS": 8}, True),
    ("sharded x16", "_sharded", {"MAX_THREADS": 16, "MAX_GPU_THREADS": 16}, True),
    ("sharded x8", "_sharded", {"MAX_THREADS": 8, "MAX_GPU_THREADS": 8}, True),
]


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 8
    stem = f"/tmp/gpu_bench_{gib:g}gib"
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", BUILD, str(gib), stem], check=True)
    print(f"built in {time.perf_counter() - started:.0f} s", flush=True)
    sharded = stem + "_sharded"
    warm([stem + ".safetensors", stem + ".pt", *(os.path.join(sharded, n) for n in os.listdir(sharded))])
    results: dict[str, list[object]] = {}
    for round_ in range(3):
        for title, suffix, knobs, crc in VARIANTS:
            value = child(LOAD, {"path": stem + suffix, "knobs": knobs, "crc": crc})
            results.setdefault(title, []).append(value["gbps"] if isinstance(value, dict) else value)
            print(round_, title, value, flush=True)
        value = child(PEER_PROBE.format(code=LOADERS["instanttensor, buffered back end"][0]), {"stem": stem})
        results.setdefault("instanttensor buffered", []).append(value["gbps"] if isinstance(value, dict) else value)
        print(round_, "instanttensor", value, flush=True)
    print("SUMMARY (GB/s per round, median)")
    for title, values in results.items():
        numbers = [v for v in values if isinstance(v, float)]
        median = round(statistics.median(numbers), 2) if numbers else "n/a"
        print(f"{title:28s} {[round(v, 2) for v in numbers]} median {median}")


if __name__ == "__main__":
    main()
