"""Probe: the readers' per-piece Python work in a GPU load (round 6 of issue #15).

Run on a CUDA machine from the repository root (instanttensor installed for its row):

    PYTHONPATH=. python bench/probe_gpu_round6.py --gib 8 --rounds 5

Question: does the Python work each reader does per 8 MiB piece (slicing two tensors, ``copy_``
through torch's dispatcher, a new CUDA event, its record) hold the GIL long enough, across 12
readers and ~1,000 pieces, to slow the load? The first call of this probe replaced that work, by
monkeypatching, with calls into the CUDA driver through ctypes (``cuMemcpyHtoDAsync_v2`` from the
pinned buffer's address to the destination's, ``cuEventRecord`` / ``cuEventSynchronize`` on one
event per buffer, made once), which release the GIL; that is now ``ckptconv._cuda_driver``, and the
variants here compare it with ``_transfer.driver_copies = False`` (torch's ``copy_``). Timelines (probe_gpu_round4's)
show the time each reader spends in ``upload``; whole loads alternate with main and with
instanttensor's buffered back end in every round, and the first round compares every load bit for
bit with ``safetensors.torch.load_file``.

Results: bench/results/bench_gpu_load_h200.md (round 6).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_load import BUILD, LOADERS, PEER_PROBE, compiled_env, run_probe, warm
from probe_gpu_round5 import LOAD as LOAD5

LOAD = LOAD5

# (title, file suffix, LOAD arguments besides the path): the landed code against its torch copies.
VARIANTS: list[tuple[str, str, dict[str, object]]] = [
    ("st, driver copies", ".safetensors", {}),
    ("st, torch copies", ".safetensors", {"knobs": {"driver_copies": False}}),
    ("pt crc on the GPU, driver copies", ".pt", {}),
    ("pt crc on the GPU, torch copies", ".pt", {"knobs": {"driver_copies": False}}),
    ("sharded (4 files), driver copies", "_sharded", {}),
]
# --pieces: the staging pieces' size, now that a piece costs the readers less Python (pinning 12 x 8 MiB
# takes 20-90 ms of a 250-330 ms load, during which readers wait for their buffers).
# Call 3 ran 8, 4 and 2 MiB (safetensors 33.88 / 25.03 / 16.65 GB/s, .pt 31.52 / 25.07 at 8 / 4): smaller
# pieces lose. Call 4 runs the larger ones below.
PIECES: list[tuple[str, str, dict[str, object]]] = [
    ("st, 8 MiB pieces x 12 readers (main)", ".safetensors", {}),
    ("st, 16 MiB pieces x 12 readers", ".safetensors", {"knobs": {"PIECE_BYTES": 16 << 20}}),
    ("st, 16 MiB pieces x 8 readers", ".safetensors", {"knobs": {"PIECE_BYTES": 16 << 20, "MAX_GPU_THREADS": 8}}),
    ("pt crc on the GPU, 8 MiB pieces x 12 readers (main)", ".pt", {}),
    ("pt crc on the GPU, 16 MiB pieces x 12 readers", ".pt", {"knobs": {"PIECE_BYTES": 16 << 20}}),
]
TIMELINES: list[tuple[str, str, dict[str, object]]] = [
    ("pt crc on the GPU, driver copies, twice", ".pt", {"twice": True}),
    ("pt crc on the GPU, torch copies, twice", ".pt", {"twice": True, "knobs": {"driver_copies": False}}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--skip", nargs="*", default=[], help="parts to skip: timelines, loads")
    parser.add_argument("--budget", type=float, default=1e9, help="seconds after which no new round starts")
    parser.add_argument("--pieces", action="store_true", help="compare staging piece sizes instead")
    args = parser.parse_args()
    variants = PIECES if args.pieces else VARIANTS
    stem = str(args.dir / f"gpu_bench_{args.gib:g}gib")
    started = time.perf_counter()
    if not os.path.exists(stem + ".safetensors"):
        subprocess.run([sys.executable, "-c", BUILD, str(args.gib), stem], check=True)
    print(f"built in {time.perf_counter() - started:.0f} s", flush=True)
    env = compiled_env()
    st = stem + ".safetensors"
    sharded = stem + "_sharded"
    warm([st, stem + ".pt", *(os.path.join(sharded, name) for name in sorted(os.listdir(sharded)))])

    def load(suffix: str, extra: dict[str, object]) -> dict[str, object] | str:
        return run_probe(LOAD, {"path": stem + suffix, "reference": st, "knobs": {}, **extra}, env)

    if "timelines" not in args.skip:
        for title, suffix, extra in TIMELINES:
            print(f"timeline {title}: {json.dumps(load(suffix, extra))}", flush=True)
    if "loads" in args.skip:
        return
    speeds: dict[str, list[float]] = {}
    peer = PEER_PROBE.format(code=LOADERS["instanttensor, buffered back end"][0])
    for round_ in range(args.rounds):
        if time.perf_counter() - started > args.budget:
            print(f"budget spent: {round_} rounds", flush=True)
            break
        order = variants if round_ % 2 == 0 else variants[::-1]
        for title, suffix, extra in order:
            value = load(suffix, {**extra, "check": round_ == 0})
            if isinstance(value, dict):
                speeds.setdefault(title, []).append(value["first"]["gbps"])  # type: ignore[index]
                value = {k: value["first"][k] for k in ("gbps", "open", "read_spans", "upload_ms_per_reader")} | {  # type: ignore[index]
                    "bit_exact": value.get("bit_exact")
                }
            print(f"{round_} {title}: {json.dumps(value)}", flush=True)
        value = run_probe(peer, {"stem": stem}, env)
        if isinstance(value, dict):
            speeds.setdefault("instanttensor buffered", []).append(value["gbps"])  # type: ignore[arg-type]
        print(f"{round_} instanttensor buffered: {value}", flush=True)
    peer_median = statistics.median(speeds.get("instanttensor buffered", [float("nan")]))
    print("SUMMARY (GB/s per round, median, x instanttensor buffered)")
    for title, values in speeds.items():
        median = statistics.median(values)
        print(f"{title:50s} {[round(v, 2) for v in values]} median {median:.2f} x{median / peer_median:.2f}")
    print(f"total {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
