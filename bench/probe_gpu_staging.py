"""Probe: what the staging of a GPU load costs, and what it costs to skip it (round 3 of issue #15).

Run on a CUDA machine from the repository root (instanttensor installed for its row):

    PYTHONPATH=. python bench/probe_gpu_staging.py --gib 8 --rounds 3

Each line is a fresh process with CUDA initialised first and the files warm (the files of
bench_gpu_load.py: one 8 GiB fp32 checkpoint as safetensors, ``.pt`` and a 4-shard folder).

1. Pinning 128 MiB (8 readers x 2 x 8 MiB), ways to do it: PyTorch's host allocator
   (``cudaHostAlloc``), the same with ``pinned_use_cuda_host_register``, and an anonymous
   mapping (with and without ``MADV_HUGEPAGE``) touched then ``cudaHostRegister``-ed, each part timed.
2. Registering the page cache itself: windows of a warm file mapped read-only and
   ``cudaHostRegister``-ed (read-only), by 1 or 8 threads, in windows of 16 / 64 / 256 MiB.
3. Page cache to pinned memory by 8 and 16 threads, with and without the CRC-32 (ISA-L).
4. Whole ``ckptconv.load(..., device="cuda:0")`` loads, each after one thing done before the clock
   starts (the stream pool made, 8 threads' first copies, ckptconv's imports, device memory cached,
   a small GPU load), a second load in the same process, and a candidate fix, alternating with
   instanttensor's buffered back end in every round; in the first round every ckptconv load is
   compared bit for bit on the GPU with ``safetensors.torch.load_file``. Ends with the medians.

Every child runs with bytecode compiled first (``bench_gpu_load.compiled_env``); the round-3 calls
that measured 4. ran before that existed, so their children compiled ckptconv from source (which is
what the "imports" variant showed). Results: bench/results/bench_gpu_load_h200.md (round 3).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_load import BUILD, LOADERS, PEER_PROBE, PROBE_READS, compiled_env, run_probe, warm

PIN = """
total, piece = 128 << 20, 8 << 20
how = ARGS["how"]
out = {}
if how == "torch":  # PyTorch's caching host allocator: cudaHostAlloc, or cudaHostRegister with the conf
    t = time.perf_counter()
    keep = [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(total // piece)]
    out["alloc_s"] = time.perf_counter() - t
    t = time.perf_counter(); keep.append(torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True))
    out["1GiB_s"] = time.perf_counter() - t
else:
    for size, name in ((total, ""), (1 << 30, "1GiB_")):
        region = mmap.mmap(-1, size + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if how == "hugepage":
            region.madvise(mmap.MADV_HUGEPAGE)
        base = ctypes.addressof(ctypes.c_ubyte.from_buffer(region))
        address = base + (-base % (2 << 20))
        t = time.perf_counter()
        parts = 8
        def touch(i):
            ctypes.memset(address + i * size // parts, 0, size // parts)
        threads = [threading.Thread(target=touch, args=(i,)) for i in range(parts)]
        [x.start() for x in threads]; [x.join() for x in threads]
        out[name + "touch_s"] = time.perf_counter() - t
        t = time.perf_counter()
        err = int(torch.cuda.cudart().cudaHostRegister(address, size, 0))
        out[name + "register_s"] = time.perf_counter() - t
        out[name + "error"] = err
report(**out)
"""

REGISTER = """
path, window, n = ARGS["path"], ARGS["window"], ARGS["threads"]
import ckptconv._transfer as T
libc = T._libc(); cud = torch.cuda.cudart()
size = os.path.getsize(path); fd = os.open(path, os.O_RDONLY)
starts = list(range(0, size, window)); lock = threading.Lock()
reg, unreg, errors = [0.0], [0.0], []
def work():
    while True:
        with lock:
            if not starts: return
            s = starts.pop(0)
        length = -(-min(window, size - s) // 4096) * 4096
        a = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, s)
        t = time.perf_counter(); e = int(cud.cudaHostRegister(a, length, 9)); reg[0] += time.perf_counter() - t
        if e: errors.append(e)
        else:
            t = time.perf_counter(); cud.cudaHostUnregister(a); unreg[0] += time.perf_counter() - t
        libc.munmap(a, length)
t = time.perf_counter(); threads = [threading.Thread(target=work) for _ in range(n)]
[x.start() for x in threads]; [x.join() for x in threads]
wall = time.perf_counter() - t
report(gbps=size / wall / 1e9, register_gbps_per_thread=size / reg[0] / 1e9, unregister_s=unreg[0], errors=errors[:3])
"""

H2D = """
total, block = ARGS["total"], 8 << 20
out = torch.empty(total, dtype=torch.uint8, device="cuda:0")
host = torch.ones(16 * block, dtype=torch.uint8, pin_memory=True)
def go():
    for j, p in enumerate(range(0, total, block)):
        n = min(block, total - p); out[p:p + n].copy_(host[(j % 16) * block:][:n], non_blocking=True)
    torch.cuda.synchronize()
go(); t = time.perf_counter(); go()
report(gbps=total / (time.perf_counter() - t) / 1e9)
"""

LOAD = """
import ckptconv, ckptconv._transfer as T, ckptconv._torch as TT
for name, value in ARGS["knobs"].items():
    setattr(T, name, value)
phases = {}
def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter(); r = fn(*a, **k)
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - t
        return r
    return wrapper
PREWARM = ARGS.get("prewarm")  # what runs before the clock starts: which first-use cost is it?
if PREWARM == "stream":  # PyTorch's stream pool made (the first torch.cuda.Stream of a process)
    torch.cuda.Stream(); torch.cuda.synchronize()
elif PREWARM == "threads":  # 8 threads, each with a stream and one copy from pinned memory
    def first_copy():
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            host = torch.ones(1 << 20, dtype=torch.uint8, pin_memory=True)
            torch.empty(1 << 20, dtype=torch.uint8, device="cuda:0").copy_(host, non_blocking=True)
            event = torch.cuda.Event(); event.record(stream); event.synchronize()
    threads = [threading.Thread(target=first_copy) for _ in range(8)]
    [x.start() for x in threads]; [x.join() for x in threads]
elif PREWARM == "imports":  # ckptconv's modules imported by a load to the CPU
    from safetensors.torch import save_file
    save_file({"w": torch.ones(1 << 10)}, "/tmp/prewarm_cpu.safetensors"); ckptconv.load("/tmp/prewarm_cpu.safetensors")
elif PREWARM == "device":  # device memory cached by PyTorch's allocator
    block = torch.empty(9 << 30, dtype=torch.uint8, device="cuda:0"); del block; torch.cuda.synchronize()
elif PREWARM == "load":  # a small GPU load first
    from safetensors.torch import save_file
    save_file({"w": torch.ones(1 << 20)}, "/tmp/prewarm.safetensors")
    ckptconv.load("/tmp/prewarm.safetensors", device="cuda:0"); torch.cuda.synchronize()
if ARGS.get("side_stream"):  # candidate: the stream pool made on a side thread while the file is parsed
    original = TT.to_torch
    def to_torch(refs, *, device=None, crcs=None):
        if device is not None and torch.device(device).type == "cuda":
            threading.Thread(target=torch.cuda.Stream, args=(torch.device(device),), daemon=True).start()
        return original(refs, device=device, crcs=crcs)
    TT.to_torch = to_torch
T._staging = timed("pinning", T._staging)
TT.read_spans = timed("readers", TT.read_spans)
walls = []
for _ in range(2 if ARGS.get("twice") else 1):
    state = None
    torch.cuda.synchronize()
    start = time.perf_counter()
    state = ckptconv.load(ARGS["path"], device="cuda:0", check_crc=ARGS.get("crc", True))
    torch.cuda.synchronize()
    walls.append(time.perf_counter() - start)
nbytes = sum(t.numel() * t.element_size() for t in state.values())
out = {"gbps": nbytes / walls[0] / 1e9, "wall": walls[0], **{k: round(v, 4) for k, v in phases.items()}}
if len(walls) > 1:
    out["second_gbps"] = nbytes / walls[1] / 1e9
import resource
out["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
if ARGS.get("check"):
    from safetensors.torch import load_file
    ref = load_file(ARGS["stem"] + ".safetensors", device="cuda:0")
    assert set(ref) == set(state), "keys differ"
    equal = sum(
        got.dtype == want.dtype and got.shape == want.shape
        and torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
        for got, want in ((state[k], ref[k]) for k in ref)
    )
    out["bit_exact"] = f"{equal}/{len(ref)}"
report(**out)
"""

HOST_REGISTER = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"

# title, file suffix, knobs of ckptconv._transfer, extra arguments. Round 3's first two calls also ran
# prototypes not kept (bench/results/bench_gpu_load_h200.md): loads that registered the page cache
# itself with CUDA instead of staging, and a pool of hugepage staging buffers registered with CUDA.
VARIANTS: list[tuple[str, str, dict[str, object], dict[str, object]]] = [
    ("st default", ".safetensors", {}, {}),
    ("st after the stream pool is made", ".safetensors", {}, {"prewarm": "stream"}),
    ("st after 8 threads copied once", ".safetensors", {}, {"prewarm": "threads"}),
    ("st after ckptconv's imports", ".safetensors", {}, {"prewarm": "imports"}),
    ("st after device memory is cached", ".safetensors", {}, {"prewarm": "device"}),
    ("st after a small GPU load", ".safetensors", {}, {"prewarm": "load"}),
    ("st, stream pool made on a side thread", ".safetensors", {}, {"side_stream": True}),
    ("st twice in process", ".safetensors", {}, {"twice": True}),
]


ENV: dict[str, str] = {}


def child(code: str, args: dict[str, object], env: str | None = None) -> dict[str, object] | str:
    environ = dict(ENV or os.environ)
    if env:
        environ["PYTORCH_CUDA_ALLOC_CONF"] = env
    return run_probe(code, args, environ)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--no-micro", action="store_true")
    parser.add_argument("--only", nargs="*", help="substrings of the load variants to run")
    args = parser.parse_args()
    stem = str(args.dir / f"gpu_bench_{args.gib:g}gib")
    if not os.path.exists(stem + ".safetensors"):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", BUILD, str(args.gib), stem], check=True)
        print(f"built in {time.perf_counter() - started:.0f} s", flush=True)
    ENV.update(compiled_env())  # bytecode compiled first, as a pip install leaves it
    st, pt, sharded = stem + ".safetensors", stem + ".pt", stem + "_sharded"
    every = [st, pt, *(os.path.join(sharded, n) for n in sorted(os.listdir(sharded)))]
    warm(every)
    if not args.no_micro:
        print("h2d from pinned, 8 MiB blocks:", child(H2D, {"total": os.path.getsize(st)}), flush=True)
        print("pin 128 MiB, torch:", child(PIN, {"how": "torch"}), flush=True)
        print("pin 128 MiB, torch host-register conf:", child(PIN, {"how": "torch"}, HOST_REGISTER), flush=True)
        print("pin 128 MiB, mmap + touch + register:", child(PIN, {"how": "mmap"}), flush=True)
        print("pin 128 MiB, hugepage mmap + touch + register:", child(PIN, {"how": "hugepage"}), flush=True)
        for window, threads in ((64 << 20, 1), (16 << 20, 8), (64 << 20, 8), (256 << 20, 8), (64 << 20, 16)):
            result = child(REGISTER, {"path": st, "window": window, "threads": threads})
            print(f"register page cache, {window >> 20} MiB windows x{threads}:", result, flush=True)
        for threads in (8, 16):
            for crc in (False, True):
                result = child(
                    PROBE_READS, {"path": pt, "threads": threads, "block": 8 << 20, "crc": "ckptconv" if crc else None}
                )
                print(f"pread to pinned x{threads}, crc={crc}:", result, flush=True)
    variants = [v for v in VARIANTS if not args.only or any(s in v[0] for s in args.only)]
    results: dict[str, list[float]] = {}
    seconds: dict[str, list[float]] = {}
    peer = LOADERS["instanttensor, buffered back end"][0]
    for round_ in range(args.rounds):
        for title, suffix, knobs, extra in variants:  # the files stay warm: nothing here evicts them
            params = {"path": stem + suffix, "stem": stem, "knobs": knobs, "check": round_ == 0, **extra}
            value = child(LOAD, params, str(extra["env"]) if "env" in extra else None)
            print(round_, title, value, flush=True)
            if isinstance(value, dict):
                results.setdefault(title, []).append(float(value["gbps"]))  # type: ignore[arg-type]
                if "second_gbps" in value:
                    seconds.setdefault(title, []).append(float(value["second_gbps"]))  # type: ignore[arg-type]
        value = child(PEER_PROBE.format(code=peer), {"stem": stem})
        print(round_, "instanttensor buffered", value, flush=True)
        if isinstance(value, dict):
            results.setdefault("instanttensor buffered", []).append(float(value["gbps"]))  # type: ignore[arg-type]
    print("SUMMARY (GB/s per round, median, x instanttensor buffered)")
    peer_median = statistics.median(results["instanttensor buffered"]) if "instanttensor buffered" in results else 0
    for title, values in results.items():
        median = statistics.median(values)
        ratio = f"{median / peer_median:.2f}" if peer_median else "n/a"
        print(f"{title:40s} {[round(v, 2) for v in values]} median {median:.2f} x{ratio}")
    for title, values in seconds.items():
        print(f"{title + ' (second load)':40s} {[round(v, 2) for v in values]} median {statistics.median(values):.2f}")


if __name__ == "__main__":
    main()
