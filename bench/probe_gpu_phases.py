"""Probe: where the time of a GPU load goes, phase by phase (pinned allocation, device allocation,
page-cache reads by N threads in blocks of B, host-to-device copies on K streams, whole loads with
the knobs of ckptconv._transfer turned). Run on a CUDA machine from the repository root:

    PYTHONPATH=. python bench/probe_gpu_phases.py --gib 8

Builds (or reuses) the files of bench_gpu_load.py. Every measurement runs in a fresh process with
CUDA initialised first, the files warm. Prints one table per phase; --json writes every number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_load import BUILD, LOADERS, PEER_PROBE, PROBE_READS, run_probe, warm

PINNED = """
out = {}
t = time.perf_counter(); keep = [torch.empty(8 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(32)]
out["32 x 8 MiB, one thread"] = time.perf_counter() - t
t = time.perf_counter(); keep.append(torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True))
out["1 x 256 MiB"] = time.perf_counter() - t
t = time.perf_counter(); keep.append(torch.empty(512 << 20, dtype=torch.uint8, pin_memory=True))
out["1 x 512 MiB"] = time.perf_counter() - t
t = time.perf_counter(); keep.append(torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True))
out["1 x 1 GiB"] = time.perf_counter() - t
def grab(): keep.append(torch.empty((8 << 20) + 4096, dtype=torch.uint8, pin_memory=True))
t = time.perf_counter(); threads = [threading.Thread(target=grab) for _ in range(32)]
[x.start() for x in threads]; [x.join() for x in threads]
out["32 x 8 MiB, 32 threads at once"] = time.perf_counter() - t
report(**out)
"""

DEVALLOC = """
import ckptconv
sizes = [ref.storage.nbytes for _, ref in ckptconv.open(ARGS["path"]).tensors()]
t = time.perf_counter()
if ARGS["reserve"]:  # one block, freed, that the caching allocator then carves the tensors from
    block = torch.empty(sum(-(-n // 512) * 512 for n in sizes if n > 1 << 20), dtype=torch.uint8, device="cuda:0")
    del block
tensors = [torch.empty(n, dtype=torch.uint8, device="cuda:0") for n in sizes]; torch.cuda.synchronize()
report(seconds=time.perf_counter() - t, count=len(sizes), gib=sum(sizes) / 2**30)
"""

H2D = """
streams_n, block, total = ARGS["streams"], ARGS["block"], ARGS["total"]
out = torch.empty(total, dtype=torch.uint8, device="cuda:0")
host = torch.ones(streams_n * 2 * block, dtype=torch.uint8, pin_memory=True)
streams = [torch.cuda.Stream() for _ in range(streams_n)]
def go():
    for j, p in enumerate(range(0, total, block)):
        s = j % streams_n
        with torch.cuda.stream(streams[s]):
            n = min(block, total - p)
            src = host[(s * 2 + (j // streams_n) % 2) * block:][:n]
            out[p:p + n].copy_(src, non_blocking=True)
    torch.cuda.synchronize()
go()
t = time.perf_counter(); go()
report(gbps=total / (time.perf_counter() - t) / 1e9)
"""

LOAD = """
import ckptconv, ckptconv._transfer as T, ckptconv._torch as TT, ckptconv.loading as L, ckptconv.integrity as I
for name, value in ARGS["knobs"].items():
    setattr(T, name, value)
phases = {}
def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter(); r = fn(*a, **k); torch.cuda.synchronize()
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - t
        return r
    return wrapper
T._staging = timed("pinning (its own thread)", T._staging)
TT.read_spans = timed("readers", TT.read_spans)
I.check_record_crcs = timed("crc check", I.check_record_crcs)
L.open = timed("open+parse", L.open)
if ARGS.get("old"):
    sys.path.insert(0, ARGS["old"]); import old_transfer
    TT.read_spans = timed("readers", lambda work, crcs=None: old_transfer.read_spans(work))
start = time.perf_counter()
state = ckptconv.load(ARGS["path"], device="cuda:0", check_crc=ARGS.get("crc", True))
torch.cuda.synchronize()
wall = time.perf_counter() - start
nbytes = sum(t.numel() * t.element_size() for t in state.values())
report(gbps=nbytes / wall / 1e9, wall=wall, **{k: round(v, 4) for k, v in phases.items()})
"""

child = run_probe


def measure_phases(show: Callable[[str, object], None], stem: str, gib: float) -> None:
    """Each phase alone: pinning, device allocation, host-to-device copies, page-cache reads."""
    st, pt = stem + ".safetensors", stem + ".pt"
    show("pinned allocation (s)", child(PINNED, {}))
    for reserve in (False, True):
        show(f"device allocation, reserve={reserve}", child(DEVALLOC, {"path": st, "reserve": reserve}))
    for streams, block in ((1, 8 << 20), (16, 8 << 20), (16, 32 << 20)):
        total = int(gib * 2**30)
        show(
            f"h2d streams={streams} block={block >> 20}MiB",
            child(H2D, {"streams": streams, "block": block, "total": total}),
        )
    for threads, block in ((8, 8 << 20), (16, 8 << 20), (16, 64 << 20), (32, 8 << 20), (32, 32 << 20)):
        show(
            f"pread threads={threads} block={block >> 20}MiB",
            child(PROBE_READS, {"path": st, "threads": threads, "block": block, "crc": None}),
        )
    for threads in (16, 32):
        show(
            f"pread+crc32 threads={threads} block=8MiB",
            child(PROBE_READS, {"path": pt, "threads": threads, "block": 8 << 20, "crc": "zlib"}),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=8)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--old", help="folder holding old_transfer.py (a previous _transfer) to time beside")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--loads-only", action="store_true", help="only the whole loads, one round")
    args = parser.parse_args()
    stem = str(args.dir / f"gpu_bench_{args.gib:g}gib")
    if not os.path.exists(stem + ".safetensors"):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", BUILD, str(args.gib), stem], check=True)
        print(f"built in {time.perf_counter() - started:.0f} s", flush=True)
    st, pt, sharded = stem + ".safetensors", stem + ".pt", stem + "_sharded"
    warm([st, pt, *(os.path.join(sharded, n) for n in os.listdir(sharded))])
    results: dict[str, object] = {}

    def show(title: str, value: object) -> None:
        results[title] = value
        print(f"{title}: {value}", flush=True)

    phases = not args.loads_only
    if phases:
        measure_phases(show, stem, args.gib)
    variants: list[tuple[str, str, dict[str, object], bool]] = [
        ("safetensors 8MiB x16", st, {}, True),
        ("safetensors 8MiB x8", st, {"MAX_THREADS": 8}, True),
        ("safetensors 4MiB x16", st, {"PIECE_BYTES": 4 << 20}, True),
        ("safetensors 8MiB x16 depth3", st, {"DEPTH": 3}, True),
        ("safetensors 4MiB x32", st, {"MAX_THREADS": 32, "PIECE_BYTES": 4 << 20}, True),
        ("safetensors 32MiB x16", st, {"PIECE_BYTES": 32 << 20}, True),
        ("pt crc 8MiB x16", pt, {}, True),
        ("pt no crc 8MiB x16", pt, {}, False),
        ("sharded 8MiB x16", sharded, {}, True),
    ]
    if args.old:
        show(
            "safetensors OLD _transfer (before this probe)",
            child(LOAD, {"path": st, "knobs": {}, "old": args.old}),
        )
    for rounds in range(2 if phases else 1):
        for title, path, knobs, crc in variants:
            show(f"load {title} #{rounds}", child(LOAD, {"path": path, "knobs": knobs, "crc": crc}))
        for name in ("instanttensor, buffered back end",):
            show(f"peer {name} #{rounds}", child(PEER_PROBE.format(code=LOADERS[name][0]), {"stem": stem}))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
