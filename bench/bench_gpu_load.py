"""Benchmark: a multi-GB checkpoint onto a GPU, ckptconv against the fastest loaders, warm and cold.

Run on a machine with a CUDA GPU, from the repository root:

    PYTHONPATH=. python bench/bench_gpu_load.py --gib 8 --runs 3

With every peer installed this takes over 6 minutes at 8 GiB on a two-H200 machine (40 fresh
processes); ``--only`` picks approaches by substring. the probes of earlier rounds (bench/README.md) timed the
phases of a load one by one.

Builds one fp32 checkpoint as safetensors, as ``.pt`` and as a sharded
safetensors folder (4 shards and an index). Each approach runs in a fresh
process (CUDA initialised before the clock starts), alternating within each
round; the table gives the median GB/s of the load itself and the peak host
RSS. Peers that are not installed are skipped (instanttensor,
runai-model-streamer, fastsafetensors; their wheels install with pip).

Warm = the files are in the page cache; cold = dropped from it first
(``posix_fadvise(POSIX_FADV_DONTNEED)``), once per approach. The limits are
measured in the same run: a host-to-device copy from pinned memory, and the
disk's own read speed with ``dd iflag=direct``.

Every ckptconv load is checked bit for bit on the GPU against
``safetensors.torch.load_file`` of the same weights (first round). Every
package's bytecode is compiled before the first child, as a pip install leaves
it (:func:`compiled_env`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

BUILD = textwrap.dedent(
    """
    import json, os, sys, torch
    from safetensors.torch import save_file
    gib, stem = float(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    d = 4096
    state, total, i = {}, 0, 0
    while total < gib * 2**30:
        state[f"layers.{i}.weight"] = torch.randn(d, d)
        state[f"layers.{i}.bias"] = torch.randn(d)
        state[f"layers.{i}.steps"] = torch.tensor(i)
        total += d * d * 4
        i += 1
    torch.save(state, stem + ".pt")
    save_file(state, stem + ".safetensors")
    os.makedirs(stem + "_sharded", exist_ok=True)
    names = list(state)
    per = -(-len(names) // 4)
    weight_map = {}
    for s in range(4):
        part = {k: state[k] for k in names[s * per:(s + 1) * per]}
        shard = f"model-{s + 1:05d}-of-00004.safetensors"
        save_file(part, os.path.join(stem + "_sharded", shard))
        weight_map.update({k: shard for k in part})
    with open(os.path.join(stem + "_sharded", "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    """
)

# name -> (code that leaves `state` on cuda:0, file suffix it reads, is it ours)
# The start of every probe child (bench/probe_gpu_*.py): CUDA initialised before any timing, the
# probe's arguments as JSON in argv[1], and one RESULT line of JSON per measurement.
PROBE_PRELUDE = textwrap.dedent(
    """
    import ctypes, json, mmap, os, sys, threading, time, zlib, torch
    torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()
    ARGS = json.loads(sys.argv[1])
    def report(**values): print("RESULT " + json.dumps(values), flush=True)
    """
)

# Page cache to pinned memory, by ARGS["threads"] threads in ARGS["block"]-byte blocks, each block
# checksummed when ARGS["crc"] names how ("zlib", or "ckptconv" for the CRC-32 the readers use), read
# (and checksummed) in ARGS["step"]-byte steps when given.
PROBE_READS = """
path, n, block, crc = ARGS["path"], ARGS["threads"], ARGS["block"], ARGS["crc"]
step = ARGS.get("step") or block
if crc == "ckptconv":
    from ckptconv.reading.checksums import crc32
elif crc:
    crc32 = zlib.crc32
size = os.path.getsize(path)
staging = torch.empty(n * block, dtype=torch.uint8, pin_memory=True)
fd = os.open(path, os.O_RDONLY)
positions = list(range(0, size, block)); lock = threading.Lock()
def work(i):
    view = staging[i * block:(i + 1) * block].numpy().data
    while True:
        with lock:
            if not positions: return
            p = positions.pop(0)
        got, c = min(block, size - p), 0
        for at in range(0, got, step):
            part = view[at:min(at + step, got)]
            os.preadv(fd, [part], p + at)
            if crc: c = crc32(part, c)
t = time.perf_counter(); threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
[x.start() for x in threads]; [x.join() for x in threads]
report(gbps=size / (time.perf_counter() - t) / 1e9)
"""


# A peer loader timed in a probe child: "{code}" (from LOADERS) leaves its tensors in `state`.
PEER_PROBE = """
PATH = ARGS["stem"]
start = time.perf_counter()
{code}
torch.cuda.synchronize()
wall = time.perf_counter() - start
nbytes = sum(t.numel() * t.element_size() for t in state.values())
report(gbps=nbytes / wall / 1e9, wall=wall)
"""


def run_probe(code: str, args: dict[str, object], environ: dict[str, str] | None = None) -> dict[str, object] | str:
    """Run ``PROBE_PRELUDE + code`` in a fresh process: its RESULT, or the last line of its error."""
    out = subprocess.run(
        [sys.executable, "-P", "-c", PROBE_PRELUDE + code, json.dumps(args)],
        capture_output=True,
        text=True,
        check=False,
        env=environ,
        timeout=600,
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, object] = json.loads(line[7:])
            return result
    return (out.stderr.strip().splitlines() or ["failed"])[-1][:300]


LOADERS: dict[str, tuple[str, str, bool]] = {
    "ckptconv.load(x.safetensors, device='cuda:0')": (
        "import ckptconv; state = ckptconv.load(PATH + '.safetensors', device='cuda:0')",
        ".safetensors",
        True,
    ),
    "ckptconv.load(x.pt, device='cuda:0')": (
        "import ckptconv; state = ckptconv.load(PATH + '.pt', device='cuda:0')",
        ".pt",
        True,
    ),
    "ckptconv.load(x.pt, device='cuda:0', check_crc=False)": (
        "import ckptconv; state = ckptconv.load(PATH + '.pt', device='cuda:0', check_crc=False)",
        ".pt",
        True,
    ),
    "ckptconv.load(sharded folder, device='cuda:0')": (
        "import ckptconv; state = ckptconv.load(PATH + '_sharded', device='cuda:0')",
        "_sharded",
        True,
    ),
    "ckptconv.load(x.safetensors), page-cache reads only": (
        "import ckptconv, ckptconv.gpu.transfer as t; t.direct_io = 'buffered'; "
        "state = ckptconv.load(PATH + '.safetensors', device='cuda:0')",
        ".safetensors",
        True,
    ),
    "safetensors.torch.load_file(device='cuda:0')": (
        "from safetensors.torch import load_file; state = load_file(PATH + '.safetensors', device='cuda:0')",
        ".safetensors",
        False,
    ),
    "instanttensor, buffered back end": (
        "from instanttensor import safe_open, BackendPolicy\n"
        "with safe_open(PATH + '.safetensors', 'pt', device='cuda:0', backend=BackendPolicy.BUFFERED) as f:\n"
        "    state = dict(f.tensors())",
        ".safetensors",
        False,
    ),
    "instanttensor, default (direct I/O)": (
        "from instanttensor import safe_open\n"
        "with safe_open(PATH + '.safetensors', 'pt', device='cuda:0') as f:\n"
        "    state = dict(f.tensors())",
        ".safetensors",
        False,
    ),
    "runai-model-streamer": (
        "from runai_model_streamer import SafetensorsStreamer\n"
        "with SafetensorsStreamer() as s:\n"
        "    s.stream_file(PATH + '.safetensors', None, 'cpu')\n"
        "    state = {k: v.to('cuda:0') for k, v in s.get_tensors()}",
        ".safetensors",
        False,
    ),
    "fastsafetensors (no GDS)": (
        "from fastsafetensors import fastsafe_open\n"
        "with fastsafe_open(PATH + '.safetensors', device='cuda:0', nogds=True) as f:\n"
        "    state = {k: f.get_tensor(k).clone() for k in f.keys()}",
        ".safetensors",
        False,
    ),
    "torch.load(x.pt, mmap=True, map_location='cuda:0')": (
        "state = torch.load(PATH + '.pt', map_location='cuda:0', weights_only=True, mmap=True)",
        ".pt",
        False,
    ),
}


def probe_parser(doc: str | None, parts: str) -> argparse.ArgumentParser:
    """The probes' common arguments: the file's size, rounds, folder, ``--skip`` (one of ``parts``), budget."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--skip", nargs="*", default=[], help=f"parts to skip: {parts}")
    parser.add_argument("--budget", type=float, default=1e9, help="seconds after which no new round starts")
    return parser


def probe_files(args: argparse.Namespace) -> tuple[str, float, dict[str, str]]:
    """The probes' files (this benchmark's, built once in ``args.dir``) in the page cache:
    ``(stem, the time the probe started, the environment with compiled bytecode)``."""
    stem = str(args.dir / f"gpu_bench_{args.gib:g}gib")
    started = time.perf_counter()
    if not os.path.exists(stem + ".safetensors"):
        subprocess.run([sys.executable, "-c", BUILD, str(args.gib), stem], check=True)
    print(f"built in {time.perf_counter() - started:.0f} s", flush=True)
    env = compiled_env()
    sharded = stem + "_sharded"
    warm([stem + ".safetensors", stem + ".pt", *(os.path.join(sharded, n) for n in sorted(os.listdir(sharded)))])
    return stem, started, env


def alternating_loads(
    load: Callable[[str, dict[str, object]], dict[str, object] | str],
    variants: list[tuple[str, str, dict[str, object]]],
    *,
    rounds: int,
    budget: float,
    started: float,
    stem: str,
    env: dict[str, str],
    reverse_odd: bool = False,
    brief: Callable[[dict[str, object]], object] | None = None,
) -> None:
    """The probes' whole loads: every variant (``load(suffix, arguments)``, its first round checked bit for
    bit) then instanttensor's buffered back end, round after round (the order reversed every other round with
    ``reverse_odd``) until ``rounds`` or ``budget`` seconds since ``started``; prints each result (``brief``
    picks what) and the medians, with each as a multiple of instanttensor's."""
    speeds: dict[str, list[float]] = {}
    peer = PEER_PROBE.format(code=LOADERS["instanttensor, buffered back end"][0])
    for round_ in range(rounds):
        if time.perf_counter() - started > budget:
            print(f"budget spent: {round_} rounds", flush=True)
            break
        order = variants[::-1] if reverse_odd and round_ % 2 else variants
        for title, suffix, extra in order:
            value: object = load(suffix, {**extra, "check": round_ == 0})
            if isinstance(value, dict):
                speeds.setdefault(title, []).append(value["first"]["gbps"])
                value = brief(value) if brief else value
            print(f"{round_} {title}: {json.dumps(value)}", flush=True)
        result = run_probe(peer, {"stem": stem}, env)
        if isinstance(result, dict):
            speeds.setdefault("instanttensor buffered", []).append(result["gbps"])  # type: ignore[arg-type]
        print(f"{round_} instanttensor buffered: {result}", flush=True)
    peer_median = statistics.median(speeds.get("instanttensor buffered", [float("nan")]))
    print("SUMMARY (GB/s per round, median, x instanttensor buffered)")
    for title, values in speeds.items():
        median = statistics.median(values)
        print(f"{title:50s} {[round(v, 2) for v in values]} median {median:.2f} x{median / peer_median:.2f}")
    print(f"total {time.perf_counter() - started:.0f} s", flush=True)


