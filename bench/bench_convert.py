"""Benchmark: ckptconv against `cp` and the usual torch scripts, side by side in one run.

Builds synthetic transformer-like checkpoints (tied embedding, int64 buffers,
a `module.` prefix, many tensors), then times every approach in fresh child
processes, alternating them within each round (in a new random order each
round) so that machine noise hits all of them alike. Reports the median and the
best wall time, each as a ratio to `cp` of the same file, and each child's peak
RSS (from wait4's rusage).

    python bench/bench_convert.py                    # 1 and 4 GiB, 5 rounds
    python bench/bench_convert.py --sizes 1 --runs 3 --quick
    python bench/bench_convert.py --sizes 1 --quick --baseline /path/to/other/checkout
    python bench/bench_convert.py --sizes 1 --quick --idle-only   # on a machine shared with other work

A first, untimed round checks every output bit for bit against torch and fills the
bytecode cache (children run as an installed package would, with compiled modules).

``--baseline`` adds each ckptconv row once more, run from another source tree
(``PYTHONPATH``), alternating with this tree's: before/after ratios from one run.

Cold-cache rows drop the input from the page cache first
(posix_fadvise(POSIX_FADV_DONTNEED)), where the OS allows it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
CKPTCONV = [PYTHON, "-m", "ckptconv"]
TIME = shutil.which("time") if os.path.exists("/usr/bin/time") else None
#: With --idle-only: how long a quiet spell must last before a run starts, the most CPU time other
#: processes may use during a run before it is taken again, and how often it is taken at most.
IDLE_WINDOW_S = 0.5
IDLE_SLACK_S = 0.08
IDLE_ATTEMPTS = 20
#: Runs taken again because other processes used the CPU meanwhile (--idle-only).
retaken: dict[str, int] = {}
# Like cp and the torch scripts: no fsync, and no provenance hash of the whole source.
FAST = " --no-fsync --no-source-hash"


# ---------------------------------------------------------------------------------------
# Synthetic checkpoints
# ---------------------------------------------------------------------------------------

BUILD_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from safetensors.torch import save_file
    gib, out = float(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    d, vocab = 2048, 32000
    state = {}
    embed = torch.randn(vocab, d) * 0.02
    state["module.embed.weight"] = embed
    per_layer = 12 * d * d * 4
    layers = max(1, round((gib * 2**30 - embed.nbytes) / per_layer))
    for i in range(layers):
        p = f"module.layers.{i}."
        for name in ("q", "k", "v", "o"):
            state[p + f"attn.{name}.weight"] = torch.randn(d, d) * 0.02
            state[p + f"attn.{name}.bias"] = torch.zeros(d)
        state[p + "mlp.up.weight"] = torch.randn(4 * d, d) * 0.02
        state[p + "mlp.up.bias"] = torch.zeros(4 * d)
        state[p + "mlp.down.weight"] = torch.randn(d, 4 * d) * 0.02
        state[p + "mlp.down.bias"] = torch.zeros(d)
        state[p + "norm1.weight"] = torch.ones(d)
        state[p + "norm1.bias"] = torch.zeros(d)
        state[p + "norm2.weight"] = torch.ones(d)
        state[p + "norm2.bias"] = torch.zeros(d)
        state[p + "rotary.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    state["module.norm.weight"] = torch.ones(d)
    state["module.position_ids"] = torch.arange(4096).unsqueeze(0)
    state["module.norm.num_batches_tracked"] = torch.tensor(7)
    state["module.lm_head.weight"] = embed  # tied
    torch.save(state, out + ".pt")
    torch.save(state, out + ".legacy.pt", _use_new_zipfile_serialization=False)
    untied = {k: v for k, v in state.items() if k != "module.lm_head.weight"}
    save_file(untied, out + ".safetensors")
    print(len(state), sum(t.nbytes for k, t in untied.items()))
    """
)


def build(folder: Path, gib: float) -> dict[str, Path]:
    stem = folder / f"model_{gib:g}gib"
    paths = {"pt": Path(f"{stem}.pt"), "legacy": Path(f"{stem}.legacy.pt"), "safetensors": Path(f"{stem}.safetensors")}
    if not all(p.exists() for p in paths.values()):
        print(f"building {gib:g} GiB checkpoints in {folder} ...", file=sys.stderr)
        out = subprocess.run(
            [PYTHON, "-c", BUILD_SCRIPT, str(gib), str(stem)], check=True, capture_output=True, text=True
        )
        print(f"  {out.stdout.strip()} (tensors, bytes)", file=sys.stderr)
    return paths


