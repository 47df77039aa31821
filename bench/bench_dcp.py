"""Benchmark: a DCP checkpoint folder (what FSDP/``torch.distributed.checkpoint`` and Megatron-Core's
``torch_dist`` write) to one file, ckptconv against torch's own consolidation.

    python bench/bench_dcp.py                 # a 1 GiB (fp32) model saved with dcp.save, 3 rounds
    python bench/bench_dcp.py --gib 0.5 --runs 1

torch's side is ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (DCP -> one ``.pt``, the
documented offline way); ckptconv's is ``ckptconv.convert(folder, "model.pt")`` without fsync and source
hash, the same output format. Each tool runs in a fresh process; reported are the median wall time and
the peak RSS (``ru_maxrss``), also minus the RSS after the tool's imports. Outputs are compared bit for
bit once, both read back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Saved by DCP's own writer (two writer threads, so two .distcp files), as a training run saves it.
BUILD = textwrap.dedent(
    """
    import sys, torch
    import torch.distributed.checkpoint as dcp
    gib, folder = float(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    state, total, i = {}, 0, 0
    while total < gib * 2**30:
        state[f"model.layers.{i}.weight"] = torch.randn(2048, 2048)
        state[f"model.layers.{i}.norm"] = torch.randn(2048)
        total += (2048 * 2048 + 2048) * 4
        i += 1
    state["model.step"] = torch.tensor(7)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, thread_count=2), no_dist=True)
    """
)

MEASURE = textwrap.dedent(
    """
    import json, resource, sys, time
    tool, src, dst = sys.argv[1:4]
    if tool == "ckptconv":
        import ckptconv, numpy
        def run():
            ckptconv.convert(src, dst, source_hash=False, fsync=False)
    else:
        import torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        def run():
            dcp_to_torch_save(src, dst)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    run()
    elapsed = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": elapsed, "peak_mib": peak / 1024, "grown_mib": (peak - base) / 1024}))
    """
)

COMPARE = textwrap.dedent(
    """
    import sys, torch
    a, b = torch.load(sys.argv[1], weights_only=True), torch.load(sys.argv[2], weights_only=True)
    assert list(a) == list(b) or sorted(a) == sorted(b), (list(a)[:3], list(b)[:3])
    for key in a:
        x, y = a[key], b[key]
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert x.reshape(-1).view(torch.uint8).equal(y.reshape(-1).view(torch.uint8)), key
    print(f"identical ({len(a)} tensors)")
    """
)


def measure(tool: str, src: Path, dst: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    dst.unlink(missing_ok=True)
    result = subprocess.run(  # noqa: PLW1510 - checked below
        [sys.executable, "-P", "-c", MEASURE, tool, str(src), str(dst)], capture_output=True, text=True, env=env
    )
    if result.returncode:
        raise SystemExit(f"{tool} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        src = Path(work) / "dcp"
        subprocess.run([sys.executable, "-c", BUILD, str(args.gib), str(src)], check=True, capture_output=True)
        size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        print(f"DCP checkpoint: {size / 2**30:.2f} GiB on disk")
        rows: dict[str, list[dict[str, float]]] = {"ckptconv": [], "dcp_to_torch_save": []}
        for _ in range(args.runs):  # alternating, so machine noise hits both alike
            for tool, runs in rows.items():
                runs.append(measure(tool, src, Path(work) / f"{tool}.pt"))
        for tool, runs in rows.items():
            print(
                f"{tool:>17}: {statistics.median(r['seconds'] for r in runs):6.2f} s  "
                f"peak RSS {max(r['peak_mib'] for r in runs):7.0f} MiB  "
                f"(+{max(r['grown_mib'] for r in runs):.0f} MiB after imports)"
            )
        compared = subprocess.run(
            [sys.executable, "-c", COMPARE, str(Path(work) / "ckptconv.pt"), str(Path(work) / "dcp_to_torch_save.pt")],
            capture_output=True,
            text=True,
            check=False,
        )
        print(compared.stdout.strip() or compared.stderr.strip()[-500:])


if __name__ == "__main__":
    main()
