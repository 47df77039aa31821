"""Exact or refused: inputs that readers could resolve two ways, or that hold other bytes than they claim.

Each case is refused with one line (naming what is wrong) by the library, the CLI and ``ckptconv.load``;
none may produce other values than ``torch.load(weights_only=True)`` gives.
"""

from __future__ import annotations

import contextlib
import pickle
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import ckptconv
from ckptconv.errors import LoadError, MalformedCheckpointError

from .conftest import run_cli, torch_saves


def assert_refused(source: Path, tmp_path: Path, message: str) -> None:
    """The library, ckptconv.load and the CLI all refuse ``source`` with one line containing ``message``."""
    with pytest.raises(LoadError) as caught:
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
    # torch 2.13 reads the first record, torch 2.4 the last; zipfile's directory (and ckptconv before
    # this check) the last.
    read = torch.load(source, weights_only=True)["w"]
    assert torch.equal(read, torch.arange(4, dtype=torch.float32)) or torch.equal(read, torch.full((4,), 7.0))
    assert_refused(source, tmp_path, f"holds two records named {name!r}; torch reads the first or the last by its")


@pytest.mark.parametrize(
    "spell",
    [
        pytest.param(lambda rest: rest.replace("data.pkl", "DATA.PKL"), id="pickle"),
        pytest.param(lambda rest: rest.replace("data/", "Data/"), id="storages"),
        pytest.param(str.upper, id="every-record"),
    ],
)
def test_record_names_are_found_whatever_their_case_as_torch_finds_them(tmp_path: Path, spell: Any) -> None:
    """torch's reader (miniz without MZ_ZIP_FLAG_CASE_SENSITIVE) finds 'data.pkl' as 'archive/DATA.PKL' and
    storage '0' as 'archive/Data/0'; ckptconv read such files as 'not a checkpoint' or 'damaged'."""
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([1, -2])}, plain)
    source = tmp_path / "cased.pt"
    with zipfile.ZipFile(plain) as old, zipfile.ZipFile(source, "w", zipfile.ZIP_STORED) as new:
        for info in old.infolist():
            root, rest = info.filename.split("/", 1)
            new.writestr(f"{root}/{spell(rest)}", old.read(info))
    with zipfile.ZipFile(plain) as old, zipfile.ZipFile(source) as new:
        assert set(old.namelist()) - set(new.namelist())  # the case really changed
    expected = torch.load(source, weights_only=True)
    for suffix in ("pt", "safetensors"):
        output = tmp_path / f"out.{suffix}"
        code, _stdout, stderr = run_cli("convert", str(source), str(output))
        assert code == 0, stderr
        got = torch.load(output, weights_only=True) if suffix == "pt" else safetensors.torch.load_file(output)
        assert sorted(got) == sorted(expected)
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)
    loaded = ckptconv.load(source)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in expected.items())


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


_NEEDS_SAVED_UINT = pytest.mark.skipif(
    not (torch_saves("uint16") and torch_saves("uint32")),
    reason="this torch.save cannot write uint16/uint32 tensors (torch 2.4 has no storage type for them)",
)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (torch.float32, torch.int32),
        (torch.int64, torch.float64),
        pytest.param(torch.float32, torch.uint32, marks=_NEEDS_SAVED_UINT),
        pytest.param(torch.uint16, torch.float16, marks=_NEEDS_SAVED_UINT),
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


# ---------------------------------------------------------------------------------------
# CRC-32 of the records read
# ---------------------------------------------------------------------------------------


def _damaged_checkpoint(tmp_path: Path) -> tuple[Path, str]:
    """A torch zip whose record for ``w`` has one flipped bit; torch.load reads it without a word."""
    source = tmp_path / "damaged.pt"
    torch.save({"w": torch.arange(16, dtype=torch.float32), "b": torch.ones(2)}, source)
    with zipfile.ZipFile(source) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    data = bytearray(source.read_bytes())
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    data[info.header_offset + 30 + name_length + extra_length + 9] ^= 0x10
    source.write_bytes(bytes(data))
    return source, info.filename


def test_records_that_do_not_match_their_crc_are_refused(tmp_path: Path) -> None:
    source, record = _damaged_checkpoint(tmp_path)
    damaged = torch.load(source, weights_only=True)
    assert not torch.equal(damaged["w"], torch.arange(16, dtype=torch.float32))  # torch launders it
    assert_refused(source, tmp_path, f"record {record!r} (tensor 'w') has CRC-32")
    _, _, stderr = run_cli("convert", str(source), str(tmp_path / "x.safetensors"))
    assert stderr.rstrip().endswith("pass --no-crc-check to convert its bytes anyway")
    with pytest.raises(MalformedCheckpointError, match="tensor 'w'"):
        ckptconv.verify(source, tmp_path / "anything.pt")


