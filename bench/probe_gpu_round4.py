"""Probe: where a GPU load's time goes, reader by reader, and the `.pt` / sharded / first-load gaps
(round 4 of issue #15).

Run on a CUDA machine from the repository root (instanttensor installed for its row):

    PYTHONPATH=. python bench/probe_gpu_round4.py --gib 8 --rounds 5

Each line is a fresh process with CUDA initialised first, the files warm and bytecode compiled
(``bench_gpu_load.compiled_env``); the files are bench_gpu_load.py's (one 8 GiB fp32 checkpoint as
safetensors, ``.pt`` and a 4-shard folder).

1. Page cache to pinned memory with the CRC-32 (ISA-L) of each 8 MiB block, taken on the whole
   block after its read or in steps right after each step's read, by 8 and 16 threads.
2. Timelines: ``ckptconv.load(..., device="cuda:0")`` with every step of the readers timed from the
   load's start (pinning, the wait for the first buffer, reads, CRCs, waits for copies, copies
   issued), a first load and a second one in the same process.
3. Whole loads, variants alternating with instanttensor's buffered back end in every round; in the
   first round every ckptconv load is compared bit for bit on the GPU with
   ``safetensors.torch.load_file``. Ends with the medians.

Results: bench/results/bench_gpu_load_h200.md (round 4).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_load import PROBE_READS, alternating_loads, probe_files, probe_parser, run_probe

# The readers' every step timed (events of the reader threads, from the load's start), knobs of
# ckptconv._transfer set from ARGS["knobs"], a load repeated in the same process when ARGS["twice"],
# the staging pinned before the clock when ARGS["prepin"] (how many buffers).
LOAD = """
import ckptconv, ckptconv._transfer as T, ckptconv._torch as TT, ckptconv.loading as L, ckptconv.integrity as I
for name, value in ARGS["knobs"].items():
    setattr(T, name, value)
