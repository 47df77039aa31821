"""Benchmark: merging, resharding and DCP conversion of a multi-GB sharded model in bounded memory.

    python bench/bench_sharded.py                # 4 GiB in 1 GiB shards, 3 rounds
    python bench/bench_sharded.py --gib 2 --runs 3

Reports each command's median wall time against copying the same bytes
(`cp -r` of the shard folder) and its peak RSS as a fraction of the model's
size; every output is checked bit for bit against the source once.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import CKPTCONV, PYTHON, Case, run_once

BUILD = textwrap.dedent(
    """
    import sys, torch, ckptconv
    gib, folder = float(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    state, total, i = {}, 0, 0
    while total < gib * 2**30:
        state[f"model.layers.{i}.weight"] = torch.randn(4096, 4096)
        state[f"model.layers.{i}.norm"] = torch.ones(4096)
        total += 4096 * 4096 * 4
        i += 1
    state["model.position_ids"] = torch.arange(4096)
    ckptconv.save(state, folder + "/", max_shard_size=2**30, fsync=False)
    """
)

CHECK = textwrap.dedent(
    """
    import sys, torch, ckptconv
    a, b = ckptconv.load(sys.argv[1]), ckptconv.load(sys.argv[2])
    assert set(a) == set(b), "keys differ"
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    print("ok", len(a))
    """
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "ckptconv-bench-sharded")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    shards = args.dir / "shards"
    subprocess.run([PYTHON, "-c", BUILD, str(args.gib), str(shards)], check=True)
    size = sum(p.stat().st_size for p in shards.iterdir())
    merged = args.dir / "merged.safetensors"
    subprocess.run([*CKPTCONV, "convert", str(shards), str(merged), "--no-fsync", "-q"], check=True)
    dcp_in = args.dir / "dcp_in"
    subprocess.run([*CKPTCONV, "convert", str(merged), str(dcp_in), "--to", "dcp", "--no-fsync", "-q"], check=True)

    out = args.dir / "out"
    cases = [
        Case(
            "cp -r shards/", ["cp", "-r", str(shards), str(out / "copy")], shards / "model.safetensors.index.json", None
        ),
        Case(
            "merge: shards/ -> one .safetensors",
            [*CKPTCONV, "convert", str(shards), str(out / "m.safetensors"), "--no-fsync", "-q"],
            shards / "model.safetensors.index.json",
            out / "m.safetensors",
        ),
        Case(
            "reshard: one file -> 512 MB shards",
            [*CKPTCONV, "convert", str(merged), str(out / "r"), "--max-shard-size", "512MB", "--no-fsync", "-q"],
            merged,
            None,
        ),
        Case(
            "shards/ -> .bin shards with --dtype bf16",
            [
                *CKPTCONV,
                "convert",
                str(shards),
                str(out / "b"),
                "--to",
                "pt",
                "--max-shard-size",
                "1GB",
                "--dtype",
                "bf16",
                "--no-fsync",
                "-q",
            ],
            shards / "model.safetensors.index.json",
            None,
        ),
        Case(
            "shards/ -> DCP folder",
            [*CKPTCONV, "convert", str(shards), str(out / "d"), "--to", "dcp", "--no-fsync", "-q"],
            shards / "model.safetensors.index.json",
            None,
        ),
        Case(
            "DCP folder -> one .safetensors",
            [*CKPTCONV, "convert", str(dcp_in), str(out / "fromdcp.safetensors"), "--no-fsync", "-q"],
            dcp_in / ".metadata",
            out / "fromdcp.safetensors",
        ),
    ]
    for round_number in range(args.runs):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        for case in cases:
            for leftover in ("copy", "r", "b", "d"):
                shutil.rmtree(out / leftover, ignore_errors=True)
            run_once(case)
            if round_number == 0 and case.name.startswith(("merge", "reshard", "shards/ -> DCP", "DCP")):
                target = {
                    "merge": out / "m.safetensors",
                    "reshard": out / "r",
                    "shards/ -> DCP": out / "d",
                    "DCP": out / "fromdcp.safetensors",
                }[next(k for k in ("merge", "reshard", "shards/ -> DCP", "DCP") if case.name.startswith(k))]
                result = subprocess.run(
                    [PYTHON, "-c", CHECK, str(shards), str(target)], capture_output=True, text=True, check=False
                )
                print(f"  verified {case.name}: {result.stdout.strip() or result.stderr[-300:]}", file=sys.stderr)
        print(f"round {round_number + 1}/{args.runs}", file=sys.stderr)

    copy = statistics.median(cases[0].walls)
    print(
        f"\n### sharded model, {size / 2**30:.2f} GiB in {len(list(shards.glob('*.safetensors')))} shards, "
        f"median of {args.runs} runs\n"
    )
    print("| command | wall (s) | x cp -r | peak RSS (MiB) | RSS / model size |")
    print("|---|---:|---:|---:|---:|")
    for case in cases:
        wall = statistics.median(case.walls)
        rss = max(case.rss)
        print(f"| {case.name} | {wall:.2f} | {wall / copy:.2f} | {rss / 2**20:.0f} | {rss / size:.3f} |")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
