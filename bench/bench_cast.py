"""Benchmark: the cast kernels alone, against torch's own ``Tensor.to`` on one thread.

Times what ``--dtype`` costs per piece, in one process, approaches alternating
within each round: ckptconv's kernel with its overflow count, as the streaming
writer runs it (ml_dtypes' bfloat16 and complex32 casts or the numpy passes, whichever
``_cast._ml_faster`` measures to be the faster here), each of the two forced, and torch's CPU
kernel for reference. Every result is first compared bit for
bit with ``Tensor.to``.

    python bench/bench_cast.py                 # 256 MiB of float32 weights, 9 rounds
    python bench/bench_cast.py --mib 64 --runs 5
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np
import torch

from ckptconv.transforms import casts as _cast
from ckptconv.transforms.casts import buffers, float16, ml_support

CHUNK = 1 << 20  # elements per call, as the streaming writer's 4 MiB pieces of float32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="float32 input size")
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    n = args.mib * 2**20 // 4
    values = (rng.standard_normal(n, dtype=np.float32) * 0.02).astype(np.float32)
    values[::4099] = 0.0  # zeros and tiny values, as in real checkpoints
    values[1::4099] = 1e-7
    out = np.empty(n, np.uint16)
    targets = {"bfloat16": torch.bfloat16, "float16": torch.float16}
    ml_bfloat16, ml_complex32, output_checked = ml_support._ml_bfloat16, float16._ml_complex32, _cast._output_checked
    print(f"ml_dtypes {ml_dtypes.__version__}, numpy {np.__version__}")

    def chunked(target: str) -> Callable[[], None]:
        def run() -> None:
            for start in range(0, n, CHUNK):
                piece = values[start : start + CHUNK]
                dest = out[start : start + CHUNK].view(buffers.storage_dtype(target))
                _cast.cast_counting_overflows(piece, "float32", target, out=dest)

        return run

    def forced(target: str, ml: bool) -> Callable[[], None]:
        """The chunked cast with ml_dtypes' kernel or the numpy passes, whichever _ml_faster would pick."""
        inner = chunked(target)

        def run() -> None:
            saved = _cast._ml_faster, _cast._output_checked
            _cast._ml_faster = lambda target: ml  # type: ignore[assignment]
            _cast._output_checked = functools.cache(output_checked.__wrapped__)
            try:
                inner()
            finally:
                _cast._ml_faster, _cast._output_checked = saved  # type: ignore[assignment]

        return run

    def torch_to(target: str) -> Callable[[], None]:
        source = torch.from_numpy(values)
        dest = torch.from_numpy(out.view(np.int16)).view(targets[target])

        def run() -> None:
            dest.copy_(source)

        return run

    approaches: dict[str, Callable[[], None]] = {}
    for target in targets:
        choice = "ml_dtypes" if _cast._ml_faster(target) else "numpy passes"
        approaches[f"ckptconv {target} (kernel + overflow count; its choice here: {choice})"] = chunked(target)
        if (ml_bfloat16 if target == "bfloat16" else ml_complex32)() is not None:
            approaches[f"ckptconv {target}, ml_dtypes' cast"] = forced(target, ml=True)
            approaches[f"ckptconv {target}, numpy passes"] = forced(target, ml=False)
        approaches[f"torch Tensor.to({target}), 1 thread"] = torch_to(target)
    approaches["memcpy of the float32 input (np.copyto)"] = lambda: np.copyto(np.empty_like(values), values)

    for name, run in approaches.items():
        if name.startswith("ckptconv"):
            target = name.split()[1].rstrip(",")
            run()
            expected = torch.from_numpy(values).to(targets[target]).view(torch.int16).numpy().view(np.uint16)
            if not np.array_equal(out, expected):
                raise SystemExit(f"{name}: differs from Tensor.to")
    walls: dict[str, list[float]] = {name: [] for name in approaches}
    for _ in range(args.runs):
        for name, run in approaches.items():
            start = time.perf_counter()
            run()
            walls[name].append(time.perf_counter() - start)
    print(f"\n{args.mib} MiB of float32 ({n} elements), median of {args.runs}, bit-exact with Tensor.to\n")
    print("| approach | ms | GB/s of input |")
    print("|---|---:|---:|")
    for name, times in walls.items():
        wall = statistics.median(times)
        print(f"| {name} | {wall * 1e3:.1f} | {n * 4 / wall / 1e9:.2f} |")


if __name__ == "__main__":
    main()