def test_no_crc_check_rescues_a_damaged_file_as_torch_reads_it(tmp_path: Path) -> None:
    import safetensors.torch

    source, _ = _damaged_checkpoint(tmp_path)
    output = tmp_path / "rescued.safetensors"
    code, _, stderr = run_cli("convert", str(source), str(output), "--no-crc-check", "-q")
    assert (code, stderr) == (0, "")
    damaged = torch.load(source, weights_only=True)
    rescued = safetensors.torch.load_file(output)
    assert all(torch.equal(rescued[key], damaged[key]) for key in damaged)
    loaded = ckptconv.load(source, check_crc=False)
    assert all(torch.equal(loaded[key], damaged[key]) for key in damaged)


def _save_without_crcs(state: dict[str, torch.Tensor], path: Path) -> None:
    """torch.save with `compute_crc32 = False` (torch.utils.serialization.config, from torch 2.6); before
    it, torch.save's file with every CRC-32 field (local headers and central directory) made 0."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        torch.save(state, path)
        data = bytearray(path.read_bytes())
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                assert data[info.header_offset : info.header_offset + 4] == b"PK\x03\x04"
                data[info.header_offset + 14 : info.header_offset + 18] = bytes(4)
        at = data.find(b"PK\x01\x02")
        while at >= 0:
            data[at + 16 : at + 20] = bytes(4)
            at = data.find(b"PK\x01\x02", at + 4)
        path.write_bytes(bytes(data))
        return
    config.save.compute_crc32 = False
    try:
        torch.save(state, path)
    finally:
        config.save.compute_crc32 = True


def test_a_file_saved_without_crcs_converts_as_torch_reads_it(tmp_path: Path) -> None:
    """torch.save with `compute_crc32 = False` records 0 as every CRC-32; torch.load reads the file, so
    ckptconv does, bit for bit (such a file has no checksum to check), in every output and in verify."""
    import safetensors.torch

    source = tmp_path / "nocrc.pt"
    _save_without_crcs({"w": torch.randn(33, 7), "i": torch.arange(5), "h": torch.randn(4).half()}, source)
    with zipfile.ZipFile(source) as archive:
        assert {info.CRC for info in archive.infolist()} == {0}
    expected = torch.load(source, weights_only=True)
    for name in ("out.safetensors", "out.pt"):
        output = tmp_path / name
        code, _, stderr = run_cli("convert", str(source), str(output), "--verify=torch", "-q")
        assert (code, stderr) == (0, ""), stderr
        written = (
            safetensors.torch.load_file(output)
            if name.endswith("safetensors")
            else torch.load(output, weights_only=True)
        )
        assert written.keys() == expected.keys()
        for key, tensor in expected.items():
            assert written[key].dtype == tensor.dtype
            assert torch.equal(written[key].view(torch.uint8), tensor.view(torch.uint8)), key
    assert ckptconv.verify(source, tmp_path / "out.pt").ok


def test_one_record_with_crc_zero_in_a_file_with_crcs_is_refused(tmp_path: Path) -> None:
    """Zero is "not recorded" only when the whole archive records none; one zeroed CRC is a mismatch."""
    source = tmp_path / "zeroed.pt"
    torch.save({"w": torch.arange(16, dtype=torch.float32)}, source)
    with zipfile.ZipFile(source) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    _set_record_crc(source, info, 0)
    assert_refused(source, tmp_path, f"record {info.filename!r} (tensor 'w') has CRC-32")


def _set_record_crc(source: Path, info: zipfile.ZipInfo, crc: int) -> None:
    """Record ``crc`` as the CRC-32 of one member, in its local header and its central directory entry."""
    data = bytearray(source.read_bytes())
    packed = struct.pack("<I", crc)
    data[info.header_offset + 14 : info.header_offset + 18] = packed  # local header
    position = data.index(b"PK\x01\x02")
    while position >= 0:
        name_length = struct.unpack("<H", data[position + 28 : position + 30])[0]
        if data[position + 46 : position + 46 + name_length].decode() == info.filename:
            data[position + 16 : position + 20] = packed  # central directory
        position = data.find(b"PK\x01\x02", position + 4)
    source.write_bytes(bytes(data))


def test_compressed_records_are_checked_too(tmp_path: Path) -> None:
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.arange(64, dtype=torch.float32)}, plain)
    source = tmp_path / "deflated.pt"
    with zipfile.ZipFile(plain) as old, zipfile.ZipFile(source, "w", zipfile.ZIP_DEFLATED) as new:
        for info in old.infolist():
            new.writestr(info.filename, old.read(info))
    with zipfile.ZipFile(source) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    _set_record_crc(source, info, info.CRC ^ 1)
    # zipfile checks a deflated record's CRC as it decompresses; whoever reads first reports it.
    assert_refused(source, tmp_path, f"record {info.filename!r}")
    code, _, stderr = run_cli("convert", str(source), str(tmp_path / "x.pt"))
    assert code == 1 and "CRC-32" in stderr


# ---------------------------------------------------------------------------------------
# verify --reference torch: an independent reader
# ---------------------------------------------------------------------------------------


def _conj_example(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    c = torch.tensor([1 + 2j, 3 - 4j])
    source = tmp_path / "cn.pt"
    torch.save({"c": c.conj(), "n": c.clone().conj().imag}, source)
    # What main's convert wrote (the conj and neg bits dropped): the stored values.
    return source, {"c": c.clone(), "n": c.imag.clone()}


def test_verify_reference_torch_disagrees_with_the_old_convert_on_the_conj_example(tmp_path: Path) -> None:
    import safetensors.torch

    source, old_output = _conj_example(tmp_path)
    output = tmp_path / "cn.safetensors"
    safetensors.torch.save_file(old_output, output)
    code, stdout, _ = run_cli("verify", str(source), str(output), "--reference", "torch")
    assert code == 3
    assert stdout.splitlines() == [
        "verification failed: 2 differ (e.g. 'c': values differ) (source read by torch.load(weights_only=True); "
        "output by the safetensors library)",
        "  differs: c: values differ",
        "  differs: n: values differ",
    ]
    assert run_cli("convert", str(source), str(output), "--overwrite", "-q") == (0, "", "")
    code, stdout, _ = run_cli("verify", str(source), str(output), "--reference", "torch")
    assert (code, stdout) == (
        0,
        "verified: all 2 tensors match bit for bit (source read by torch.load(weights_only=True); "
        "output by the safetensors library)\n",
    )


def test_a_reader_bug_hides_from_ckptconv_verify_but_not_from_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Simulate the bug this issue fixed (a reader dropping the conj/neg bits): only --verify=torch sees it."""
    import ckptconv.reading.unpickling.rebuild

    source, _ = _conj_example(tmp_path)
    monkeypatch.setattr(ckptconv.reading.unpickling.rebuild, "_tensor_bits", lambda metadata: (False, False))
    output = tmp_path / "out.pt"
    code, _, stderr = run_cli("convert", str(source), str(output), "--verify")
    assert code == 0 and "verified bit for bit" in stderr  # the bug checks itself
    assert run_cli("verify", str(source), str(output))[0] == 0
    code, _, stderr = run_cli("convert", str(source), str(output), "--overwrite", "--verify=torch")
    assert code == 1
    assert stderr == (
        "ckptconv: error: verification failed: 2 differ (e.g. 'c': values differ) (source read by "
        "torch.load(weights_only=True); output by torch.load(weights_only=True)); the output was not written\n"
    )
    assert run_cli("verify", str(source), str(output), "--reference", "torch")[0] == 3