# ---------------------------------------------------------------------------------------
# Approaches
# ---------------------------------------------------------------------------------------

STRIP = "{k[len('module.'):] if k.startswith('module.') else k: v for k, v in sd.items()}"
BASELINES = {
    "torch.load -> strip -> safetensors save_file": f"""
import sys, torch
from safetensors.torch import save_file
sd = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
sd = {STRIP}
sd.pop("lm_head.weight", None)  # save_file refuses shared tensors
save_file(sd, sys.argv[2])
""",
    "torch.load(mmap=True) -> strip -> save_file": f"""
import sys, torch
from safetensors.torch import save_file
sd = torch.load(sys.argv[1], map_location="cpu", weights_only=True, mmap=True)
sd = {STRIP}
sd.pop("lm_head.weight", None)
save_file(sd, sys.argv[2])
""",
    "torch.load -> strip -> torch.save": f"""
import sys, torch
sd = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
torch.save({STRIP}, sys.argv[2])
""",
    "torch.load -> .to(bfloat16) -> save_file": f"""
import sys, torch
from safetensors.torch import save_file
sd = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
sd = {{k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in ({STRIP}).items()}}
sd.pop("lm_head.weight", None)
save_file(sd, sys.argv[2])
""",
    "torch.load -> .to(float16) -> torch.save": f"""
import sys, torch
sd = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
torch.save({{k: (v.to(torch.float16) if v.is_floating_point() else v) for k, v in ({STRIP}).items()}}, sys.argv[2])
""",
    'python -c "import torch"': "import torch",
}


@dataclass
class Case:
    name: str
    argv: list[str]
    source: Path
    output: Path | None
    cold: bool = False
    env: dict[str, str] | None = None
    walls: list[float] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    user: list[float] = field(default_factory=list)


def ckptconv_case(command: str, names: str, source: Path, output: Path, *options: str, title: str = "") -> Case:
    """``ckptconv COMMAND SOURCE OUTPUT OPTIONS -q`` as a case named ``ckptconv COMMAND NAMES OPTIONS``
    (``names`` spells the files as the tables do, ``x.pt y.safetensors``), or ``title``."""
    name = title or " ".join(["ckptconv", command, names, *options])
    return Case(name, [*CKPTCONV, command, str(source), str(output), *options, "-q"], source, output)


def drop_from_cache(path: Path) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def warm(path: Path) -> None:
    """Read the file once so every approach starts with it in the page cache."""
    with open(path, "rb", buffering=0) as file:
        buffer = bytearray(8 << 20)
        while file.readinto(buffer):
            pass


def child_env(tree: Path, cache: Path) -> dict[str, str]:
    """The environment a child runs ckptconv from ``tree`` in, with bytecode cached in ``cache``.

    Installed packages come with compiled bytecode (pip compiles it), but a checkout run with
    PYTHONDONTWRITEBYTECODE=1 (as some sandboxes set) compiles every module on every start:
    about 50 ms of a 0.1 s command. The first, untimed round fills the cache.
    """
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONPYCACHEPREFIX": str(cache)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def busy_cpu_seconds(*, user_only: bool = False) -> float:
    """CPU time all cores have spent busy since boot (/proc/stat; time stolen by the host counted).

    ``user_only`` counts user time and stolen time only: the kernel's writeback of a run's own
    output (4 GiB without fsync) runs in kernel threads, as system time nobody else caused.
    """
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:9]]
    busy = fields[0] + fields[1] + fields[7] if user_only else sum(fields) - fields[3] - fields[4]
    return busy / os.sysconf("SC_CLK_TCK")


