"""Benchmark: a DeepSpeed ZeRO-2 checkpoint to one safetensors file, ckptconv against zero_to_fp32.

    python bench/bench_zero.py                   # a 1 GiB (fp32) model on 2 ranks, 3 rounds
    python bench/bench_zero.py --gib 0.5 --runs 1
    PYTHONPATH=/path/with/deepspeed python bench/bench_zero.py   # also times DeepSpeed's own script

The checkpoint is laid out as DeepSpeed lays out ZeRO-2 (``latest``, ``global_step7/``,
``mp_rank_00_model_states.pt`` with bf16 module weights, one ``bf16_zero_pp_rank_R_mp_rank_00_optim_states.pt``
per rank holding its fp32 partition and Adam's two moments), with plain dicts instead of DeepSpeed's classes
so that both tools read the same files. Each tool runs in a fresh process; reported are the median wall
time and the peak RSS (``ru_maxrss``), also minus the RSS after the tool's imports. DeepSpeed's side is
``get_fp32_state_dict_from_zero_checkpoint`` followed by ``safetensors.torch.save_file`` (what its
``convert_zero_checkpoint_to_state_dict(..., safe_serialization=True)`` does). Outputs are compared bit
for bit once.
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

BUILD = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    gib, folder, world = float(sys.argv[1]), Path(sys.argv[2]), 2
    torch.manual_seed(0)
    shapes, total, i = {}, 0, 0
    while total < gib * 2**30:
        shapes[f"model.layers.{i}.weight"] = (2048, 2048)
        shapes[f"model.layers.{i}.norm"] = (2048,)
        total += (2048 * 2048 + 2048) * 4
        i += 1
    flat = torch.randn(sum(torch.Size(s).numel() for s in shapes.values()))
    flat = torch.cat([flat, torch.zeros(-len(flat) % (2 * world))])
    step = folder / "global_step7"
    step.mkdir(parents=True)
    (folder / "latest").write_text("global_step7")
    module, at = {}, 0
    for name, shape in shapes.items():
        n = torch.Size(shape).numel()
        module[name] = flat[at : at + n].view(shape).to(torch.bfloat16)
        at += n
    torch.save({"module": module, "buffer_names": [], "param_shapes": [{k: torch.Size(v) for k, v in shapes.items()}],
                "frozen_param_shapes": None, "frozen_param_fragments": None, "shared_params": {},
                "optimizer": None, "ds_version": "synthetic"}, step / "mp_rank_00_model_states.pt")
    for rank, part in enumerate(flat.chunk(world)):
        state = {"zero_stage": 2, "partition_count": [world], "single_partition_of_fp32_groups": [part.clone()],
                 "base_optimizer_state": {"state": {0: {"exp_avg": part * 0.5, "exp_avg_sq": part * part}}}}
        torch.save({"optimizer_state_dict": state}, step / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
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
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        from safetensors.torch import save_file
        def run():
            save_file(get_fp32_state_dict_from_zero_checkpoint(src), dst, metadata={"format": "pt"})
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
    import sys
    from safetensors import safe_open
    with safe_open(sys.argv[1], "pt") as a, safe_open(sys.argv[2], "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for key in a.keys():
            x, y = a.get_tensor(key), b.get_tensor(key)
            assert x.dtype == y.dtype and x.shape == y.shape and x.view(-1).view(__import__("torch").uint8).equal(
                y.view(-1).view(__import__("torch").uint8)), key
    print("identical")
    """
)


def measure(tool: str, src: Path, dst: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("DS_ACCELERATOR", "cpu")
    dst.unlink(missing_ok=True)
    result = subprocess.run(  # noqa: PLW1510 - checked below
        [sys.executable, "-c", MEASURE, tool, str(src), str(dst)], capture_output=True, text=True, env=env
    )
    if result.returncode:
        raise SystemExit(f"{tool} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    tools = ["ckptconv"]
    probe = subprocess.run(  # noqa: PLW1510 - only asks whether deepspeed imports
        [sys.executable, "-c", "import deepspeed.utils.zero_to_fp32"],
        capture_output=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    if probe.returncode == 0:
        tools.append("zero_to_fp32")
    with tempfile.TemporaryDirectory() as work:
        src = Path(work) / "run"
        subprocess.run([sys.executable, "-c", BUILD, str(args.gib), str(src)], check=True)
        size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        print(f"ZeRO-2 checkpoint on 2 ranks: {size / 2**30:.2f} GiB on disk, {args.gib} GiB of fp32 weights")
        outputs = {}
        for tool in tools:
            rows = [measure(tool, src, Path(work) / f"{tool}.safetensors") for _ in range(args.runs)]
            outputs[tool] = Path(work) / f"{tool}.safetensors"
            print(
                f"{tool:>13}: {statistics.median(r['seconds'] for r in rows):6.2f} s  "
                f"peak RSS {max(r['peak_mib'] for r in rows):7.0f} MiB  "
                f"(+{max(r['grown_mib'] for r in rows):.0f} MiB after imports)"
            )
        if len(outputs) == 2:
            subprocess.run([sys.executable, "-c", COMPARE, *map(str, outputs.values())], check=True)


if __name__ == "__main__":
    main()