def test_verify_reference_torch_says_when_it_falls_back_to_ckptconv(tmp_path: Path) -> None:
    import pickle

    source = tmp_path / "raw.pkl"
    source.write_bytes(pickle.dumps({"w": __import__("numpy").arange(3, dtype="float32")}))
    output = tmp_path / "out.safetensors"
    assert run_cli("convert", str(source), str(output), "-q")[0] == 0
    code, stdout, _ = run_cli("verify", str(source), str(output), "--reference", "torch")
    assert code == 0
    assert stdout == (
        "verified: all 1 tensors match bit for bit (source read by ckptconv's reader (neither "
        "torch.load(weights_only=True) nor safetensors reads pickle input); output by the safetensors library)\n"
    )


def test_verify_reference_torch_gives_torch_s_reason_for_a_refusal(tmp_path: Path) -> None:
    """torch's refusal opens with advice ("Weights only load failed. ... two options"); the report
    quoted that line instead of the reason."""
    source = tmp_path / "train.pt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "frozen": frozenset({1})}, source)
    with pytest.raises(pickle.UnpicklingError, match="WeightsUnpickler error: Unsupported global"):
        torch.load(source, weights_only=True)
    output = tmp_path / "out.safetensors"
    assert run_cli("convert", str(source), str(output), "-q")[0] == 0
    code, stdout, _ = run_cli("verify", str(source), str(output), "--reference", "torch")
    assert code == 0
    said = "source read by ckptconv's reader (torch.load(weights_only=True) refused it: WeightsUnpickler error: "
    assert said + "Unsupported global: GLOBAL " in stdout and "frozenset was not an allowed global" in stdout


