"""Files written under torch.serialization.skip_data: storages recorded with CRC 0 and no bytes (a hole,
read as zeros). torch.load reads them; ckptconv converts them as torch reads them, with a note."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import run_cli

skip_data = getattr(torch.serialization, "skip_data", None)
pytestmark = pytest.mark.skipif(skip_data is None, reason="torch.serialization.skip_data is torch >= 2.5")


def _saved(path: Path) -> Path:
    assert skip_data is not None
    with skip_data():
        torch.save({"w": torch.randn(64, 64), "b": torch.ones(3, dtype=torch.float16), "n": torch.tensor(7)}, path)
    return path


def test_a_skip_data_file_converts_as_torch_reads_it_with_a_note(tmp_path: Path) -> None:
    source, out = _saved(tmp_path / "skipped.pt"), tmp_path / "out.safetensors"
    code, _, stderr = run_cli("convert", str(source), str(out))
    assert code == 0, stderr
    assert "note: " in stderr and "skip_data" in stderr, stderr
    expected = torch.load(source, weights_only=True)
    converted = load_file(out)
    assert sorted(converted) == sorted(expected)
    for key, value in expected.items():
        assert converted[key].dtype == value.dtype and torch.equal(converted[key], value), key
    again = tmp_path / "again.pt"  # a .pt copy records the CRC-32 of the zeros it holds, a true one
    assert run_cli("convert", str(source), str(again), "-q")[0] == 0
    with zipfile.ZipFile(again) as archive:
        assert archive.testzip() is None


def test_a_record_with_crc_zero_that_holds_bytes_is_still_damaged(tmp_path: Path) -> None:
    source = _saved(tmp_path / "skipped.pt")
    with zipfile.ZipFile(source) as archive:
        info = archive.getinfo("skipped/data/0")
        with source.open("rb") as file:
            file.seek(info.header_offset + 26)
            name_length, extra_length = int.from_bytes(file.read(2), "little"), int.from_bytes(file.read(2), "little")
        start = info.header_offset + 30 + name_length + extra_length
    with source.open("r+b") as file:
        file.seek(start + 5)
        file.write(b"\x01")
    code, _, stderr = run_cli("convert", str(source), str(tmp_path / "out.safetensors"))
    assert code == 1 and "is damaged" in stderr, stderr
