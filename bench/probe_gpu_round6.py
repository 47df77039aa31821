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

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_load import alternating_loads, probe_files, probe_parser, run_probe
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
    parser = probe_parser(__doc__, "timelines, loads")
    parser.add_argument("--pieces", action="store_true", help="compare staging piece sizes instead")
    args = parser.parse_args()
    variants = PIECES if args.pieces else VARIANTS
    stem, started, env = probe_files(args)
    st = stem + ".safetensors"

    def load(suffix: str, extra: dict[str, object]) -> dict[str, object] | str:
        return run_probe(LOAD, {"path": stem + suffix, "reference": st, "knobs": {}, **extra}, env)

    if "timelines" not in args.skip:
        for title, suffix, extra in TIMELINES:
            print(f"timeline {title}: {json.dumps(load(suffix, extra))}", flush=True)
    if "loads" in args.skip:
        return
    alternating_loads(
        load,
        variants,
        rounds=args.rounds,
        budget=args.budget,
        started=started,
        stem=stem,
        env=env,
        reverse_odd=True,
        brief=lambda value: {
            **{key: value["first"][key] for key in ("gbps", "open", "read_spans", "upload_ms_per_reader")},  # type: ignore[index]
            "bit_exact": value.get("bit_exact"),
        },
    )


if __name__ == "__main__":
    main()