@pytest.mark.parametrize(
    ("name", "code", "data", "added"),
    [("float8_e8m0fnu", "F8_E8M0", bytes([0, 127, 200, 3]), "2.7"), ("float4_e2m1fn_x2", "F4", b"\x12\x34", "2.8")],
)
def test_a_dtype_this_torch_lacks_is_verified_without_it_and_refused_as_a_torch_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, code: str, data: bytes, added: str
) -> None:
    """On torch 2.4 (no float8_e8m0fnu, no float4_e2m1fn_x2) `--verify=torch` and `verify --reference
    torch` ended in the safetensors library's AttributeError traceback (safe_open(framework="pt") makes
    torch tensors); ckptconv reads, writes and verifies such tensors without torch."""
    if hasattr(torch, name):
        monkeypatch.delattr(torch, name)  # this torch as torch 2.4 is
    source = tmp_path / "scales.safetensors"
    header = f'{{"s":{{"dtype":"{code}","shape":[4],"data_offsets":[0,{len(data)}]}}}}'.encode()
    source.write_bytes(struct.pack("<Q", len(header)) + header + data)
    lacking = f"this torch ({torch.__version__}) has no {name} dtype (torch {added} added it)"
    with pytest.raises(ckptconv.CkptconvError) as caught:
        ckptconv.load(source)
    assert str(caught.value) == f"{lacking}; upgrade torch to load these tensors"
    for suffix in ("pt", "safetensors"):
        output = tmp_path / f"out.{suffix}"
        code_, _, stderr = run_cli("convert", str(source), str(output), "--verify=torch")
        assert code_ == 0
        # The summary said "verified bit for bit by torch" though torch had read neither side.
        note, summary = stderr.splitlines()
        assert note.startswith(
            "note: --verify=torch read the source with ckptconv's reader (the safetensors library cannot give it "
            f"to torch: {lacking}), the output with "
        )
        assert summary.endswith(", verified bit for bit)"), summary
        with zipfile.ZipFile(output) if suffix == "pt" else contextlib.nullcontext() as archive:
            stored = (
                archive.read(next(n for n in archive.namelist() if n.endswith("/data/0")))
                if archive
                else output.read_bytes()[-len(data) :]
            )
        assert stored == data
        code_, stdout, stderr = run_cli("verify", str(source), str(output), "--reference", "torch")
        assert (code_, stderr) == (0, ""), stderr
        assert stdout.startswith(
            "verified: all 1 tensors match bit for bit (source read by ckptconv's reader (the safetensors library "
            f"cannot give it to torch: {lacking}); output by "
        ), stdout


@pytest.mark.parametrize("dtype", ["qint8", "quint8", "qint32", "quint4x2"])
def test_verify_reference_torch_reads_quantized_dtypes_as_stored(dtype: str, tmp_path: Path) -> None:
    """Tensors of a quantized dtype saved as bytes (what ckptconv reads and writes) made
    `--verify=torch` fail with "it is a quantized tensor", and a torch warning on stderr."""
    raw = torch.arange(200, 216, dtype=torch.uint8)
    source = tmp_path / "q.pt"
    torch.save({"q": raw.view(getattr(torch, dtype)), "x": torch.ones(2)}, source)
    output = tmp_path / "out.pt"
    code, stdout, stderr = run_cli("convert", str(source), str(output), "--verify=torch", "-q")
    assert (code, stdout, stderr) == (0, "", "")
    expected, written = torch.load(source, weights_only=True), torch.load(output, weights_only=True)
    assert written["q"].dtype == expected["q"].dtype and written["q"].shape == expected["q"].shape
    assert bytes(written["q"].untyped_storage()) == bytes(expected["q"].untyped_storage())
    code, stdout, stderr = run_cli("verify", str(source), str(output), "--reference", "torch")
    assert (code, stderr) == (0, ""), stderr
    assert stdout.startswith("verified: all 2 tensors match bit for bit (source read by torch.load")


# ---------------------------------------------------------------------------------------
# --dtype on every float8
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        pytest.param(
            "float8_e8m0fnu",
            marks=pytest.mark.skipif(
                not hasattr(torch, "float8_e8m0fnu"), reason="torch.float8_e8m0fnu (the oracle) is new in torch 2.7"
            ),
        ),
        "float8_e4m3fn",
    ],
)
@pytest.mark.parametrize("target", ["bf16", "fp32"])
def test_dtype_casts_every_float8_as_torch_does(tmp_path: Path, source: str, target: str) -> None:
    import safetensors.torch

    every_pattern = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(getattr(torch, source))
    path = tmp_path / "f8.pt"
    torch.save({"w": every_pattern}, path)
    output = tmp_path / "out.safetensors"
    code, _, stderr = run_cli("convert", str(path), str(output), "--dtype", target, "-q")
    assert (code, stderr) == (0, "")
    want = every_pattern.to({"bf16": torch.bfloat16, "fp32": torch.float32}[target])
    got = safetensors.torch.load_file(output)["w"]
    assert got.dtype == want.dtype
    assert (
        got.view(torch.int16 if want.itemsize == 2 else torch.int32).tolist()
        == want.view(torch.int16 if want.itemsize == 2 else torch.int32).tolist()
    )


def test_dtype_fp16_on_e8m0_refuses_the_overflow_in_one_line(tmp_path: Path) -> None:
    # Written without torch, whose float8_e8m0fnu is new in torch 2.7: the cast needs no torch.
    path = tmp_path / "scales.safetensors"
    header = b'{"scale":{"dtype":"F8_E8M0","shape":[3],"data_offsets":[0,3]}}'
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes([0, 127, 200]))
    code, _, stderr = run_cli("convert", str(path), str(tmp_path / "out.pt"), "--dtype", "fp16")
    assert code == 1
    assert stderr == (
        "ckptconv: error: tensor 'scale': casting to float16 would turn finite values such as 9.44473296573929e+21 "
        "into inf; "
        "keep this tensor's dtype (--keep-dtype) or pass --allow-overflow\n"
    )


