"""Plain data that balloons: a list of two million small ints or Nones beside a tensor. Opening,
selecting and converting it must take at most a small multiple of the memory torch.load takes for
the same file (peak RSS of child processes; torch.load's includes importing torch, which ckptconv
does not import here). The bounds are in SECURITY.md; the numbers are bench/bench_plain_data.py's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

_PEAK = """
import sys
what, path = sys.argv[1], sys.argv[2]
if what.startswith("torch"):
    import torch
if what.startswith("ckptconv"):
    import ckptconv
if what == "torch":
    torch.load(path, weights_only=True)
elif what == "ckptconv":
    ckptconv.open(path).select()
elif what == "ckptconv-inspect":
    ckptconv.inspect(path)
elif what == "ckptconv-convert":
    from ckptconv.cli import main
    try:
        main(["convert", path, path + ".safetensors", "-q", "--overwrite"])
    except SystemExit as exit:
        assert not exit.code, exit.code
print([line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")][0])
"""


def _peak_kib(what: str, path: Path) -> int:
    """The peak RSS of a fresh process doing ``what``, in KiB."""
    result = subprocess.run(
        [sys.executable, "-c", _PEAK, what, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return int(result.stdout.split()[-1])


@pytest.mark.parametrize("filler", [0, None], ids=["small ints", "None"])
def test_plain_data_takes_a_small_multiple_of_what_torch_load_takes(filler: int | None, tmp_path: Path) -> None:
    path = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2), "data": [filler if filler is None else i % 100 for i in range(2_000_000)]}, path)
    torch_kib = _peak_kib("torch", path)
    for what in ("ckptconv", "ckptconv-inspect", "ckptconv-convert"):
        peak = _peak_kib(what, path)
        # torch.load takes ~240 MiB here; selecting took 2.1x that before the fix (~500 MiB, and 7x
        # of it at 10 million elements), ~0.3x after.
        assert peak <= 1.5 * torch_kib, (what, peak, torch_kib)
