"""Benchmark: getting a multi-GB checkpoint onto a GPU, ckptconv against torch.load and safetensors.

Run on a machine with a CUDA GPU, from the repository root:

    PYTHONPATH=. python bench/bench_gpu_load.py --gib 4 --runs 3

Each approach runs in a fresh process (so CUDA start-up and page-cache state
are alike), alternating within each round; the table gives the median wall
time of the load itself (CUDA already initialised), its ratio to ckptconv's,
the effective GB/s, and the process's peak host RSS. The physical limit is
measured in the same run: a host-to-device copy of the same number of bytes
from pinned memory, and from ordinary (pageable) memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

BUILD = textwrap.dedent(
    """
    import sys, torch
    from safetensors.torch import save_file
    gib, stem = float(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    d = 4096
    state, total = {}, 0
    i = 0
    while total < gib * 2**30:
        state[f"layers.{i}.weight"] = torch.randn(d, d)
        state[f"layers.{i}.bias"] = torch.randn(d)
        state[f"layers.{i}.steps"] = torch.tensor(i)
        total += d * d * 4
        i += 1
    torch.save(state, stem + ".pt")
    save_file(state, stem + ".safetensors")
    """
)

LOADERS = {
    "ckptconv.load(x.pt, device='cuda:0')": ("import ckptconv; state = ckptconv.load(PATH + '.pt', device='cuda:0')"),
    "ckptconv.load(x.safetensors, device='cuda:0')": (
        "import ckptconv; state = ckptconv.load(PATH + '.safetensors', device='cuda:0')"
    ),
    "torch.load(x.pt, map_location='cuda:0')": (
        "state = torch.load(PATH + '.pt', map_location='cuda:0', weights_only=True)"
    ),
    "torch.load(x.pt, map_location='cuda:0', mmap=True)": (
        "state = torch.load(PATH + '.pt', map_location='cuda:0', weights_only=True, mmap=True)"
    ),
    "safetensors.torch.load_file(x.safetensors, device='cuda:0')": (
        "from safetensors.torch import load_file; state = load_file(PATH + '.safetensors', device='cuda:0')"
    ),
}

CHILD = textwrap.dedent(
    """
    import json, resource, sys, time, torch
    PATH = sys.argv[1]
    torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()   # CUDA context outside the timing
    start = time.perf_counter()
    {code}
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    assert all(t.device.type == "cuda" for t in state.values())
    print(json.dumps({{"wall": wall, "bytes": nbytes,
                      "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
    """
)

BANDWIDTH = textwrap.dedent(
    """
    import json, sys, time, torch
    n = int(float(sys.argv[1]) * 2**30)
    out = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    result = {}
    for kind in ("pinned", "pageable"):
        host = torch.ones(n, dtype=torch.uint8, pin_memory=(kind == "pinned"))
        out.copy_(host); torch.cuda.synchronize()
        start = time.perf_counter(); out.copy_(host, non_blocking=True); torch.cuda.synchronize()
        result[kind] = n / (time.perf_counter() - start) / 1e9
        del host
    print(json.dumps(result))
    """
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    stem = str(args.dir / f"gpu_bench_{args.gib:g}gib")
    subprocess.run([sys.executable, "-c", BUILD, str(args.gib), stem], check=True)
    buffer = bytearray(8 << 20)
    for suffix in (".pt", ".safetensors"):  # warm the page cache
        with open(stem + suffix, "rb", buffering=0) as file:
            while file.readinto(buffer):
                pass

    walls: dict[str, list[float]] = {name: [] for name in LOADERS}
    rss: dict[str, int] = {}
    nbytes = 0
    for round_number in range(args.runs):
        for name, code in LOADERS.items():
            script = CHILD.format(code=code)
            out = subprocess.run([sys.executable, "-c", script, stem], capture_output=True, text=True, check=False)
            if out.returncode:
                print(f"{name} failed: {out.stderr[-800:]}", file=sys.stderr)
                continue
            result = json.loads(out.stdout.strip().splitlines()[-1])
            walls[name].append(result["wall"])
            rss[name] = max(rss.get(name, 0), result["rss"])
            nbytes = result["bytes"]
        print(f"round {round_number + 1}/{args.runs} done", file=sys.stderr, flush=True)
    bandwidth = json.loads(
        subprocess.run(
            [sys.executable, "-c", BANDWIDTH, str(nbytes / 2**30)], capture_output=True, text=True, check=True
        ).stdout
    )

    base = statistics.median(walls["ckptconv.load(x.pt, device='cuda:0')"])
    print(f"\n{nbytes / 2**30:.2f} GiB of tensors, median of {args.runs} runs (page cache warm)\n")
    print("| approach | wall (s) | x ckptconv | GB/s | peak host RSS (MiB) |")
    print("|---|---:|---:|---:|---:|")
    for name, values in walls.items():
        if not values:
            continue
        wall = statistics.median(values)
        print(f"| {name} | {wall:.2f} | {wall / base:.2f} | {nbytes / wall / 1e9:.2f} | {rss[name] / 2**20:.0f} |")
    print(
        f"| host-to-device copy, pinned (physical limit) | {nbytes / bandwidth['pinned'] / 1e9:.2f} | | "
        f"{bandwidth['pinned']:.2f} | |"
    )
    print(
        f"| host-to-device copy, pageable | {nbytes / bandwidth['pageable'] / 1e9:.2f} | | "
        f"{bandwidth['pageable']:.2f} | |"
    )
    for suffix in (".pt", ".safetensors"):
        Path(stem + suffix).unlink()


if __name__ == "__main__":
    main()