@pytest.mark.parametrize("name", ["items", "keys", "values", "get", "__class__"])
def test_build_state_that_shadows_a_method_is_refused_in_one_line(tmp_path: Path, name: str) -> None:
    encoded = name.encode()
    source = tmp_path / "shadow.pkl"
    # OrderedDict() with BUILD {name: 1}: a 45-byte pickle for "items".
    source.write_bytes(
        b"\x80\x02ccollections\nOrderedDict\n)R}X" + struct.pack("<I", len(encoded)) + encoded + b"K\x01sb."
    )
    assert_refused(source, tmp_path, f"OrderedDict state sets {name!r}, which is one of its methods")


# ---------------------------------------------------------------------------------------
# DCP folders whose chunks do not tile their tensors exactly
# ---------------------------------------------------------------------------------------

GPU_DCP = Path(__file__).resolve().parent.parent / "fixtures" / "gpu" / "fsdp2_dcp"


def _edit_metadata(folder: Path, edit: object) -> Path:
    """``folder`` with its DCP .metadata changed by ``edit(metadata)``."""
    import pickle

    with open(folder / ".metadata", "rb") as file:
        metadata = pickle.load(file)
    edit(metadata)  # type: ignore[operator]
    with open(folder / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
    return folder


def _edit_dcp(tmp_path: Path, edit: object) -> Path:
    """A copy of the FSDP2 DCP fixture with its .metadata changed by ``edit(metadata)``."""
    import shutil

    import torch.distributed.checkpoint  # noqa: F401 (the classes .metadata pickles)

    folder = tmp_path / "dcp"
    shutil.copytree(GPU_DCP, folder)
    return _edit_metadata(folder, edit)


def _move_chunk(metadata: object, fqn: str, old: tuple[int, ...], new: tuple[int, ...]) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    entry = metadata.state_dict_metadata[fqn]  # type: ignore[attr-defined]
    entry.chunks = [
        ChunkStorageMetadata(torch.Size(new), chunk.sizes) if tuple(chunk.offsets) == old else chunk
        for chunk in entry.chunks
    ]
    storage = metadata.storage_data  # type: ignore[attr-defined]
    info = storage.pop(MetadataIndex(fqn, torch.Size(old), 0))
    storage[MetadataIndex(fqn, torch.Size(new), 0)] = info


def test_dcp_chunks_that_overlap_and_leave_a_hole_are_refused(tmp_path: Path) -> None:
    # Rows 8-15 move to 4-11: the same volume, rows 4-7 twice, rows 12-15 never (zeros, before).
    folder = _edit_dcp(tmp_path, lambda m: _move_chunk(m, "model.pos_emb.weight", (8, 0), (4, 0)))
    with pytest.raises(
        MalformedCheckpointError, match=r"the chunks of 'model.pos_emb.weight' at \[0, 0\] and \[4, 0\]"
    ):
        ckptconv.open(folder)
    code, _, stderr = run_cli("convert", str(folder), str(tmp_path / "out.safetensors"))
    assert code == 1 and stderr.count("\n") == 1 and "overlap, so part of the tensor has two values" in stderr


def test_dcp_chunk_listed_twice_is_refused(tmp_path: Path) -> None:
    def repeat(metadata: object) -> None:
        entry = metadata.state_dict_metadata["model.block.ln1.weight"]  # type: ignore[attr-defined]
        entry.chunks = [entry.chunks[0], entry.chunks[0]]

    folder = _edit_dcp(tmp_path, repeat)
    with pytest.raises(MalformedCheckpointError, match="at \\[0\\] and \\[0\\] overlap"):
        ckptconv.open(folder)


def test_two_dcp_tensors_stored_in_the_same_bytes_are_refused(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    def alias(metadata: object) -> None:
        storage = metadata.storage_data  # type: ignore[attr-defined]
        for offset in (0, 8):
            index = torch.Size([offset])
            storage[MetadataIndex("model.block.ln1.bias", index, 0)] = storage[
                MetadataIndex("model.block.ln1.weight", index, 0)
            ]

    folder = _edit_dcp(tmp_path, alias)
    with pytest.raises(MalformedCheckpointError, match=r"are stored in the same bytes of '__0_0\.distcp'"):
        ckptconv.open(folder)


def _saved_dcp(tmp_path: Path, edit: object) -> Path:
    """A DCP folder ``torch.distributed.checkpoint.save`` writes (one process, no process group), with its
    .metadata changed by ``edit(metadata)``."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "dcp"
    state = {"model": {"w": torch.arange(4.0), "b": torch.ones(2)}, "ema": {"w": torch.full((4,), 7.0)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized, assuming ... a single process"
        dcp.save(state, checkpoint_id=str(folder))
    return _edit_metadata(folder, edit)


@pytest.mark.parametrize(
    ("paths", "said"),
    [
        (
            {"ema.w": ("model", "w")},
            "its planner_data puts 'model.w' and 'ema.w' at the same place ['model', 'w']; one would be lost",
        ),
        (
            {"ema.w": ("model", "w", "x")},
            "its planner_data puts 'ema.w' at ['model', 'w', 'x'], inside 'model.w' at ['model', 'w']; "
            "one would be lost",
        ),
        (
            {"model.w": ("model",)},
            "its planner_data puts 'model.b' at ['model', 'b'], inside 'model.w' at ['model']; one would be lost",
        ),
        ({"ema.w": "ema.w"}, "its planner_data gives 'ema.w' the path 'ema.w', not a list of names"),
        ({"ema.w": ()}, "its planner_data gives 'ema.w' the path (), not a list of names"),
    ],
    ids=["same-place", "inside-a-tensor", "a-tensor-around-others", "a-string", "empty"],
)
def test_dcp_planner_data_that_puts_two_tensors_in_one_place_is_refused(
    tmp_path: Path, paths: dict[str, object], said: str
) -> None:
    """torch's loader (set_element) rebuilds the state dict from planner_data: two entries at one path keep the
    last one and drop the other, silently; ckptconv kept one too (or fell back to the flat names)."""
    folder = _saved_dcp(tmp_path, lambda metadata: metadata.planner_data.update(paths))  # type: ignore[attr-defined]
    if paths == {"ema.w": ("model", "w")}:  # what torch does with it: 'ema.w' is gone without a word
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_to_torch_save(str(folder), str(tmp_path / "torch.pt"))
        assert sorted(torch.load(tmp_path / "torch.pt", weights_only=True)) == ["model"]
        (tmp_path / "torch.pt").unlink()
    line = f"{str(folder)!r} is a damaged DCP checkpoint: {said}"
    with pytest.raises(MalformedCheckpointError) as caught:
        ckptconv.open(folder)
    assert str(caught.value) == line
    assert run_cli("convert", str(folder), str(tmp_path / "out.safetensors")) == (1, "", f"ckptconv: error: {line}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp"]


def test_dcp_planner_data_paths_nest_the_state_as_torch_does(tmp_path: Path) -> None:
    folder = _saved_dcp(tmp_path, lambda metadata: None)
    tree = ckptconv.open(folder).tree
    assert sorted(tree) == ["ema", "model"] and sorted(tree["model"]) == ["b", "w"]
    assert torch.equal(ckptconv.load(folder, select="ema")["w"], torch.full((4,), 7.0))


def _same_tree(ours: object, theirs: object) -> bool:
    """ckptconv's tree (lazy tensors) equals torch's (tensors), structure, order and bits."""
    if isinstance(ours, ckptconv.TensorRef):
        tensor = ours.torch()
        return isinstance(theirs, torch.Tensor) and tensor.dtype == theirs.dtype and torch.equal(tensor, theirs)
    if isinstance(ours, dict):
        return (
            isinstance(theirs, dict)
            and list(ours) == list(theirs)
            and all(_same_tree(ours[key], theirs[key]) for key in ours)
        )
    if isinstance(ours, list):
        return (
            isinstance(theirs, list)
            and len(ours) == len(theirs)
            and all(_same_tree(a, b) for a, b in zip(ours, theirs))
        )
    return type(ours) is type(theirs) and ours == theirs


def test_dcp_lists_come_back_as_lists_as_torch_rebuilds_them(tmp_path: Path) -> None:
    """DCP flattens a list that holds tensors into entries whose planner_data paths carry integer indices;
    torch's loader (set_element) rebuilds a list from them. ckptconv made dicts keyed by the indices."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = tmp_path / "dcp"
    state = {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)},
        "extra": [torch.full((2,), 3.0), {"x": torch.zeros(1), "n": 4}],
        "nested": [[torch.tensor([1, 2]), 5], {"y": [torch.ones(1)]}],
        "optim": {"state": {0: {"exp_avg": torch.ones(2, 3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "epoch": 3,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder))
        dcp_to_torch_save(str(folder), str(tmp_path / "torch.pt"))
    expected = torch.load(tmp_path / "torch.pt", weights_only=True)
    assert isinstance(expected["extra"], list) and isinstance(expected["nested"][0], list)  # what torch makes
    assert _same_tree(ckptconv.open(folder).tree, expected)
    loaded = ckptconv.load(folder)
    assert list(loaded) == ["w", "b"] and all(torch.equal(loaded[k], expected["model"][k]) for k in loaded)


@pytest.mark.parametrize(
    ("path", "said"),
    [
        (("extra", 0, "y"), "its planner_data puts 'extra.1.x' at ['extra', 'x'], a name inside the list"),
        (("extra", -1), "a negative list index"),
        (("extra", 1 << 40), "more than 1,048,576 empty places"),  # refused before the list grows
    ],
    ids=["name-in-a-list", "negative", "far-index"],
)
def test_dcp_list_paths_torch_cannot_rebuild_are_refused(tmp_path: Path, path: tuple[object, ...], said: str) -> None:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"extra": [torch.ones(2), {"x": torch.zeros(1)}]}, checkpoint_id=str(folder))

    def edit(metadata: Any) -> None:
        if path[-1] == "y":  # 'extra.0' stays a list index; 'extra.1.x' names a key of that list
            metadata.planner_data["extra.1.x"] = ("extra", "x")
        else:
            metadata.planner_data["extra.1.x"] = path

    _edit_metadata(folder, edit)
    with pytest.raises(MalformedCheckpointError) as caught:
        ckptconv.open(folder)
    assert str(caught.value).startswith(f"{str(folder)!r} is a damaged DCP checkpoint: ")
    assert said in str(caught.value) and "\n" not in str(caught.value)


# ---------------------------------------------------------------------------------------
# Sizes before allocation
# ---------------------------------------------------------------------------------------


def test_a_view_that_expands_to_terabytes_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    source = tmp_path / "huge.pt"
    torch.save({"x": torch.ones(1).expand(2**40, 2**4), "b": torch.zeros(3)}, source)
    assert source.stat().st_size < 2000
    output = tmp_path / "huge.safetensors"
    code, stdout, stderr = run_cli("convert", str(source), str(output))
    assert (code, stdout) == (1, "")
    assert stderr.startswith(f"ckptconv: error: writing {str(output)!r} as safetensors needs 64.0 TiB but only ")
    assert stderr.endswith("are free there; tensor 'x' alone is 64.0 TiB, a view that repeats 4 B of stored bytes\n")
    assert list(tmp_path.iterdir()) == [source]
    # .pt keeps the view as torch.save does, and ckptconv.load returns a view: nothing expands.
    pt = tmp_path / "huge.pt.pt"
    assert run_cli("convert", str(source), str(pt), "-q") == (0, "", "")
    assert pt.stat().st_size < 2000
    for tensor in (torch.load(pt, weights_only=True)["x"], ckptconv.load(source)["x"]):
        assert tuple(tensor.shape) == (2**40, 2**4) and tensor.stride() == (0, 0) and tensor[123, 4].item() == 1.0


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--verify", "{src}", "{dst}"], "verified bit for bit)"),
        (["{src}", "{dst}", "--verify"], "verified bit for bit)"),
        (["--verify", "torch", "{src}", "{dst}"], "verified bit for bit by torch)"),
        (["{src}", "{dst}", "--verify=torch"], "verified bit for bit by torch)"),
        (["{src}", "{dst}", "--verify=ckptconv"], "verified bit for bit)"),
    ],
)
def test_verify_takes_an_optional_reader_wherever_it_stands(tmp_path: Path, arguments: list[str], said: str) -> None:
    source, _ = _conj_example(tmp_path)
    output = tmp_path / "out.safetensors"
    filled = [a.format(src=source, dst=output) for a in arguments]
    code, _, stderr = run_cli("convert", *filled)
    assert code == 0, stderr
    assert stderr.rstrip().endswith(said)


