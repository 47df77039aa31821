"""Plain data that balloons: a list of two million small ints or Nones beside a tensor. Opening,
selecting and converting it must take at most a small multiple of the memory torch.load takes for
the same file (peak RSS of child processes; torch.load's includes importing torch, which ckptconv
does not import here). The bounds are in SECURITY.md; the numbers are bench/bench_plain_data.py's."""

from __future__ import annotations

import json
import os
import struct
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


# Safetensors headers and shard indexes (issue #31): a header of 300,000 tensors took 20-27x its size
# once parsed. What each tensor may cost at the peak, in bytes that tracemalloc counts (deterministic,
# unlike RSS; imports done beforehand). With 20,000 tensors, before the fix: 1,178 (open), 1,925
# (inspect), 1,094 (empty tensors), 5,000 (a sharded folder: its index read into a 100 MB buffer) and
# 2,346 (convert); after: 525, 706, 467, 553 and 828.
_HEADER_BOUNDS = {"open": 800, "inspect": 1000, "empty": 800, "sharded": 850, "convert": 1300}

_HEADER_PEAKS = """
import gc, json, sys, tracemalloc
import ckptconv
folder, n = sys.argv[1], int(sys.argv[2])
cases = {
    "open": lambda f: ckptconv.open(f + "/many.safetensors").select(),
    "inspect": lambda f: ckptconv.inspect(f + "/many.safetensors"),
    "empty": lambda f: ckptconv.open(f + "/empty.safetensors").select(),
    "sharded": lambda f: ckptconv.open(f + "/sharded").select(),
    "convert": lambda f: ckptconv.convert(f + "/many.safetensors", f + "/out.safetensors", overwrite=True),
}
for case in cases.values():  # once on a small file, so that no import counts
    case(folder + "/small")
peaks = {}
tracemalloc.start()
for name, case in cases.items():
    gc.collect()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    case(folder)
    peaks[name] = (tracemalloc.get_traced_memory()[1] - before) / n
print(json.dumps(peaks))
"""


def _write_safetensors(path: Path, header: dict[str, object], data: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _header_files(folder: Path, n: int) -> list[str]:
    """``many.safetensors`` (n one-element tensors named as a model's), ``empty.safetensors`` (n empty
    tensors, the shape of the 99 MB header of the review) and ``sharded/`` (the n tensors in 4 shards)."""
    folder.mkdir(exist_ok=True)
    names = [f"model.layers.{i // 8}.mlp.experts.{i % 8}.weight" for i in range(n)]

    def entries(keys: list[str]) -> dict[str, object]:
        return {key: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, key in enumerate(keys)}

    _write_safetensors(folder / "many.safetensors", entries(names), (bytes(range(256)) * (n // 64 + 1))[: 4 * n])
    empty = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(n)}
    _write_safetensors(folder / "empty.safetensors", empty, b"")
    (folder / "sharded").mkdir()
    weight_map: dict[str, str] = {}
    for shard in range(4):
        name = f"model-{shard + 1:05d}-of-00004.safetensors"
        part = names[shard::4]
        _write_safetensors(folder / "sharded" / name, entries(part), bytes(4 * len(part)))
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": 4 * n}, "weight_map": weight_map}
    (folder / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    return names


def test_safetensors_headers_and_shard_indexes_take_bounded_memory_per_tensor(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    n = 20_000
    names = _header_files(tmp_path, n)
    _header_files(tmp_path / "small", 64)
    result = subprocess.run(
        [sys.executable, "-c", _HEADER_PEAKS, str(tmp_path), str(n)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,  # python -c puts the working folder first on sys.path
        check=False,
    )
    assert result.returncode == 0, result.stderr
    peaks = json.loads(result.stdout.splitlines()[-1])
    over = {case: round(peak) for case, peak in peaks.items() if peak > _HEADER_BOUNDS[case]}
    assert not over, (over, _HEADER_BOUNDS)
    # And the output is the input, as the safetensors library reads both.
    with safe_open(tmp_path / "out.safetensors", "pt") as output:
        assert sorted(output.keys()) == sorted(names)
    want, got = load_file(tmp_path / "many.safetensors"), load_file(tmp_path / "out.safetensors")
    assert all(torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)) for key, value in want.items())