def wait_for_idle(limit_s: float = 300) -> None:
    """Return once the machine spent a quiet spell (IDLE_WINDOW_S) with next to no CPU in use."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = busy_cpu_seconds()
        time.sleep(IDLE_WINDOW_S)
        if busy_cpu_seconds() - before < 0.05:
            return


def run_once(case: Case, *, timed: bool = True, idle_only: bool = False) -> None:
    """Run ``case`` once; with ``idle_only``, again until no other process used the CPU meanwhile."""
    for _ in range(IDLE_ATTEMPTS if idle_only and timed and TIME else 1):
        _prepare(case)  # before the quiet spell: the sync's writeback is not another process's work
        if idle_only and timed and TIME:
            wait_for_idle()
        before = busy_cpu_seconds(user_only=True)
        _run_once(case, timed=timed)
        others = busy_cpu_seconds(user_only=True) - before - (case.user[-1] if timed and TIME else 0.0)
        if not (idle_only and timed and TIME) or others <= IDLE_SLACK_S:
            return
        case.walls.pop()
        case.rss.pop()
        case.cpu.pop()
        case.user.pop()
        retaken[case.name] = retaken.get(case.name, 0) + 1
        print(f"  again: {case.name} (other processes used {others:.2f} s of user CPU)", file=sys.stderr)
    raise SystemExit(f"{case.name}: other processes kept using the CPU for {IDLE_ATTEMPTS} runs; try again later")


def _prepare(case: Case) -> None:
    if case.output is not None and case.output.exists():
        case.output.unlink()
    # Flush earlier runs' dirty pages first: their writeback would throttle
    # whichever command happens to run next.
    os.sync()
    if case.cold:
        drop_from_cache(case.source)
    else:
        warm(case.source)


def _run_once(case: Case, *, timed: bool = True) -> None:
    """Run ``case`` once, recording its wall time, peak RSS and CPU time if ``timed``."""
    # GNU time measures the peak RSS: a child of this Python process would
    # inherit its high-water mark across fork and exec.
    rss_file = case.source.parent / "rss.txt"
    argv = ["/usr/bin/time", "-f", "%M %U %S", "-o", str(rss_file), *case.argv] if TIME else case.argv
    start = time.perf_counter()
    # Run outside any source tree: `python -m` puts the working directory first on sys.path,
    # ahead of PYTHONPATH, so from a checkout every row (--baseline ones too) would run that checkout.
    process = subprocess.run(
        argv,
        check=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=case.env or child_env(HERE.parent, case.source.parent / "pycache"),
        cwd=case.source.parent,
    )
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise SystemExit(f"{case.name} failed ({process.returncode}): {process.stderr.decode()[-2000:]}")
    if not timed:
        return
    case.walls.append(wall)
    if not TIME:
        return
    rss, user, system = rss_file.read_text().split()[-3:]
    case.rss.append(int(rss) * 1024)
    case.cpu.append(float(user) + float(system))
    case.user.append(float(user))


def run_rounds(
    cases: list[Case], runs: int, seed: int, what: str, check: Callable[[Case], None], idle_only: bool
) -> None:
    """An untimed round in order (each output checked by ``check``), then ``runs`` timed rounds."""
    for round_number in range(runs + 1):
        label = f"round {round_number}/{runs}" if round_number else "untimed round (checks, bytecode cache)"
        print(f"{what} {label}", file=sys.stderr)
        # A new order every round: on this kind of VM a command that runs right after a big
        # file was deleted can get slow fresh pages, so a fixed order favours some rows.
        order = list(cases)
        random.Random(seed * 1000 + round_number).shuffle(order)
        for case in order if round_number else cases:
            run_once(case, timed=round_number > 0, idle_only=idle_only)
            if round_number == 0:
                check(case)
            # One output on disk at a time: with --baseline at 4 GiB they would add up to ~80 GB.
            if case.output is not None and case.output.exists():
                case.output.unlink()


def with_baseline(cases: list[Case], baseline: Path) -> list[Case]:
    """Each ckptconv case twice, the second from the ``baseline`` source tree, side by side."""
    result = []
    for case in cases:
        env = child_env(baseline, case.source.parent / "pycache")
        result.append(case)
        if case.name.startswith("ckptconv") and not case.cold:
            output = case.output.with_name("baseline_" + case.output.name) if case.output else None
            argv = [str(output) if case.output and arg == str(case.output) else arg for arg in case.argv]
            result.append(Case(case.name + " [baseline]", argv, case.source, output, env=env))
    return result


def cases_for(paths: dict[str, Path], out: Path, quick: bool) -> list[Case]:
    pt, legacy, st = paths["pt"], paths["legacy"], paths["safetensors"]
    cases = [
        Case("cp", ["cp", str(pt), str(out / "copy.pt")], pt, out / "copy.pt"),
        Case(
            "cp + fsync",
            ["sh", "-c", f"cp {pt} {out / 'copy_sync.pt'} && sync {out / 'copy_sync.pt'}"],
            pt,
            out / "copy_sync.pt",
        ),
        ckptconv_case(
            "convert",
            "x.pt x.safetensors",
            pt,
            out / "b.safetensors",
            title="ckptconv convert x.pt x.safetensors (defaults: fsync, source sha256)",
        ),
        ckptconv_case("convert", "x.pt x.safetensors", pt, out / "h.safetensors", "--no-fsync"),
        ckptconv_case("convert", "x.pt x.safetensors", pt, out / "a.safetensors", *FAST.split()),
        ckptconv_case("strip-module", "x.pt y.pt", pt, out / "c.pt", *FAST.split()),
        ckptconv_case("convert", "x.pt x.safetensors", pt, out / "d.safetensors", "--dtype", "bf16", *FAST.split()),
        ckptconv_case("strip-module", "x.pt y.pt", pt, out / "e.pt", "--dtype", "fp16", *FAST.split()),
        ckptconv_case("strip-module", "legacy.pt y.pt", legacy, out / "f.pt", *FAST.split()),
        ckptconv_case("convert", "x.safetensors y.pt", st, out / "g.pt", *FAST.split()),
        Case("ckptconv inspect x.pt", [*CKPTCONV, "inspect", str(pt)], pt, None),
        Case("ckptconv --help", [*CKPTCONV, "--help"], pt, None),
    ]
    if not quick:
        for name, script in BASELINES.items():
            target = out / ("base.safetensors" if "save_file" in name else "base.pt")
            argv = [PYTHON, "-c", script, str(pt), str(target)]
            cases.append(Case(name, argv, pt, None if "import torch" in name else target))
        cases.append(Case("cp (cold cache)", ["cp", str(pt), str(out / "copy.pt")], pt, out / "copy.pt", cold=True))
        cases.append(
            Case(
                "ckptconv strip-module (cold cache)" + FAST,
                [*CKPTCONV, "strip-module", str(pt), str(out / "c.pt"), *FAST.split(), "-q"],
                pt,
                out / "c.pt",
                cold=True,
            )
        )
    return cases


VERIFY_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from safetensors.torch import load_file
    src, dst, cast = sys.argv[1], sys.argv[2], sys.argv[3]

    def read(path):
        # Independent readers, not ckptconv's: torch.load and the safetensors library.
        if path.endswith(".safetensors"):
            return load_file(path)
        try:
            return torch.load(path, weights_only=True, mmap=True)
        except RuntimeError:  # the legacy format cannot be mapped
            return torch.load(path, weights_only=True)

    want = read(src)
    got = read(dst)
    first_user = {}  # storage -> the first key that uses it (tied weights share one)
    tied = 0
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "": None}[cast]
    for key, tensor in want.items():
        key2 = key[len("module."):] if key.startswith("module.") and key not in got else key
        owner = first_user.setdefault(tensor.untyped_storage().data_ptr(), key2)
        if key2 not in got and owner != key2 and owner in got:
            tied += 1  # a safetensors output stores tied weights once (--tied dedupe)
            continue
        if key2 not in got:
            sys.exit(f"missing {key2}")
        expected = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        a = got[key2].contiguous().reshape(-1).view(torch.uint8)
        b = expected.contiguous().reshape(-1).view(torch.uint8)
        if got[key2].dtype != expected.dtype or got[key2].shape != expected.shape or not torch.equal(a, b):
            sys.exit(f"differs: {key2}")
    print("ok", len(want), "tensors,", tied, "tied")
    """
)


