"""Probe (round 8, issue #35): where a fresh process's GPU load of a safetensors file spends its time.

Run on a machine with a CUDA GPU, from the repository root, after ``bench/bench_gpu_load.py`` has built
its files (or let this build them):

    PYTHONPATH=. python bench/probe_gpu_round8.py --gib 8 --rounds 3

Parts (``--skip`` any):

* ``costs``: one fresh process each: pinning 12 x 8 MiB through torch, 96 MiB at once, an anonymous
  mapping (huge pages asked) registered with ``cuMemHostRegister``; ``torch.empty`` on the GPU for the
  file's storages with and without one reservation of the whole size first.
* ``reads``: the readers' half alone, page cache to pinned memory by 8, 12 and 16 threads.
* ``timeline``: ``ckptconv.load`` of the safetensors file in a fresh process with its phases timed
  (import, until the readers start, the readers, each staging buffer's arrival).
* ``loads``: whole loads in fresh processes, variants alternating with instanttensor's buffered back
  end; the first round of each variant checked bit for bit against ``safetensors.torch.load_file``.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu_load import PROBE_READS, alternating_loads, probe_files, probe_parser, run_probe

REGISTER = textwrap.dedent(
    """
    import ctypes, mmap
    _cuda = ctypes.CDLL("libcuda.so.1")
    _cuda.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    def registered(nbytes, huge=True):
        area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            area.madvise(mmap.MADV_HUGEPAGE)
        tensor = torch.frombuffer(area, dtype=torch.uint8)
        tensor.fill_(0)
        code = _cuda.cuMemHostRegister_v2(tensor.data_ptr(), nbytes, 0)
        assert code == 0, code
        tensor._ckptconv_area = area
        return tensor
    """
)

COSTS = (
    REGISTER
    + """
