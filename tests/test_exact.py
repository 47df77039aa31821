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


# ---------------------------------------------------------------------------------------
# Storages and tensor bits torch.save never writes
# ---------------------------------------------------------------------------------------


def _retarget_storage(source: Path, target: Path, old_key: str, new_key: str) -> None:
    """Point every reference to storage ``old_key`` at ``new_key`` (same-length keys keep the pickle valid)."""
    with zipfile.ZipFile(source) as archive:
        pickle_name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
        data = archive.read(pickle_name)
    needle = b"X" + struct.pack("<I", len(old_key)) + old_key.encode()
    assert data.count(needle) == 1
    rewrite_zip(
        source, target, {pickle_name: data.replace(needle, b"X" + struct.pack("<I", len(new_key)) + new_key.encode())}
    )


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (torch.float32, torch.int32),
        (torch.int64, torch.float64),
        (torch.float32, torch.uint32),
        (torch.uint16, torch.float16),
    ],
)
def test_one_storage_referred_to_with_two_dtypes_is_refused(
    tmp_path: Path, first: torch.dtype, second: torch.dtype
) -> None:
    plain = tmp_path / "plain.pt"
    torch.save({"x": torch.arange(4).to(first), "y": torch.arange(4, 8).to(second)}, plain)
    source = tmp_path / "two.pt"
    _retarget_storage(plain, source, "1", "0")
    # torch.load gives "y" the first reference's storage type: other values than y's own.
    loaded = torch.load(source, weights_only=True)
    assert loaded["y"].dtype != second or not torch.equal(loaded["y"], torch.arange(4, 8).to(second))
    assert_refused(source, tmp_path, "storage '0' is referred to as")


class _Rebuilt:
    """Pickles as a tensor rebuilt with chosen conj/neg metadata (what a crafted file can say)."""

    def __init__(self, tensor: torch.Tensor, metadata: object) -> None:
        self.tensor, self.metadata = tensor, metadata

    def __reduce_ex__(self, protocol: int) -> tuple[object, tuple[object, ...]]:
        import collections

        t = self.tensor
        if (t.dtype.is_floating_point and t.dtype.itemsize == 1) or t.dtype in (torch.uint16, torch.uint32):
            args = (t.untyped_storage(), 0, tuple(t.shape), t.stride(), False, collections.OrderedDict(), t.dtype)
            return (torch._utils._rebuild_tensor_v3, (*args, self.metadata))
        typed = torch.storage.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype, _internal=True)
        args = (typed, 0, tuple(t.shape), t.stride(), False, collections.OrderedDict())
        return (torch._utils._rebuild_tensor_v2, (*args, self.metadata))


@pytest.mark.parametrize(
    ("tensor", "metadata", "message"),
    [
        (torch.tensor([1.0, -2.0]), {"conj": True}, "carries the conjugate bit"),
        (torch.tensor([True, False]), {"neg": True}, "carries the negative bit"),
        (torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn), {"neg": True}, "carries the negative bit"),
        (torch.tensor([1, 2]).to(torch.uint16), {"neg": True}, "carries the negative bit"),
        (torch.tensor([1.0, 2.0]), {"neg": False}, "is not the conj/neg flags"),  # torch.load sets the bit anyway
        (torch.tensor([1.0, 2.0]), {"zero": True}, "is not the conj/neg flags"),
        (torch.tensor([1.0, 2.0]), [1], "is not the conj/neg flags"),
    ],
)
def test_tensor_bits_torch_save_never_writes_are_refused(
    tmp_path: Path, tensor: torch.Tensor, metadata: object, message: str
) -> None:
    source = tmp_path / "bits.pt"
    torch.save({"x": _Rebuilt(tensor, metadata)}, source)
    assert_refused(source, tmp_path, message)


def test_save_resolves_conj_and_neg_bits_of_the_tensors_it_is_given(tmp_path: Path) -> None:
    c = torch.tensor([1 + 2j, 3 - 4j, -0.5 + 0j])
    state = {"c": c.conj(), "n": c.clone().conj().imag, "neg": torch._neg_view(torch.arange(-3, 3, dtype=torch.int8))}
    for suffix in ("pt", "safetensors"):
        output = tmp_path / f"out.{suffix}"
        ckptconv.save(state, output)
        loaded = (
            torch.load(output, weights_only=True)
            if suffix == "pt"
            else __import__("safetensors.torch").torch.load_file(output)
        )
        for key, tensor in state.items():
            assert torch.equal(loaded[key].resolve_conj().resolve_neg(), tensor.resolve_conj().resolve_neg()), (
                suffix,
                key,
            )
            assert loaded[key].dtype == tensor.dtype