def verify_outputs(cases: list[Case]) -> None:
    """The fast path must produce exactly what torch would: check every ckptconv output once."""
    for case in cases:
        if not case.name.startswith("ckptconv") or case.output is None or not case.output.exists():
            continue
        cast = "bf16" if "bf16" in case.name else "fp16" if "fp16" in case.name else ""
        result = subprocess.run(
            [PYTHON, "-c", VERIFY_SCRIPT, str(case.source), str(case.output), cast],
            capture_output=True,
            text=True,
            check=False,
        )
        status = result.stdout.strip() or result.stderr.strip()[-300:]
        print(f"  verified {case.name}: {status}", file=sys.stderr)
        if result.returncode:
            raise SystemExit(f"output of {case.name} is wrong: {status}")


def report(size: float, cases: list[Case], source_bytes: int) -> list[dict[str, object]]:
    cp_case = next(c for c in cases if c.name == "cp")
    cp_cold = next((c for c in cases if c.name == "cp (cold cache)"), None)
    rows = []
    print(
        f"\n### {size:g} GiB checkpoint ({source_bytes / 2**30:.2f} GiB on disk), "
        f"median and best of {len(cases[0].walls)} runs\n"
    )
    # On a VM whose page allocations are sometimes 3x slower (the host backs freed memory lazily),
    # every command, cp included, has slow runs; the best run shows each one's own cost.
    print("| approach | wall (s) | x cp | best wall (s) | x cp, best | CPU user+sys (s) | peak RSS (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for case in cases:
        wall, best = statistics.median(case.walls), min(case.walls)
        base = cp_cold if case.cold and cp_cold else cp_case
        base_wall, base_best = statistics.median(base.walls), min(base.walls)
        rss = max(case.rss) / 2**20
        cpu = statistics.median(case.cpu) if case.cpu else float("nan")
        print(
            f"| {case.name} | {wall:.2f} | {wall / base_wall:.2f} | {best:.2f} | {best / base_best:.2f} "
            f"| {cpu:.2f} | {rss:.0f} |"
        )
        rows.append(
            {
                "size_gib": size,
                "approach": case.name,
                "wall_s": wall,
                "ratio_to_cp": wall / base_wall,
                "best_wall_s": best,
                "best_ratio_to_cp": best / base_best,
                "peak_rss_mib": rss,
                "walls": case.walls,
                "cpu_s": case.cpu,
            }
        )
    return rows


def add_seed_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seed",
        type=int,
        help="seed of the rounds' orders (printed; random when not given): the same seed gives every row the "
        "same places in every run, so a position's bias (a row right after a big file's deletion gets slow "
        "fresh pages on some VMs) would repeat",
    )