from safetensors import safe_open
what = ARGS["what"]
t = time.perf_counter()
if what == "torch pinned 12 x 8 MiB":
    keep = [torch.empty(8 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(12)]
elif what == "torch pinned 96 MiB":
    keep = torch.empty(96 << 20, dtype=torch.uint8, pin_memory=True)
elif what == "registered 12 x 8 MiB, huge pages":
    keep = [registered(8 << 20) for _ in range(12)]
elif what == "registered 96 MiB, huge pages":
    keep = registered(96 << 20)
elif what == "registered 96 MiB, small pages":
    keep = registered(96 << 20, huge=False)
elif what.startswith("gpu allocations"):
    with open(ARGS["path"], "rb") as f:
        n = int.from_bytes(f.read(8), "little"); header = json.loads(f.read(n))
    sizes = [v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"]
    if "reserved" in what:
        r = torch.empty(sum(sizes) + len(sizes) * 512, dtype=torch.uint8, device="cuda:0"); del r
    keep = [torch.empty(s, dtype=torch.uint8, device="cuda:0") for s in sizes]
    torch.cuda.synchronize()
report(ms=(time.perf_counter() - t) * 1e3)
"""
)

TIMELINE = """
t0 = time.perf_counter()
import ckptconv, ckptconv.gpu.transfer as tr, ckptconv.gpu.torch_tensors as tt
t1 = time.perf_counter()
marks = {}
staging, real_read = tr._staging, tt.read_spans
pins = []
def staged(n):
    b = staging(n); pins.append(round((time.perf_counter() - t1) * 1e3, 1)); return b
def read(*a, **k):
    marks["readers start"] = time.perf_counter() - t1
    real_read(*a, **k)
    marks["readers done"] = time.perf_counter() - t1
tr._staging, tt.read_spans = staged, read
state = ckptconv.load(ARGS["stem"] + ".safetensors", device="cuda:0")
torch.cuda.synchronize()
t2 = time.perf_counter()
n = sum(t.numel() * t.element_size() for t in state.values())
report(import_ms=(t1 - t0) * 1e3, **{k + " ms": round(v * 1e3, 1) for k, v in marks.items()},
       load_ms=(t2 - t1) * 1e3, gbps=n / (t2 - t0) / 1e9, pins_ready_ms=pins)
"""

LOAD = """
PATH = ARGS["stem"]
start = time.perf_counter()
import ckptconv, ckptconv.gpu.transfer as tr, ckptconv.gpu.torch_tensors as tt
tr.registered_staging = ARGS.get("registered", True)
tt.reserve_destinations = ARGS.get("reserve", True)
if ARGS.get("threads"):
    tr.MAX_GPU_THREADS = ARGS["threads"]
if ARGS.get("depth"):
    tr.DEPTH = ARGS["depth"]
if ARGS.get("piece"):
    tr.PIECE_BYTES = ARGS["piece"] << 20
state = ckptconv.load(PATH + ARGS["suffix"], device="cuda:0", check_crc=ARGS.get("crc", True))
torch.cuda.synchronize()
wall = time.perf_counter() - start
nbytes = sum(t.numel() * t.element_size() for t in state.values())
first = {"gbps": nbytes / wall / 1e9}
if ARGS.get("check"):
    from safetensors.torch import load_file
    ref = load_file(PATH + ".safetensors", device="cuda:0")
    assert set(ref) == set(state)
    same = [torch.equal(ref[k].reshape(-1).view(torch.uint8), state[k].reshape(-1).view(torch.uint8)) for k in ref]
    first["equal"] = f"{sum(same)} of {len(same)}"
report(first=first)
"""

OLD = {"registered": False, "reserve": False}
VARIANTS = [
    ("safetensors, round 8 (registered staging, reserved destinations)", ".safetensors", {}),
    ("safetensors, registered staging only", ".safetensors", {"reserve": False}),
    ("safetensors, reserved destinations only", ".safetensors", {"registered": False}),
    ("safetensors, round 7", ".safetensors", OLD),
    ("safetensors, round 8, 16 readers", ".safetensors", {"threads": 16}),
    (".pt, round 8", ".pt", {}),
    (".pt, round 7", ".pt", OLD),
    (".pt, round 8, check_crc=False", ".pt", {"crc": False}),
    ("sharded, round 8", "_sharded", {}),
    ("sharded, round 7", "_sharded", OLD),
]

SHAPES = [
    ("safetensors, 12 readers x 1 x 8 MiB (round 8)", ".safetensors", {}),
    ("safetensors, 16 x 1 x 8 MiB", ".safetensors", {"threads": 16}),
    ("safetensors, 12 x 2 x 8 MiB", ".safetensors", {"depth": 2}),
    ("safetensors, 16 x 2 x 8 MiB", ".safetensors", {"threads": 16, "depth": 2}),
    ("safetensors, 8 x 2 x 16 MiB", ".safetensors", {"threads": 8, "depth": 2, "piece": 16}),
    ("safetensors, 12 x 2 x 4 MiB", ".safetensors", {"depth": 2, "piece": 4}),
    ("safetensors, 16 x 2 x 4 MiB", ".safetensors", {"threads": 16, "depth": 2, "piece": 4}),
    (".pt, 12 x 1 x 8 MiB (round 8)", ".pt", {}),
    (".pt, 16 x 2 x 8 MiB", ".pt", {"threads": 16, "depth": 2}),
    ("sharded, 16 x 2 x 8 MiB", "_sharded", {"threads": 16, "depth": 2}),
]


def main() -> None:
    parser = probe_parser(__doc__, "costs reads timeline loads")
    parser.add_argument("--variants", nargs="*", default=None)
    parser.add_argument("--shapes", action="store_true", help="the readers' count, depth and piece size")
    args = parser.parse_args()
    stem, started, env = probe_files(args)
    if "costs" not in args.skip:
        whats = [
            "torch pinned 12 x 8 MiB",
            "torch pinned 96 MiB",
            "registered 12 x 8 MiB, huge pages",
            "registered 96 MiB, huge pages",
            "registered 96 MiB, small pages",
            "gpu allocations",
            "gpu allocations, reserved first",
        ]
        for round_ in range(2):
            for what in whats:
                print(f"{round_} cost {what}: {run_probe(COSTS, {'what': what, 'path': stem + '.safetensors'}, env)}")
    if "reads" not in args.skip:  # the readers' half alone: page cache to pinned memory, no GPU copies
        for round_ in range(2):
            for threads in (8, 12, 16):
                part = {"path": stem + ".safetensors", "threads": threads, "block": 8 << 20, "crc": None}
                result = run_probe(PROBE_READS, part, env)
                print(f"{round_} page cache to pinned, {threads} threads: {result}", flush=True)
    if "timeline" not in args.skip:
        for round_ in range(3):
            print(f"{round_} timeline: {run_probe(TIMELINE, {'stem': stem}, env)}", flush=True)
    if "loads" not in args.skip:
        variants = SHAPES if args.shapes else VARIANTS
        if args.variants:
            variants = [v for v in variants if any(s in v[0] for s in args.variants)]

        def load(suffix: str, extra: dict[str, object]) -> dict[str, object] | str:
            return run_probe(LOAD, {"stem": stem, "suffix": suffix, **extra}, env)

        alternating_loads(
            load,
            variants,
            rounds=args.rounds,
            budget=args.budget,
            started=started,
            stem=stem,
            env=env,
            reverse_odd=True,
        )
    print(json.dumps({"done": True}))


if __name__ == "__main__":
    main()
