"""Benchmark: checkpoints of many small tensors, where the cost per tensor is what counts.

Mixture-of-experts models hold 10^4-10^5 tensors and optimizer states triple that; with tensors
of a few bytes, a conversion's time and memory are its bookkeeping per tensor, not its copies.
This builds a ``.pt`` (torch.save) and a ``.safetensors`` (safetensors' save_file) of ``N``
float32 tensors of 4 elements each, then times ckptconv against ``torch.load`` and
``safetensors.torch.load_file`` of the same files, each in a fresh child process, alternating
within each round (rows and helpers shared with ``bench_convert.py``)::

    python -P bench/bench_many_tensors.py --tensors 30000 300000 --runs 3
    python -P bench/bench_many_tensors.py --tensors 300000 --baseline /path/to/other/checkout --idle-only

A first, untimed round checks every ckptconv output against torch (every tensor, bit for bit; the bf16
row against ``Tensor.to``).
Reports the median wall and user CPU time, microseconds per tensor, and the peak RSS.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run with -P, as bench_convert.py is

from bench_convert import (
    CKPTCONV,
    FAST,
    PYTHON,
    Case,
    add_seed_option,
    ckptconv_case,
    retaken,
    round_seed,
    run_rounds,
    with_baseline,
)

BUILD_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from safetensors.torch import save_file
    n, folder = int(sys.argv[1]), sys.argv[2]
    # Names as a model's (layers.<i>.<part>.weight), values that tell every tensor apart.
    sd = {f"layers.{i // 8}.block{i % 8}.weight": torch.arange(4, dtype=torch.float32) + i for i in range(n)}
    torch.save(sd, f"{folder}/many_{n}.pt")
    save_file(sd, f"{folder}/many_{n}.safetensors")
    """
)

CHECK_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from safetensors.torch import load_file
    source, output = sys.argv[1], sys.argv[2]
    want = load_file(source) if source.endswith(".safetensors") else torch.load(source, weights_only=True)
    got = load_file(output) if output.endswith(".safetensors") else torch.load(output, weights_only=True)
    if len(sys.argv) > 3:  # the output was cast: compare with Tensor.to
        want = {key: value.to(getattr(torch, sys.argv[3])) for key, value in want.items()}
    assert sorted(got) == sorted(want), "keys differ"
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key
    print("ok", len(got), "tensors")
    """
)


def build(folder: Path, n: int) -> dict[str, Path]:
    paths = {"pt": folder / f"many_{n}.pt", "safetensors": folder / f"many_{n}.safetensors"}
    if not all(path.exists() for path in paths.values()):
        print(f"building {n:,}-tensor checkpoints in {folder} ...", file=sys.stderr)
        subprocess.run([PYTHON, "-c", BUILD_SCRIPT, str(n), str(folder)], check=True)
    return paths


def cases_for(paths: dict[str, Path], out: Path, quick: bool) -> list[Case]:
    pt, st = paths["pt"], paths["safetensors"]
    cases = [
        Case("ckptconv inspect x.pt", [*CKPTCONV, "inspect", str(pt)], pt, None),
        ckptconv_case("convert", "x.pt y.safetensors", pt, out / "a.safetensors", *FAST.split()),
        ckptconv_case("convert", "x.safetensors y.pt", st, out / "b.pt", *FAST.split()),
        ckptconv_case("convert", "x.pt y.safetensors", pt, out / "d.safetensors", "--dtype", "bf16", *FAST.split()),
        ckptconv_case("strip-module", "x.pt y.pt", pt, out / "c.pt", *FAST.split()),
    ]
    if not quick:
        cases += [
            Case(
                "torch.load(x.pt, weights_only=True)",
                [PYTHON, "-c", "import sys, torch; torch.load(sys.argv[1], weights_only=True)", str(pt)],
                pt,
                None,
            ),
            Case(
                "safetensors.torch.load_file(x.safetensors)",
                [PYTHON, "-c", "import sys; from safetensors.torch import load_file; load_file(sys.argv[1])", str(st)],
                st,
                None,
            ),
        ]
    return cases


def check(case: Case) -> None:
    if case.output is None or not case.name.startswith("ckptconv"):
        return
    result = subprocess.run(
        [
            PYTHON,
            "-c",
            CHECK_SCRIPT,
            str(case.source),
            str(case.output),
            *(["bfloat16"] if "bf16" in case.name else []),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    status = (result.stdout or result.stderr).strip().splitlines()[-1:]
    print(f"  verified {case.name}: {' '.join(status)}", file=sys.stderr)
    if result.returncode:
        raise SystemExit(f"output of {case.name} is wrong: {status}")


def report(n: int, cases: list[Case]) -> None:
    print(f"\n### {n:,} tensors of 4 float32 each, median of {len(cases[0].walls)} runs\n")
    print("| approach | wall (s) | user CPU (s) | µs per tensor (wall) | peak RSS (MiB) |")
    print("|---|---:|---:|---:|---:|")
    for case in cases:
        wall = statistics.median(case.walls)
        user = statistics.median(case.user) if case.user else float("nan")
        rss = max(case.rss) / 2**20 if case.rss else float("nan")
        print(f"| {case.name} | {wall:.2f} | {user:.2f} | {wall / n * 1e6:.0f} | {rss:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, nargs="+", default=[30_000, 300_000], help="tensors per checkpoint")
    parser.add_argument("--runs", type=int, default=3, help="rounds per approach (medians are reported)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "ckptconv-bench-many")
    parser.add_argument("--quick", action="store_true", help="ckptconv rows only, no torch baselines")
    parser.add_argument("--baseline", type=Path, help="another source tree to run each ckptconv row from too")
    parser.add_argument("--only", nargs="+", help="only the rows whose name contains one of these")
    add_seed_option(parser)
    parser.add_argument("--idle-only", action="store_true", help="as bench_convert.py's --idle-only")
    args = parser.parse_args()
    seed = round_seed(args.seed)

    args.dir.mkdir(parents=True, exist_ok=True)
    for n in args.tensors:
        paths = build(args.dir, n)
        out = args.dir / "out"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        cases = cases_for(paths, out, args.quick)
        if args.only:
            cases = [c for c in cases if any(text in c.name for text in args.only)]
        if args.baseline:
            cases = with_baseline(cases, args.baseline)
        run_rounds(cases, args.runs, seed, f"{n:,} tensors", check, args.idle_only)
        report(n, cases)
        if retaken:
            print(f"\nRuns taken again because other processes used the CPU meanwhile: {retaken}")
            retaken.clear()
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