# ---------------------------------------------------------------------------------------
# Sizes torch cannot count
# ---------------------------------------------------------------------------------------


def _zip_with_view(size: tuple[int, ...], stride: tuple[int, ...], offset: int, requires_grad: object = False) -> bytes:
    """A zip checkpoint {"t": a float tensor of ``size``/``stride``/``offset`` on a storage of 6 floats}, as
    torch.save lays it out, with the view's numbers as given."""
    import collections
    import io

    class Reference:
        pass

    class View:
        def __reduce__(self) -> tuple[object, ...]:
            rebuild = torch._utils._rebuild_tensor_v2  # type: ignore[attr-defined]
            return (rebuild, (Reference(), offset, size, stride, requires_grad, collections.OrderedDict()))

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            return ("storage", torch.FloatStorage, "0", "cpu", 6) if isinstance(obj, Reference) else None

    data = io.BytesIO()
    Pickler(data, protocol=2).dump({"t": View()})
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("archive/data.pkl", data.getvalue())
        archive.writestr("archive/byteorder", b"little")
        archive.writestr("archive/data/0", struct.pack("<6f", *range(6)))
        archive.writestr("archive/version", b"3\n")
    return out.getvalue()


@pytest.mark.parametrize(
    ("size", "stride", "offset", "refusal"),
    [
        ((2**32, 2**32), (0, 0), 0, "has more elements than an int64 counts"),
        ((2**62, 2), (0, 0), 0, "has more elements than an int64 counts"),
        ((2**62, 2**62, 0), (1, 1, 1), 0, "has more elements than an int64 counts"),  # wraps before the 0
        ((1,), (2**63,), 0, "is invalid"),
        ((0,), (1,), 2**63, "is invalid"),
        ((2**64, 0), (1, 1), 0, "is invalid"),
        ((0, 2**62, 2**62), (1, 1, 1), 0, ""),  # 0 first: the product never wraps
        ((2**31, 2**31), (0, 0), 0, ""),
    ],
    ids=["2^64", "2^63", "wraps-then-0", "stride-2^63", "offset-2^63", "size-2^64", "0-first", "2^62"],
)
def test_a_view_torch_cannot_count_is_refused_not_a_traceback(
    tmp_path: Path, size: tuple[int, ...], stride: tuple[int, ...], offset: int, refusal: str
) -> None:
    """ckptconv.load ended in torch's own RuntimeError ('numel: integer multiplication overflow') or a
    TypeError ('Overflow when unpacking long long'), and convert wrote an empty tensor of that shape."""
    source = tmp_path / "view.pt"
    source.write_bytes(_zip_with_view(size, stride, offset))
    if not refusal:
        expected = torch.load(source, weights_only=True)["t"]
        loaded = ckptconv.load(source)["t"]
        assert (loaded.shape, loaded.stride(), loaded.dtype) == (expected.shape, expected.stride(), expected.dtype)
        return
    # torch 2.4's weights_only unpickler re-raises the error as an UnpicklingError that quotes it.
    with pytest.raises((RuntimeError, TypeError, ValueError, pickle.UnpicklingError), match=r"overflow|Overflow"):
        torch.load(source, weights_only=True)
    with pytest.raises(MalformedCheckpointError, match=refusal):
        ckptconv.load(source)
    code, stdout, stderr = run_cli("convert", str(source), str(tmp_path / "out.safetensors"))
    assert (code, stdout, stderr.count("\n")) == (1, "", 1) and refusal in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["view.pt"]