CHILD = textwrap.dedent(
    """
    import json, resource, sys, time, torch
    PATH, CHECK = sys.argv[1], sys.argv[2] == "1"
    torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()   # CUDA context outside the timing
    start = time.perf_counter()
    {code}
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    assert all(t.device.type == "cuda" for t in state.values())
    checked = 0
    if CHECK:
        from safetensors.torch import load_file
        ref = load_file(PATH + ".safetensors", device="cuda:0")
        assert set(ref) == set(state), "keys differ"
        for key, want in ref.items():
            got = state[key]
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), key
            checked += 1
    print(json.dumps({{"wall": wall, "bytes": nbytes, "rss": rss, "checked": checked}}))
    """
)

PINNED = textwrap.dedent(
    """
    import json, sys, time, torch
    n = int(sys.argv[1])
    out = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    host = torch.ones(n, dtype=torch.uint8, pin_memory=True)
    out.copy_(host); torch.cuda.synchronize()
    walls = []
    for _ in range(3):
        start = time.perf_counter(); out.copy_(host, non_blocking=True); torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    print(json.dumps({"pinned": n / sorted(walls)[1] / 1e9}))
    """
)


SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []

#: The packages whose bytecode is compiled before any child runs.
COMPILED = ("ckptconv", "safetensors", "instanttensor", "runai_model_streamer", "fastsafetensors")