if ARGS.get("prepin"):
    keep = [torch.empty(T.PIECE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(ARGS["prepin"])]
    del keep
clock = time.perf_counter
EVENTS = []
def wrap(owner, name, what):
    fn = getattr(owner, name)
    def timed(*a, **k):
        t = clock(); r = fn(*a, **k)
        EVENTS.append((threading.current_thread().name, what, t, clock()))
        return r
    setattr(owner, name, timed)
for owner, name, what in ((T, "_staging", "pin"), (T, "read_exactly_into", "read"), (T, "_read_direct", "read"),
        (T, "crc32", "crc"), (T._Worker, "_free_slot", "wait_copy"), (T._Worker, "_upload", "upload"),
        (T._Pinned, "first", "wait_pin"), (T._Worker, "run", "piece"), (T, "resident_fraction", "resident"),
        (TT, "read_spans", "read_spans"), (TT, "to_torch", "to_torch"), (L, "open", "open"),
        (I, "check_record_crcs", "crc_check")):
    wrap(owner, name, what)

def summary(t0, wall):
    mine = [e for e in EVENTS if e[2] >= t0]
    out = {}
    for what in ("open", "to_torch", "read_spans", "crc_check"):
        spans = [(a - t0, b - a) for _, w, a, b in mine if w == what]
        if spans:
            out[what] = [round(spans[0][0] * 1e3, 1), round(sum(d for _, d in spans) * 1e3, 1)]  # start, ms
    pins = [b - t0 for _, w, a, b in mine if w == "pin"]
    if pins:
        out["pinned_ready_ms"] = [round(p * 1e3, 1) for p in sorted(pins)]
    readers = sorted({n for n, w, *_ in mine if w == "piece"})
    out["readers"] = len(readers)
    firsts = [min(a for n, w, a, b in mine if n == r and w == "piece") - t0 for r in readers]
    lasts = [max(b for n, w, a, b in mine if n == r and w == "piece") - t0 for r in readers]
    out["first_piece_ms"] = [round(min(firsts) * 1e3, 1), round(max(firsts) * 1e3, 1)]
    out["last_piece_ms"] = [round(min(lasts) * 1e3, 1), round(max(lasts) * 1e3, 1)]
    for what in ("wait_pin", "read", "crc", "wait_copy", "upload", "piece", "resident"):
        total = sum(b - a for n, w, a, b in mine if w == what)
        out[what + "_ms_per_reader"] = round(total / max(1, len(readers)) * 1e3, 1)
    ends = sorted(b - t0 for n, w, a, b in mine if w == "piece")
    out["pieces_done_by_ms"] = {ms: sum(1 for e in ends if e * 1e3 <= ms) for ms in (25, 50, 100, 150, 200, 300)}
    out["pieces"] = len(ends)
    return out

def one_load():
    t0 = clock()
    state = ckptconv.load(ARGS["path"], device="cuda:0", check_crc=ARGS.get("crc", True))
    torch.cuda.synchronize()
    wall = clock() - t0
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return state, {"gbps": round(nbytes / wall / 1e9, 2), "wall_ms": round(wall * 1e3, 1), **summary(t0, wall)}

state, first = one_load()
result = {"first": first}
if ARGS.get("check"):
    from safetensors.torch import load_file
    ref = load_file(ARGS["reference"], device="cuda:0")
    same = sum(1 for k, v in ref.items() if k in state and state[k].dtype == v.dtype and state[k].shape == v.shape
               and torch.equal(state[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)))
    result["bit_exact"] = f"{same}/{len(ref)}" + ("" if same == len(ref) == len(state) else " MISMATCH")
    del ref
if ARGS.get("twice"):
    del state; torch.cuda.synchronize()
    state, result["second"] = one_load()
report(**result)
"""

# (title, file suffix, LOAD arguments besides the path)
# Round 4 ran five sets on one H200 (bench/results/bench_gpu_load_h200.md): call 1 (commit 51ee2c4)
# the pinning, 4 MiB pieces, the .pt CRC in 1 MiB / 256 KiB steps, .pt without CRC and the sharded
# folder's locks; call 2 (commit 5a4691d) a checking-thread pool for the CRC and the staging pinned
# while the tensors are allocated, against main; call 3 (commit 07c47cd) readers with one buffer
# each and the staging pinned before the clock; call 4 (commit 24f1bd6) one buffer per reader, 12
# readers (16 for .pt) against main's 8 x 2 (16 x 2 for .pt), and .pt with 12 readers; call 5 (this
# list) 12 readers for every GPU load.
VARIANTS: list[tuple[str, str, dict[str, object]]] = [
    ("st (12 readers x 1 buffer)", ".safetensors", {}),
    ("pt crc (12 readers x 1 buffer)", ".pt", {}),
    ("pt crc, 16 readers x 1 buffer", ".pt", {"knobs": {"MAX_GPU_THREADS": 16}}),
    ("pt crc, main's 16 readers x 2 buffers", ".pt", {"knobs": {"MAX_GPU_THREADS": 16, "DEPTH": 2}}),
]

TIMELINES: list[tuple[str, str, dict[str, object]]] = []


def main() -> None:
    parser = probe_parser(__doc__, "reads, timelines, loads")
    args = parser.parse_args()
    stem, started, env = probe_files(args)
    st, pt = stem + ".safetensors", stem + ".pt"

    if "reads" not in args.skip:
        for threads in (8, 16):
            for crc, step in ((None, 0), ("ckptconv", 0), ("ckptconv", 1 << 20), ("ckptconv", 256 << 10)):
                value = run_probe(
                    PROBE_READS, {"path": pt, "threads": threads, "block": 8 << 20, "crc": crc, "step": step}, env
                )
                print(f"pread x{threads} 8 MiB, crc={crc} step={step >> 10} KiB: {value}", flush=True)

    def load(suffix: str, extra: dict[str, object]) -> dict[str, object] | str:
        arguments = {"path": stem + suffix, "reference": st, "knobs": {}, **extra}
        return run_probe(LOAD, arguments, env)

    if "timelines" not in args.skip:
        for title, suffix, extra in TIMELINES:
            print(f"timeline {title}: {json.dumps(load(suffix, extra))}", flush=True)

    if "loads" in args.skip:
        return
    alternating_loads(load, VARIANTS, rounds=args.rounds, budget=args.budget, started=started, stem=stem, env=env)


if __name__ == "__main__":
    main()
