"""Offline check: the float32 -> bfloat16 / float16 fast paths against torch, for every float32 pattern.

Too slow for the test suite (about a minute on one core), run by hand when ml_dtypes, numpy or the
kernels change. It checks what ``ckptconv.transforms.casts`` relies on:

* every tame float32 (finite, not rounding to inf) casts exactly as ``Tensor.to`` does, through
  ``cast_counting_overflows`` (ml_dtypes' casts, or with ``--numpy`` the numpy passes),
  with no overflow counted;
* ml_dtypes' bfloat16 and complex32 casts turn every other float32 (NaN, inf, overflow) into a 16-bit
  pattern of magnitude at least inf's, which is how a block is found untame from its output.

    python bench/check_casts_exhaustive.py
    python bench/check_casts_exhaustive.py --numpy    # the path without ml_dtypes
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from ckptconv.transforms import casts as _cast
from ckptconv.transforms.casts import buffers, float16, ml_support

CHUNK = 1 << 24


def tame(target: str) -> int:
    """Mismatches against torch over every tame float32 pattern, both signs."""
    limit = _cast._overflow_threshold("float32", target)
    assert limit is not None
    torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[target]
    bad = 0
    for sign in (0, 0x80000000):
        for start in range(0, limit, CHUNK):
            bits = np.arange(start, min(start + CHUNK, limit), dtype=np.uint32) | np.uint32(sign)
            values = bits.view(np.float32)
            ours, overflows = _cast.cast_counting_overflows(values, "float32", target)
            expected = torch.from_numpy(values).to(torch_dtype).view(torch.int16).numpy().view(np.uint16)
            wrong = np.flatnonzero(ours.view(np.uint16) != expected)
            if overflows or wrong.size:
                bad += int(wrong.size) + overflows
                print(f"  {target}: {wrong.size} differ from {hex(int(bits[0]))}, {overflows} overflows counted")
    return bad


def untame_outputs_are_inf_or_nan(target: str) -> int:
    """Untame float32 patterns that ml_dtypes' cast turns into a finite 16-bit value."""
    checked = _cast._output_checked("float32", target)
    if checked is None:
        print(f"  {target}: ml_dtypes' cast is not used")
        return 0
    cast, inf = checked
    first = _cast._overflow_threshold("float32", target)
    assert first is not None
    bad = 0
    for sign in (0, 0x80000000):
        for start in range(first, 0x80000000, CHUNK):
            bits = np.arange(start, min(start + CHUNK, 0x80000000), dtype=np.uint64).astype(np.uint32)
            bits |= np.uint32(sign)
            if bits.size % 2:
                bits = np.concatenate([bits, bits[-1:]])
            out = np.empty(bits.size, buffers.storage_dtype(target))
            with np.errstate(all="ignore"):
                cast(bits.view(np.float32), out)
            bad += int(np.count_nonzero(out.view(np.uint16) & np.uint16(0x7FFF) < inf))
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numpy", action="store_true", help="check the numpy passes (no ml_dtypes)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.numpy:
        ml_support._ml_bfloat16 = lambda: None  # type: ignore[assignment]
        float16._ml_complex32 = lambda: None  # type: ignore[assignment]
        _cast._output_checked = lambda source, target: None  # type: ignore[assignment]
    else:  # ml_dtypes' casts (ckptconv uses them where a program has loaded ml_dtypes), even where slower
        import ml_dtypes  # noqa: F401

        _cast._ml_faster = lambda target: True  # type: ignore[assignment]
    failures = 0
    for target in ("float16", "bfloat16"):
        start = time.perf_counter()
        bad = tame(target) + (0 if args.numpy else untame_outputs_are_inf_or_nan(target))
        print(f"{target}: {'ok' if not bad else f'{bad} wrong'} ({time.perf_counter() - start:.0f} s)")
        failures += bad
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