def compiled_env() -> dict[str, str]:
    """The environment of every child: bytecode compiled once, before the clock, into a cache folder.

    A pip install compiles a package's bytecode; a source tree on PYTHONPATH under
    ``PYTHONDONTWRITEBYTECODE=1`` (set on some machines) has none, and then every fresh
    process compiled all of ckptconv's load path from source inside its timed load (about
    50 ms of a 0.35 s 8 GiB load on one H200: bench/results/bench_gpu_load_h200.md, round 3).
    """
    env = {**os.environ, "PYTHONPYCACHEPREFIX": tempfile.mkdtemp(prefix="bench_gpu_pyc_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    for name in COMPILED:
        spec = importlib.util.find_spec(name)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            subprocess.run([sys.executable, "-m", "compileall", "-q", folder], env=env, check=False)
    return env


def files_of(stem: str, suffix: str) -> list[str]:
    path = stem + suffix
    if os.path.isdir(path):
        return [os.path.join(path, name) for name in sorted(os.listdir(path))]
    return [path]


def drop(paths: list[str]) -> None:
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: list[str]) -> None:
    for path in paths:
        subprocess.run(["cat", path], stdout=subprocess.DEVNULL, check=True)  # noqa: S607 - cat from PATH, like the bench commands


def disk_speed(path: str) -> float:
    """GB/s of ``dd iflag=direct`` over the whole file (bypasses the page cache)."""
    start = time.perf_counter()
    out = subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=64M", "iflag=direct"],  # noqa: S607 - dd from PATH
        check=False,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    match = re.search(r"(\d+) bytes", out.stderr)
    return int(match.group(1)) / wall / 1e9 if match else float("nan")


def run_child(code: str, stem: str, check: bool, env: dict[str, str]) -> dict[str, float] | str:
    out = subprocess.run(
        # -P: import ckptconv from PYTHONPATH, not from the current directory (Python 3.11+).
        [sys.executable, *SAFE_PATH, "-c", CHILD.format(code=code), stem, "1" if check else "0"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
    )
    if out.returncode:
        return (out.stderr.strip().splitlines() or ["failed"])[-1][:200]
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--no-cold", action="store_true")
    parser.add_argument(
        "--cold-runs",
        type=int,
        default=1,
        help="cold rounds, each with its own dd run, the loaders' order reversed every other round (medians)",
    )
    parser.add_argument("--only", nargs="*", help="substrings of the approaches to run")
    args = parser.parse_args()
    stem = str(args.dir / f"gpu_bench_{args.gib:g}gib")
    started = time.perf_counter()
    if not os.path.exists(stem + ".safetensors"):
        subprocess.run([sys.executable, "-c", BUILD, str(args.gib), stem], check=True)
    print(f"built in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    loaders = {k: v for k, v in LOADERS.items() if not args.only or any(s in k for s in args.only)}
    env = compiled_env()

    # The limits first, each printed as it is known, so that a run cut short by a time limit keeps them.
    drop([stem + ".safetensors"])
    disk = disk_speed(stem + ".safetensors")
    print(f"  disk, dd iflag=direct: {disk:.2f} GB/s", file=sys.stderr, flush=True)
    pinned = json.loads(
        subprocess.run(
            [sys.executable, "-c", PINNED, str(os.path.getsize(stem + ".safetensors"))],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )["pinned"]
    print(f"  pinned host-to-device copy: {pinned:.1f} GB/s", file=sys.stderr, flush=True)

    warm_walls: dict[str, list[float]] = {name: [] for name in loaders}
    cold_walls: dict[str, list[float]] = {name: [] for name in loaders}
    disks = [disk]
    rss: dict[str, int] = {}
    notes: dict[str, str] = {}
    nbytes = 0
    for round_number in range(args.runs):
        for name, (code, suffix, ours) in loaders.items():
            if name in notes:
                continue
            warm(files_of(stem, suffix))
            result = run_child(code, stem, check=ours and round_number == 0, env=env)
            if isinstance(result, str):
                notes[name] = result
                print(f"{name} failed: {result}", file=sys.stderr, flush=True)
                continue
            warm_walls[name].append(result["wall"])
            speed = result["bytes"] / result["wall"] / 1e9
            print(f"  warm {name}: {speed:.2f} GB/s, rss {result['rss'] / 2**20:.0f} MiB", file=sys.stderr, flush=True)
            rss[name] = max(rss.get(name, 0), int(result["rss"]))
            nbytes = int(result["bytes"])
            if result["checked"]:
                print(f"  {name}: {result['checked']} tensors bit-exact", file=sys.stderr, flush=True)
        print(f"warm round {round_number + 1}/{args.runs} done", file=sys.stderr, flush=True)
    cold_runs = 0 if args.no_cold else args.cold_runs
    for round_number in range(cold_runs):
        if round_number:  # the disk's speed in each later round too, as it drifts on cloud disks
            drop([stem + ".safetensors"])
            disks.append(disk_speed(stem + ".safetensors"))
            print(f"  disk, dd iflag=direct: {disks[-1]:.2f} GB/s", file=sys.stderr, flush=True)
        names = list(loaders) if round_number % 2 == 0 else list(reversed(loaders))
        for name in names:
            code, suffix, _ = loaders[name]
            if name in notes:
                continue
            drop(files_of(stem, suffix))
            result = run_child(code, stem, check=False, env=env)
            if not isinstance(result, str):
                cold_walls[name].append(result["wall"])
                nbytes = int(result["bytes"])
                speed = result["bytes"] / result["wall"] / 1e9
                print(f"  cold {name}: {speed:.2f} GB/s", file=sys.stderr, flush=True)
        print(f"cold round {round_number + 1}/{cold_runs} done", file=sys.stderr, flush=True)
    cold_text = "one run each" if cold_runs == 1 else f"median of {cold_runs}"
    print(f"\n{nbytes / 2**30:.2f} GiB of fp32 tensors; warm: median of {args.runs}; cold: {cold_text}\n")
    print("| loader | warm GB/s | cold GB/s | peak host RSS (MiB) |")
    print("|---|---:|---:|---:|")
    print(f"| pinned host-to-device copy (limit) | {pinned:.1f} | | |")
    print(f"| disk, `dd bs=64M iflag=direct` (limit) | | {statistics.median(disks):.2f} | |")
    for name in loaders:
        if name in notes:
            print(f"| {name} | failed: {notes[name]} | | |")
            continue
        # --runs 0 measures the cold loads alone: no warm column, no RSS (taken in the warm runs).
        warm_text = f"{nbytes / statistics.median(warm_walls[name]) / 1e9:.2f}" if warm_walls[name] else ""
        cold = f"{nbytes / statistics.median(cold_walls[name]) / 1e9:.2f}" if cold_walls[name] else ""
        rss_text = f"{rss[name] / 2**20:.0f}" if name in rss else ""
        print(f"| {name} | {warm_text} | {cold} | {rss_text} |")
    print(f"\ntotal {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