def round_seed(seed: int | None) -> int:
    """``seed``, or a random one; printed, so that a run's orders can be had again."""
    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
    print(f"round orders from --seed {seed}", file=sys.stderr)
    return seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 4], help="checkpoint sizes in GiB")
    parser.add_argument("--runs", type=int, default=5, help="rounds per approach (medians are reported)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "ckptconv-bench")
    parser.add_argument("--quick", action="store_true", help="ckptconv rows only, no torch baselines")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints for another run")
    parser.add_argument("--baseline", type=Path, help="another source tree to run each ckptconv row from too")
    add_seed_option(parser)
    parser.add_argument("--only", nargs="+", help="only the rows whose name contains one of these (cp always runs)")
    parser.add_argument(
        "--idle-only",
        action="store_true",
        help="start each run in a quiet spell, and take a run again when other processes used the CPU meanwhile "
        "(on a machine shared with other work; needs /proc/stat and /usr/bin/time)",
    )
    args = parser.parse_args()
    seed = round_seed(args.seed)

    args.dir.mkdir(parents=True, exist_ok=True)
    results = []
    for size in args.sizes:
        paths = build(args.dir, size)
        out = args.dir / "out"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        cases = cases_for(paths, out, args.quick)
        if args.only:
            cases = [c for c in cases if c.name == "cp" or any(text in c.name for text in args.only)]
        if args.baseline:
            cases = with_baseline(cases, args.baseline)
        run_rounds(cases, args.runs, seed, f"{size:g} GiB", lambda case: verify_outputs([case]), args.idle_only)
        results += report(size, cases, paths["pt"].stat().st_size)
        if retaken:
            print(f"\nRuns taken again because other processes used the CPU meanwhile: {retaken}")
            retaken.clear()
        shutil.rmtree(out, ignore_errors=True)
        if not args.keep:
            for path in paths.values():
                path.unlink()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
