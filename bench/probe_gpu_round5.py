"""Probe: the CRC-32 of `.pt` records taken on the GPU after their copies (round 5 of issue #15).

Run on a CUDA machine from the repository root (instanttensor installed for its row):

    PYTHONPATH=. python bench/probe_gpu_round5.py --gib 8 --rounds 5

Each line is a fresh process with CUDA initialised first, the files warm and bytecode compiled
(``bench_gpu_load.compiled_env``); the files are bench_gpu_load.py's (one 8 GiB fp32 checkpoint as
safetensors, ``.pt`` and a 4-shard folder).

1. The kernel (``ckptconv._gpu_crc``): the time to compile and load it in a fresh process, its
   CRC-32s against zlib's for odd lengths and start addresses (every value compared), and the time
   of the CRC-32s of 8 GiB of records laid out as the benchmark's checkpoint (128 x 64 MiB,
   128 x 16 KiB, 128 x 8 bytes), against ISA-L on one host thread.
2. Timelines (probe_gpu_round4's), with the kernel's compile thread and the GPU CRC-32s timed.
3. Whole loads, variants alternating with instanttensor's buffered back end in every round; in the
   first round every ckptconv load is compared bit for bit on the GPU with
   ``safetensors.torch.load_file``. Ends with the medians.

Results: bench/results/bench_gpu_load_h200.md (round 5).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_load import alternating_loads, probe_files, probe_parser, run_probe
from probe_gpu_round4 import LOAD as LOAD4

KERNEL = """
import random
import numpy as np
import ckptconv._gpu_crc as G
from ckptconv.integrity import crc32 as host_crc
t = time.perf_counter(); k = G.kernel(0); compile_s = time.perf_counter() - t
t = time.perf_counter(); G.kernel(0); again_s = time.perf_counter() - t
assert k is not None, "no kernel: " + G.failures.get(0, "?")
rng = random.Random(0)
buf = torch.randint(0, 256, (1 << 26,), dtype=torch.uint8, device="cuda:0")
host = buf.cpu().numpy().tobytes()
C = G.CHUNK
cases = [(o, n) for o in range(33) for n in (1, 2, 3, 15, 16, 17, 31, 32, 33, 255, 4096)]
cases += [(rng.randrange(64), rng.choice([C - 1, C, C + 1, 2 * C, 3 * C + 17, rng.randrange(1, 5_000_000)]))
          for _ in range(300)]
got = G.record_crcs([buf[o:o + n] for o, n in cases], k)
bad = sum(g != zlib.crc32(host[o:o + n]) for g, (o, n) in zip(got, cases))
del buf
big = torch.randint(0, 256, (8 << 30,), dtype=torch.uint8, device="cuda:0")
outs, at = [], 0
for i in range(128):
    for n in (64 << 20, 16 << 10, 8):
        outs.append(big[at:at + n]); at += -(-n // 512) * 512
times = []
for _ in range(4):
    torch.cuda.synchronize(); t = time.perf_counter()
    crcs = G.record_crcs(outs, k)
    times.append(time.perf_counter() - t)
nbytes = sum(o.numel() for o in outs)
checked = 0
for i in range(0, 384, 37):
    assert crcs[i] == host_crc(outs[i].cpu().numpy().data), i
    checked += 1
sample = outs[0].cpu().numpy()
t = time.perf_counter()
for _ in range(8): host_crc(sample.data)
isal_gbps = 8 * sample.nbytes / (time.perf_counter() - t) / 1e9
report(compile_s=round(compile_s, 4), cached_s=round(again_s, 6), sweep=f"{len(cases) - bad}/{len(cases)} equal zlib",
       gpu_crc_ms=[round(x * 1e3, 2) for x in times], gpu_gbps=round(nbytes / min(times[1:]) / 1e9, 1),
       checked_8gib=f"{checked} records equal ISA-L", isal_one_thread_gbps=round(isal_gbps, 1))
"""

# probe_gpu_round4's timed load, with the kernel's compilation and the GPU CRC-32s timed too, and
# ARGS["gpu_crc"] setting ckptconv._transfer.gpu_crc.
LOAD = LOAD4.replace(
    '(I, "check_record_crcs", "crc_check")):',
    '(I, "check_record_crcs", "crc_check"), (G, "kernel", "kernel"), (G, "record_crcs", "gpu_crc")):',
).replace(
    'for what in ("open", "to_torch", "read_spans", "crc_check"):',
    'for what in ("open", "to_torch", "read_spans", "crc_check", "kernel", "gpu_crc"):',
)
KNOBS = 'for name, value in ARGS["knobs"].items():'
LOAD = "import ckptconv._gpu_crc as G\n" + LOAD.replace(KNOBS, "T.gpu_crc = ARGS.get('gpu_crc', True)\n" + KNOBS)
# ARGS["early_pin"]: the readers' staging pinned on its thread from the start of the load, while the
# file is parsed (ckptconv.loading.open), rather than from the start of the reads.
EARLY_PIN = """
if ARGS.get("early_pin"):
    RealPinned, early, real_open = T._Pinned, {}, L.open
    def open_early(*a, **k):
        early["pinned"] = RealPinned(T.MAX_GPU_THREADS * T.DEPTH)
        return real_open(*a, **k)
    def pinned(count):
        made = early.pop("pinned", None)
        return made if made is not None and made.count == count else RealPinned(count)
    L.open, T._Pinned = open_early, pinned
"""
LOAD = LOAD.replace("\ndef summary(t0, wall):", EARLY_PIN + "\ndef summary(t0, wall):")
assert "open_early" in LOAD
assert '(G, "kernel", "kernel")' in LOAD and '"kernel", "gpu_crc"):' in LOAD and "T.gpu_crc" in LOAD

# (title, file suffix, LOAD arguments besides the path). Round 5 ran five calls on one H200
# (bench/results/bench_gpu_load_h200.md): calls 1 (commit ef64e1d) and 2 (c7cff34) the first four
# and the sharded folder (in call 1 the kernel could not be loaded, unversioned driver entry points,
# and the loads fell back to reading the records again); call 3 (cff68fd) this list; calls 4
# (cdfb369) and 5 (eee42db) the first four and "pt crc on the GPU, one group after the reads", with
# the GPU's CRC-32s taken in groups of 512 MiB of records as their copies finished (reverted: no
# faster than one launch after the reads).
VARIANTS: list[tuple[str, str, dict[str, object]]] = [
    ("st", ".safetensors", {}),
    ("pt crc on the GPU", ".pt", {}),
    ("pt crc on the readers (main)", ".pt", {"gpu_crc": False}),
    ("pt check_crc=False", ".pt", {"crc": False}),
    ("st, staging pinned during the parse", ".safetensors", {"early_pin": True}),
    ("pt crc on the GPU, staging pinned during the parse", ".pt", {"early_pin": True}),
]

TIMELINES: list[tuple[str, str, dict[str, object]]] = [
    ("pt crc on the GPU, twice", ".pt", {"twice": True}),
    ("pt crc on the readers (main), twice", ".pt", {"twice": True, "gpu_crc": False}),
]


def main() -> None:
    parser = probe_parser(__doc__, "kernel, timelines, loads")
    args = parser.parse_args()
    stem, started, env = probe_files(args)
    st = stem + ".safetensors"

    if "kernel" not in args.skip:
        print(f"kernel: {json.dumps(run_probe(KERNEL, {}, env))}", flush=True)

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
