"""Benchmark: a DCP checkpoint folder (what FSDP/``torch.distributed.checkpoint`` and Megatron-Core's
``torch_dist`` write) to one file, ckptconv against torch's own consolidation; and, with ``--write``,
ckptconv writing a DCP folder beside it writing safetensors.

    python bench/bench_dcp.py                 # a 1 GiB (fp32) model saved with dcp.save, 3 rounds
    python bench/bench_dcp.py --gib 0.5 --runs 1
    python bench/bench_dcp.py --write         # convert model.safetensors out/ --to dcp | safetensors, 5 rounds
    python bench/bench_dcp.py --write --code /path/to/other/checkout   # another checkout's ckptconv

``--write`` builds a 45 MiB fp32 model (6 transformer layers of width 384, 99 tensors) with the safetensors
library and runs, in fresh processes, alternating: the command as a user types it
(``python -m ckptconv convert model.safetensors out/ --to dcp -q``: wall time seen from outside and
the child's ``ru_maxrss``), and the library call alone (``ckptconv.convert(src, "out/", to=...)`` timed
inside a fresh interpreter after its imports; peak RSS of that process, and whether torch got imported).
Medians of the rounds; the DCP output is then loaded by ``torch.distributed.checkpoint.load`` and
compared bit for bit with the safetensors library's reading of the source.

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
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
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


WRITE_BUILD = textwrap.dedent(
    """
    import sys, torch
    from safetensors.torch import save_file
    torch.manual_seed(0)
    width, vocab, state = 384, 3072, {}
    state["embed.weight"] = torch.randn(vocab, width)
    for i in range(6):
        p = f"layers.{i}."
        for name in ("q", "k", "v", "o"):
            state[p + f"attn.{name}.weight"] = torch.randn(width, width)
            state[p + f"attn.{name}.bias"] = torch.randn(width)
        state[p + "mlp.up.weight"] = torch.randn(4 * width, width)
        state[p + "mlp.up.bias"] = torch.randn(4 * width)
        state[p + "mlp.down.weight"] = torch.randn(width, 4 * width)
        state[p + "mlp.down.bias"] = torch.randn(width)
        for norm in ("ln1", "ln2"):
            state[p + f"{norm}.weight"] = torch.ones(width)
            state[p + f"{norm}.bias"] = torch.zeros(width)
    state["norm.weight"], state["norm.bias"] = torch.ones(width), torch.zeros(width)
    save_file(state, sys.argv[1])
    """
)

MEASURE_CALL = textwrap.dedent(
    """
    import json, resource, sys, time
    src, dst, to = sys.argv[1:4]
    import ckptconv
    from ckptconv import conversion  # the library's imports, before the clock starts
    started = time.perf_counter()
    ckptconv.convert(src, dst, to=to)
    elapsed = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": elapsed, "peak_mib": peak / 1024, "torch": "torch" in sys.modules}))
    """
)

CHECK_DCP = textwrap.dedent(
    """
    import sys, warnings, torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    source = load_file(sys.argv[1])
    state = {key: torch.empty_like(value) for key, value in source.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=sys.argv[2], no_dist=True)
    assert all(torch.equal(state[key], value) for key, value in source.items())
    print(f"dcp.load: identical ({len(source)} tensors)")
    """
)


def _env(code: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")])}


def measure_cli(code: Path, src: Path, dst: Path, to: str) -> dict[str, float]:
    """``python -m ckptconv convert SRC DST/ --to TO -q`` in a fresh process: wall time and its ru_maxrss."""
    shutil.rmtree(dst, ignore_errors=True)
    # -P: not the current folder's ckptconv (when --code names another checkout)
    command = [sys.executable, "-P", "-m", "ckptconv", "convert", str(src), f"{dst}/", "--to", to, "-q"]
    started = time.perf_counter()
    child = subprocess.Popen(command, env=_env(code), stderr=subprocess.PIPE, cwd=dst.parent)
    _, status, usage = os.wait4(child.pid, 0)
    elapsed = time.perf_counter() - started
    stderr = child.stderr.read().decode() if child.stderr else ""
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(command)} failed:\n{stderr[-3000:]}")
    return {"seconds": elapsed, "peak_mib": usage.ru_maxrss / 1024}


def measure_call(code: Path, src: Path, dst: Path, to: str) -> dict[str, float]:
    shutil.rmtree(dst, ignore_errors=True)
    command = [sys.executable, "-P", "-c", MEASURE_CALL, str(src), f"{dst}/", to]
    result = subprocess.run(command, capture_output=True, text=True, env=_env(code), cwd=dst.parent, check=False)
    if result.returncode:
        raise SystemExit(f"ckptconv.convert(to={to!r}) failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def bench_write(code: Path, runs: int) -> None:
    with tempfile.TemporaryDirectory() as work:
        src = Path(work) / "model.safetensors"
        subprocess.run([sys.executable, "-c", WRITE_BUILD, str(src)], check=True, capture_output=True)
        print(f"model.safetensors: {src.stat().st_size / 2**20:.1f} MiB; ckptconv from {code}")
        rows: dict[tuple[str, str], list[dict[str, float]]] = {}
        for _ in range(runs):  # alternating, so machine noise hits all alike
            for to in ("dcp", "safetensors"):
                rows.setdefault(("command", to), []).append(measure_cli(code, src, Path(work) / to, to))
                rows.setdefault(("convert()", to), []).append(measure_call(code, src, Path(work) / to, to))
        for (how, to), measured in rows.items():
            torch_imported = any(r.get("torch") for r in measured)
            print(
                f"{how:>9} --to {to:<11}: {statistics.median(r['seconds'] for r in measured):5.2f} s  "
                f"peak RSS {statistics.median(r['peak_mib'] for r in measured):5.0f} MiB"
                + (f"  torch imported: {'yes' if torch_imported else 'no'}" if how == "convert()" else "")
            )
        checked = subprocess.run(
            [sys.executable, "-c", CHECK_DCP, str(src), str(Path(work) / "dcp")],
            capture_output=True,
            text=True,
            check=False,
        )
        print(checked.stdout.strip() or checked.stderr.strip()[-500:])


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
    parser.add_argument("--runs", type=int, default=None, help="rounds (3, or 5 with --write)")
    parser.add_argument("--write", action="store_true", help="bench writing a DCP folder instead")
    parser.add_argument("--code", type=Path, default=ROOT, help="the checkout whose ckptconv runs (--write)")
    args = parser.parse_args()
    if args.write:
        bench_write(args.code.resolve(), args.runs or 5)
        return
    args.runs = args.runs or 3
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
