"""Exact or refused: inputs that readers could resolve two ways, or that hold other bytes than they claim.

Each case is refused with one line (naming what is wrong) by the library, the CLI and ``ckptconv.load``;
none may produce other values than ``torch.load(weights_only=True)`` gives.
"""

from __future__ import annotations

import struct
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import ckptconv
from ckptconv.errors import MalformedCheckpointError

from .conftest import run_cli


def assert_refused(source: Path, tmp_path: Path, message: str) -> None:
    """The library, ckptconv.load and the CLI all refuse ``source`` with one line containing ``message``."""
    with pytest.raises(MalformedCheckpointError) as caught:
        ckptconv.load(source)
    assert message in str(caught.value)
    for suffix in ("pt", "safetensors"):
        output = tmp_path / f"out.{suffix}"
        code, stdout, stderr = run_cli("convert", str(source), str(output))
        assert (code, stdout) == (1, ""), stderr
        assert stderr.count("\n") == 1 and stderr.startswith("ckptconv: error: ") and message in stderr, stderr
        assert not output.exists()


def rewrite_zip(
    source: Path, target: Path, change: dict[str, bytes], *, append: dict[str, bytes] | None = None
) -> None:
    """Copy a zip checkpoint record by record (stored), replacing some records and appending others."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as new:
        for info in old.infolist():
            new.writestr(info.filename, change.get(info.filename, old.read(info)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Duplicate name"
            for name, data in (append or {}).items():
                new.writestr(name, data)


def test_duplicate_record_names_are_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.arange(4, dtype=torch.float32)}, plain)
    with zipfile.ZipFile(plain) as archive:
        name = next(n for n in archive.namelist() if n.endswith("/data/0"))
    source = tmp_path / "dup.pt"
    rewrite_zip(plain, source, {}, append={name: torch.full((4,), 7.0).numpy().tobytes()})
    # torch reads the first record; zipfile's directory (and ckptconv before this check) the last.
    assert torch.equal(torch.load(source, weights_only=True)["w"], torch.arange(4, dtype=torch.float32))
    assert_refused(source, tmp_path, f"it holds two records named {name!r}")


def test_local_header_that_disagrees_with_the_directory_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "renamed.pt"
    torch.save({"w": torch.arange(4, dtype=torch.float32)}, source)
    with zipfile.ZipFile(source) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    data = bytearray(source.read_bytes())
    name_length = struct.unpack("<H", data[info.header_offset + 26 : info.header_offset + 28])[0]
    name_at = info.header_offset + 30 + name_length - 1
    data[name_at : name_at + 1] = b"9"  # local header says .../data/9
    source.write_bytes(bytes(data))
    assert_refused(source, tmp_path, "disagrees with its directory entry")


# ---------------------------------------------------------------------------------------
# safetensors: the reference reader's rules (the installed safetensors library is the oracle)
# ---------------------------------------------------------------------------------------


def _f32(begin: int, end: int, shape: list[int] | None = None) -> dict[str, object]:
    return {"dtype": "F32", "shape": [1] if shape is None else shape, "data_offsets": [begin, end]}


SAFETENSORS_CASES = {
    # name: (header, data length, what ckptconv's refusal says; "" where the reference reads the file)
    "hole between tensors": ({"a": _f32(0, 4), "b": _f32(8, 12)}, 12, "leaves bytes 4-8 unindexed"),
    "hole before the first tensor": ({"a": _f32(4, 8)}, 8, "leaves bytes 0-4 unindexed"),
    "trailing bytes": ({"a": _f32(0, 4)}, 8, "4 bytes after the last tensor belong to no tensor"),
    "trailing bytes, no tensors": ({}, 1, "1 bytes after the last tensor"),
    "two tensors on the same bytes": ({"a": _f32(0, 4), "b": _f32(0, 4)}, 4, "overlaps the tensor before it"),
    "overlap hidden behind an empty tensor": (
        {"a": _f32(0, 8, [2]), "e": _f32(4, 4, [0]), "b": _f32(4, 8)},
        8,
        "overlaps the tensor before it",
    ),
    "empty tensor inside another": ({"a": _f32(0, 4), "e": _f32(2, 2, [0]), "b": _f32(4, 8)}, 8, "overlaps"),
    "empty tensor past the end": ({"a": _f32(0, 4), "e": _f32(8, 8, [0])}, 4, "is truncated"),
    "__metadata__ is a list": ({"__metadata__": [], "a": _f32(0, 4)}, 4, "not a map of strings to strings"),
    "__metadata__ is an empty string": ({"__metadata__": "", "a": _f32(0, 4)}, 4, "not a map of strings"),
    "__metadata__ has a number": ({"__metadata__": {"x": 1}, "a": _f32(0, 4)}, 4, "not a map of strings"),
    "empty tensor at the end": ({"a": _f32(0, 4), "e": _f32(4, 4, [0])}, 4, ""),
    "__metadata__ is null": ({"__metadata__": None, "a": _f32(0, 4)}, 4, ""),
    "tensors listed out of order": ({"b": _f32(4, 8), "a": _f32(0, 4)}, 8, ""),
}


@pytest.mark.parametrize("case", SAFETENSORS_CASES)
def test_safetensors_files_follow_the_reference_readers_rules(tmp_path: Path, case: str) -> None:
    import json

    import safetensors.torch

    header, length, message = SAFETENSORS_CASES[case]
    encoded = json.dumps(header).encode()
    source = tmp_path / "x.safetensors"
    source.write_bytes(len(encoded).to_bytes(8, "little") + encoded + bytes(range(length)))
    if message:
        with pytest.raises(safetensors.SafetensorError):
            safetensors.torch.load_file(source)
        assert_refused(source, tmp_path, message)
    else:
        reference = safetensors.torch.load_file(source)
        ours = ckptconv.load(source)
        assert sorted(ours) == sorted(reference)
        for key, tensor in reference.items():
            assert torch.equal(ours[key], tensor)