@pytest.mark.parametrize("requires_grad", [1, None, "yes"])
def test_requires_grad_that_is_not_a_bool_is_refused_as_torch_refuses_it(tmp_path: Path, requires_grad: object) -> None:
    source = tmp_path / "grad.pt"
    source.write_bytes(_zip_with_view((2,), (1,), 0, requires_grad))
    with pytest.raises((RuntimeError, pickle.UnpicklingError), match="requires_grad must be a bool"):
        torch.load(source, weights_only=True)
    with pytest.raises(MalformedCheckpointError, match=f"tensor requires_grad {requires_grad!r} is not True or False"):
        ckptconv.open(source)


# ---------------------------------------------------------------------------------------
# Storage views of the legacy format (torch before 1.0 wrote them; torch.load still reads them)
# ---------------------------------------------------------------------------------------


def _legacy_with_views(tensors: list[tuple[str, tuple[str, int, int] | None, int, int]]) -> bytes:
    """A legacy file of float tensors ``(name, view_metadata, offset, size)`` on one storage '0' of 8 elements
    (a name ``root@name`` gives that tensor the storage key ``root``)."""

    def text(value: str) -> bytes:
        return b"X" + struct.pack("<I", len(value)) + value.encode()

    def number(value: int) -> bytes:
        return b"J" + struct.pack("<i", value)

    body = b"\x80\x02}"
    for named, view, offset, size in tensors:
        root, _, name = named.rpartition("@")  # "root@name": a tensor whose storage key is not '0'
        meta = b"N" if view is None else b"(" + text(view[0]) + number(view[1]) + number(view[2]) + b"t"
        pid = b"(" + text("storage") + b"ctorch\nFloatStorage\n" + text(root or "0") + text("cpu") + number(8)
        pid += meta + b"tQ"
        body += text(name) + b"ctorch._utils\n_rebuild_tensor_v2\n(" + pid + number(offset) + number(size)
        body += b"\x85" + number(1) + b"\x85\x89ccollections\nOrderedDict\n)RtRs"
    header = b"".join(
        pickle.dumps(value, protocol=2)
        for value in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True})
    )
    data = struct.pack("<q", 8) + torch.arange(8, dtype=torch.float32).numpy().tobytes()
    return header + body + b"." + pickle.dumps(["0"], protocol=2) + data


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([("x", ("v", 2, 4), 1, 3)], None),
        ([("x", None, 0, 2), ("y", ("v", 3, 2), 0, 2), ("z", ("v", 3, 2), 1, 1)], None),
        ([("x", ("v", 2, 4), 0, 5)], "reaches past the end of its storage view of 4 elements"),  # torch fails too
        ([("x", ("v", 2, 4), 0, 2), ("y", ("v", 5, 3), 0, 2)], "storage view 'v' is given two different places"),
        ([("x", ("0", 2, 4), 0, 2)], "'0' names both a storage and a storage view"),
        ([("x", ("v", 2, 4), 0, 2), ("v@y", ("w", 0, 2), 0, 2)], "'v' names both a storage and a storage view"),
        ([("x", ("v", 6, 4), 0, 1)], "storage view 'v' (6+4) lies outside its storage '0'"),
    ],
)
def test_legacy_storage_views_are_read_as_torch_reads_them_or_refused(
    tensors: list[tuple[str, tuple[str, int, int] | None, int, int]], message: str | None, tmp_path: Path
) -> None:
    """torch keeps one object per key: a view key met again gave the first view's values to both
    tensors, a view named like its storage gave the storage; ckptconv used each offset as written."""
    source = tmp_path / "views.pt"
    source.write_bytes(_legacy_with_views(tensors))
    if message is not None:
        assert_refused(source, tmp_path, message)
        return
    expected = torch.load(source, weights_only=True)
    for suffix in ("pt", "safetensors"):
        output = tmp_path / f"out.{suffix}"
        code, _, stderr = run_cli("convert", str(source), str(output), "-q")
        assert code == 0, stderr
        written = torch.load(output, weights_only=True) if suffix == "pt" else safetensors.torch.load_file(output)
        assert sorted(written) == sorted(expected)
        for key, tensor in expected.items():
            assert written[key].dtype == tensor.dtype and written[key].shape == tensor.shape
            assert written[key].numpy().tobytes() == tensor.numpy().tobytes(), key
