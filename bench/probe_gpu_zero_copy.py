"""Probe (round 8, issue #35): can a GPU copy straight out of the page cache, with no staging copy?

A warm file mapped read-only and its pages registered with ``cudaHostRegister`` (read-only flag) could be
copied to the GPU by DMA, leaving the CPU's memory copy out. This times the registration itself (one
thread, then several at once) and whole 8 GiB loads done that way, against the readers of
``ckptconv.load``, in fresh processes. Run on a CUDA machine after ``bench/bench_gpu_load.py`` built its files:

    PYTHONPATH=. python bench/probe_gpu_zero_copy.py --gib 8 --rounds 3
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu_load import probe_files, probe_parser, run_probe

ZERO_COPY = """
import mmap
PATH = ARGS["stem"] + ".safetensors"
cudart = torch.cuda.cudart()
size = os.path.getsize(PATH)
fd = os.open(PATH, os.O_RDONLY)
area = mmap.mmap(fd, size, prot=mmap.PROT_READ)
host = torch.frombuffer(area, dtype=torch.uint8)
base = host.data_ptr()
chunk, threads = ARGS["chunk"] << 20, ARGS["threads"]
if ARGS["part"] == "register":
    n = min(size // chunk, threads * ARGS.get("per", 1))
    times = []
    def reg(i):
        for j in range(i, n, threads):
            t = time.perf_counter()
            code = cudart.cudaHostRegister(base + j * chunk, chunk, 8 | 1)
            t2 = time.perf_counter()
            assert int(code) == 0, int(code)
            cudart.cudaHostUnregister(base + j * chunk)
            times.append((t2 - t, time.perf_counter() - t2))
    start = time.perf_counter()
    pool = [threading.Thread(target=reg, args=(i,)) for i in range(threads)]
    [p.start() for p in pool]; [p.join() for p in pool]
    wall = time.perf_counter() - start
    report(gbps_registered=n * chunk / wall / 1e9, reg_ms=sorted(t[0] * 1e3 for t in times)[len(times) // 2],
           unreg_ms=sorted(t[1] * 1e3 for t in times)[len(times) // 2])
else:
    start = time.perf_counter()
    out = torch.empty(size, dtype=torch.uint8, device="cuda:0")
    positions = list(range(0, size, chunk)); lock = threading.Lock()
    def work():
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            while True:
                with lock:
                    if not positions: return
                    p = positions.pop(0)
                n = min(chunk, size - p)
                first = p - p % 4096
                span = n + (p - first)
                span += -span % 4096
                span = min(span, size - first) if first + span > size else span
                code = cudart.cudaHostRegister(base + first, span, 8 | 1)
                assert int(code) == 0, int(code)
                out[p:p + n].copy_(host[p:p + n], non_blocking=True)
                stream.synchronize()
                cudart.cudaHostUnregister(base + first)
    pool = [threading.Thread(target=work) for _ in range(threads)]
    [p.start() for p in pool]; [p.join() for p in pool]
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    ok = bool(torch.equal(out[-4096:].cpu(), host[-4096:]))
    report(gbps=size / wall / 1e9, tail_equal=ok)
"""

READERS = """
start = time.perf_counter()
import ckptconv
state = ckptconv.load(ARGS["stem"] + ".safetensors", device="cuda:0")
torch.cuda.synchronize()
n = sum(t.numel() * t.element_size() for t in state.values())
report(gbps=n / (time.perf_counter() - start) / 1e9)
"""


def main() -> None:
    args = probe_parser(__doc__, "register loads").parse_args()
    stem, _, env = probe_files(args)
    if "register" not in args.skip:
        for threads, chunk in ((1, 256), (1, 64), (8, 64), (12, 64), (12, 16)):
            part = {"stem": stem, "part": "register", "threads": threads, "chunk": chunk, "per": 4}
            print(f"register {threads} threads x {chunk} MiB: {run_probe(ZERO_COPY, part, env)}", flush=True)
    if "loads" not in args.skip:
        for round_ in range(args.rounds):
            for threads, chunk in ((12, 64), (16, 32), (12, 16)):
                part = {"stem": stem, "part": "load", "threads": threads, "chunk": chunk}
                print(f"{round_} zero-copy {threads} x {chunk} MiB: {run_probe(ZERO_COPY, part, env)}", flush=True)
            print(f"{round_} ckptconv readers: {run_probe(READERS, {'stem': stem}, env)}", flush=True)


if __name__ == "__main__":
    main()
