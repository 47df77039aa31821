"""Malformed files: truncations at every structural boundary, inconsistent headers, bad records.

Every case must end in a CkptconvError (one line at the CLI), never another exception.
"""

from __future__ import annotations

import contextlib
import io
import json
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptconv
from ckptconv.cli import cli
from ckptconv.errors import CkptconvError, LoadError, MalformedCheckpointError

from .hostile import legacy_pickles


def open_and_read(path: Path) -> None:
    """Everything a conversion does with the input: open, select, read every tensor's bytes."""
    checkpoint = ckptconv.open(path)
    for _, ref in checkpoint.tensors():
        for _chunk in ref.iter_bytes():
            pass


def _torch_file(**kwargs: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save({"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(3, dtype=torch.float16)}, buffer, **kwargs)
    return buffer.getvalue()


def _zip_boundaries(data: bytes) -> set[int]:
    cuts = {0, len(data) - 1}
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            start = info.header_offset
            name_length, extra_length = struct.unpack_from("<HH", data, start + 26)
            body = start + 30 + name_length + extra_length
            cuts |= {start, start + 30, body, body + info.compress_size}
    directory = data.rfind(b"PK\x01\x02", 0, data.rfind(b"PK\x05\x06"))
    cuts |= {data.find(b"PK\x01\x02"), directory, data.rfind(b"PK\x05\x06")}
    return {cut + delta for cut in cuts for delta in (-1, 0, 1) if 0 < cut + delta < len(data)}


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_zip_truncated_at_every_boundary(compression: int, tmp_path: Path) -> None:
    data = _torch_file()
    if compression == zipfile.ZIP_DEFLATED:
        buffer = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(data)) as old, zipfile.ZipFile(buffer, "w", compression) as new:
            for info in old.infolist():
                new.writestr(info.filename, old.read(info))
        data = buffer.getvalue()
    path = tmp_path / "cut.pt"
    for cut in sorted(_zip_boundaries(data)):
        path.write_bytes(data[:cut])
        with pytest.raises(LoadError):
            open_and_read(path)


def test_legacy_truncated_at_every_boundary(tmp_path: Path) -> None:
    data = _torch_file(_use_new_zipfile_serialization=False)
    spans = legacy_pickles(data)
    cuts = {end for _, end in spans} | {spans[-1][1] + 8, spans[-1][1] + 8 + 24, len(data) - 1}
    cuts |= set(range(1, spans[3][1], 3))  # every third byte of the pickles
    path = tmp_path / "cut.pt"
    for cut in sorted(cuts):
        path.write_bytes(data[:cut])
        with pytest.raises(LoadError):
            open_and_read(path)


def _safetensors(header: Any, data: bytes = b"", *, raw_header: bytes | None = None) -> bytes:
    raw = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def test_safetensors_truncated_at_every_byte(tmp_path: Path) -> None:
    data = _safetensors(
        {
            "__metadata__": {"format": "pt"},
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "I64", "shape": [1], "data_offsets": [8, 16]},
        },
        b"\1" * 16,
    )
    path = tmp_path / "cut.safetensors"
    for cut in range(1, len(data)):
        path.write_bytes(data[:cut])
        with pytest.raises(LoadError):
            open_and_read(path)


F32 = {"dtype": "F32", "shape": [2]}
BAD_SAFETENSORS = {
    "overlapping offsets": ({"a": {**F32, "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [4, 12]}}, "overlap"),
    "offsets past the end": ({"a": {**F32, "data_offsets": [8, 16]}}, "is truncated"),
    "reversed offsets": ({"a": {**F32, "data_offsets": [8, 0]}}, "has data_offsets"),
    "negative offsets": ({"a": {**F32, "data_offsets": [-8, 0]}}, "has data_offsets"),
    "offsets not matching the shape": ({"a": {**F32, "data_offsets": [0, 4]}}, "has data_offsets"),
    "unknown dtype": ({"a": {"dtype": "F128", "shape": [2], "data_offsets": [0, 8]}}, "unknown dtype 'F128'"),
    "dtype not a string": ({"a": {"dtype": 7, "shape": [2], "data_offsets": [0, 8]}}, "unknown dtype 7"),
    "missing field": ({"a": {"dtype": "F32", "data_offsets": [0, 8]}}, "is not a tensor description"),
    "entry not an object": ({"a": [1, 2]}, "is not a tensor description"),
    # A header that is itself shaped like one tensor's description is still a header: its entries are named.
    "header shaped like a tensor description": (
        {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "entry 'dtype' is not a tensor description",
    ),
    "metadata value not a string": ({"__metadata__": {"format": 1}}, "is not a map of strings to strings"),
    "metadata not an object": ({"__metadata__": ["pt"]}, "is not a map of strings to strings"),
    "aliases not JSON": (
        {"__metadata__": {"ckptconv.aliases": "{"}, "a": {**F32, "data_offsets": [0, 8]}},
        "metadata is not JSON",
    ),
    "alias to nothing": (
        {"__metadata__": {"ckptconv.aliases": '{"b": "zzz"}'}, "a": {**F32, "data_offsets": [0, 8]}},
        "does not match the tensors",
    ),
    # Two readings of one alias (Python's json keeps the last); an alias the writer could never have written.
    "alias named twice": (
        {"__metadata__": {"ckptconv.aliases": '{"b": "a", "b": "c"}'}, "a": {**F32, "data_offsets": [0, 8]}},
        r"metadata is not JSON \(duplicate key 'b'\)",
    ),
    "alias named __metadata__": (
        {"__metadata__": {"ckptconv.aliases": '{"__metadata__": "a"}'}, "a": {**F32, "data_offsets": [0, 8]}},
        "alias '__metadata__' -> 'a' does not match the tensors",
    ),
    "too many dimensions": ({"a": {"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}}, "has shape"),
    # The product wraps before the 0 (the safetensors library's checked product refuses it; torch's too).
    "shape that wraps then 0": (
        {"a": {"dtype": "F32", "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]}},
        r"has shape \[4611686018427387904, 4611686018427387904, 0\], whose sizes or their product overflow int64",
    ),
    "size over int64": (
        {"a": {"dtype": "F32", "shape": [2**63, 0], "data_offsets": [0, 0]}},
        "whose sizes or their product overflow int64",
    ),
}


@pytest.mark.parametrize("case", BAD_SAFETENSORS)
def test_inconsistent_safetensors_headers(case: str, tmp_path: Path) -> None:
    header, message = BAD_SAFETENSORS[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(_safetensors(header, b"\0" * (12 if case == "overlapping offsets" else 8)))
    with pytest.raises(MalformedCheckpointError, match=message):
        ckptconv.open(path)


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "a": {"dtype": "F32", "shape": [2], '
            b'"data_offsets": [0, 8]}}',
            "duplicate key 'a'",
        ),
        (b'{"\xff\xfe": 1}', "is not valid JSON"),
        (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "is not valid JSON"),
        (b"{" + b" " * 50, "is not valid JSON"),
        (b'{"a": NaN}', "is not a tensor description"),
        (
            b'{"\\ud800": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
            r"the string '\\ud800' holds a lone surrogate escape, which is not Unicode",
        ),
        (b'{"__metadata__": {"k": "\\udfff"}}', "holds a lone surrogate escape"),
    ],
    ids=["duplicate keys", "non-UTF-8", "nested 100,000 deep", "unterminated", "NaN", "lone surrogate", "in metadata"],
)
def test_unparsable_safetensors_headers(raw: bytes, message: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(_safetensors(None, b"\0" * 8, raw_header=raw))
    with pytest.raises(MalformedCheckpointError, match=message):
        ckptconv.open(path)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"\\ud800": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', "holds a lone surrogate escape"),
        (
            b'{"a": {"dtype": "F32", "shape": [4611686018427387904, 4611686018427387904, 0], "data_offsets": [0, 0]}}',
            r"tensor 'a' has shape \[4611686018427387904, 4611686018427387904, 0\], whose sizes or their product "
            "overflow int64",
        ),
        (
            b'{"a": {"dtype": "F32", "shape": [9223372036854775808, 0], "data_offsets": [0, 0]}}',
            r"tensor 'a' has shape \[9223372036854775808, 0\], whose sizes or their product overflow int64",
        ),
    ],
    ids=["lone surrogate", "wraps then 0", "size over int64"],
)
def test_safetensors_headers_the_library_refuses_are_refused(raw: bytes, message: str, tmp_path: Path) -> None:
    """Python's json took half a surrogate pair as a key (no UTF-8 output can hold it); a shape whose
    product wraps before a 0 was an empty tensor, and ckptconv.load ended in torch's RuntimeError."""
    import safetensors.torch

    path = tmp_path / "bad.safetensors"
    data = b"\0" * 8 if b"[0, 8]" in raw else b""  # every byte indexed: only the oddity is wrong
    path.write_bytes(_safetensors(None, data, raw_header=raw))
    with pytest.raises(Exception):  # noqa: B017 - SafetensorError or torch's overflow, as it comes
        safetensors.torch.load_file(path)
    with pytest.raises(MalformedCheckpointError, match=f"is a damaged safetensors file: .*{message}"):
        ckptconv.load(path)


def test_a_safetensors_entry_with_fields_of_its_own_is_read_as_the_library_reads_it(tmp_path: Path) -> None:
    """The library ignores fields other than dtype, shape and data_offsets; ckptconv called the file damaged."""
    import safetensors.torch

    header = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"extra":1,"note":{"x":[1]}}}'
    path = tmp_path / "extra.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + struct.pack("<2f", 1.5, -2.0))
    expected = safetensors.torch.load_file(path)
    loaded = ckptconv.load(path)
    assert loaded.keys() == expected.keys() and torch.equal(loaded["a"], expected["a"])


@pytest.mark.parametrize("space", [b" ", b"\n", b"\r\n\t "])
def test_a_safetensors_header_may_start_with_json_white_space(space: bytes, tmp_path: Path) -> None:
    """The safetensors library reads a header that starts with white space; ckptconv said the file was not a
    checkpoint format it knows."""
    import safetensors.torch

    header = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    data = struct.pack("<2f", 1.5, -2.0)
    path = tmp_path / "spaced.safetensors"
    path.write_bytes(struct.pack("<Q", len(space + header)) + space + header + data)
    expected = safetensors.torch.load_file(path)
    loaded = ckptconv.load(path)
    assert loaded.keys() == expected.keys() and torch.equal(loaded["a"], expected["a"])
    assert ckptconv.scan(path).verdict == "safe"


def _rezip(
    data: bytes,
    *,
    compression: int = zipfile.ZIP_STORED,
    drop: str = "",
    replace: dict[str, bytes] | None = None,
    add: dict[str, bytes] | None = None,
) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as old, zipfile.ZipFile(out, "w", compression) as new:
        for info in old.infolist():
            root, short = info.filename.split("/", 1)
            if short == drop:
                continue
            new.writestr(info.filename, (replace or {}).get(short, old.read(info)))
        for short, content in (add or {}).items():
            new.writestr(f"{root}/{short}", content)
    return out.getvalue()


@pytest.mark.parametrize(
    ("version", "refusal"),
    [
        (b"3\n", ""),
        (b"10", ""),
        (b" +03abc", ""),
        (b"11", "is a torch zip checkpoint of format version 11, which torch.load reads only from 1 to 10"),
        (b"0", "is a torch zip checkpoint of format version 0, which torch.load reads only from 1 to 10"),
        (b"-1", "is a torch zip checkpoint of format version -1, which torch.load reads only from 1 to 10"),
        (b"0x3", "is a torch zip checkpoint of format version 0, which torch.load reads only from 1 to 10"),
        (b"9" * 40, "is a torch zip checkpoint of format version 99999999999999999999999999999999..., which"),
        (b"abc", "is a damaged zip checkpoint: its version record says b'abc', not a number"),
        (b"", "is a damaged zip checkpoint: its version record says b'', not a number"),
        (None, "is a damaged zip checkpoint: it has no version record, which torch.load requires"),
    ],
    ids=["3", "10", "+03abc", "11", "0", "-1", "0x3", "9x40", "abc", "empty", "missing"],
)
def test_the_format_version_is_read_as_torch_reads_it(version: bytes | None, refusal: str, tmp_path: Path) -> None:
    """ckptconv never looked at the version record: a file of a format version torch.load refuses (a newer
    torch's, whose records may mean something else) or of none was read as if it were version 3."""
    state = {"w": torch.arange(4.0), "i": torch.tensor([5, 6])}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path = tmp_path / "v.pt"
    if version is None:
        path.write_bytes(_rezip(buffer.getvalue(), drop="version"))
    else:
        path.write_bytes(_rezip(buffer.getvalue(), replace={"version": version}))
    if not refusal:
        loaded = ckptconv.load(path)
        assert all(torch.equal(loaded[k], v) for k, v in torch.load(path, weights_only=True).items())
        return
    with pytest.raises((RuntimeError, IndexError), match=r"version|hasRecord|stoull"):  # IndexError: overflow
        torch.load(path, weights_only=True)
    with pytest.raises(CkptconvError) as caught:
        ckptconv.open(path)
    assert str(caught.value).startswith(f"{str(path)!r} {refusal}")
    # .data/version, where torch looks first, wins over version
    path.write_bytes(_rezip(buffer.getvalue(), replace={"version": b"3"}, add={".data/version": version or b"x"}))
    with pytest.raises(CkptconvError) as caught:
        ckptconv.open(path)
    expected = refusal if version else "is a damaged zip checkpoint: its version record says b'x'"
    assert str(caught.value).startswith(f"{str(path)!r} {expected}")


def _flip_in_record(data: bytes, name: str, where: int = 5) -> bytes:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = next(i for i in archive.infolist() if i.filename.split("/", 1)[1] == name)
    name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
    at = info.header_offset + 30 + name_length + extra_length + where
    return data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1 :]


def _set_crc(data: bytes, name: str) -> bytes:
    raw = bytearray(data)
    for signature, crc_at, length_at, name_at in ((b"PK\x03\x04", 14, 26, 30), (b"PK\x01\x02", 16, 28, 46)):
        index = raw.find(signature)
        while index >= 0:
            length = struct.unpack_from("<H", raw, index + length_at)[0]
            if raw[index + name_at : index + name_at + length].decode().split("/", 1)[1] == name:
                struct.pack_into("<I", raw, index + crc_at, struct.unpack_from("<I", raw, index + crc_at)[0] ^ 1)
            index = raw.find(signature, index + 1)
    return bytes(raw)


BAD_ZIPS = {
    "missing storage record": (lambda d: _rezip(d, drop="data/0"), "storage record .* is missing"),
    "missing data.pkl": (lambda d: _rezip(d, drop="data.pkl"), "has no <folder>/data.pkl"),
    "bad byteorder": (lambda d: _rezip(d, replace={"byteorder": b"middle"}), "byteorder record says 'middle'"),
    "record shorter than the pickle says": (lambda d: _rezip(d, replace={"data/0": b"\0" * 4}), "holds 4 bytes"),
    "wrong CRC, deflated record": (
        lambda d: _set_crc(_rezip(d, compression=zipfile.ZIP_DEFLATED), "data/0"),
        "Bad CRC-32",
    ),
    "corrupt deflate stream, record": (
        lambda d: _flip_in_record(_rezip(d, compression=zipfile.ZIP_DEFLATED), "data/0"),
        "cannot be decompressed",
    ),
    "corrupt deflate stream, data.pkl": (
        lambda d: _flip_in_record(_rezip(d, compression=zipfile.ZIP_DEFLATED), "data.pkl", 3),
        "data.pkl cannot be read",
    ),
    "wrong CRC, deflated data.pkl": (
        lambda d: _set_crc(_rezip(d, compression=zipfile.ZIP_DEFLATED), "data.pkl"),
        "Bad CRC-32",
    ),
    # Found by the fuzzer: a flipped general-purpose bit 0 made zipfile raise RuntimeError
    # (flipped flag bits also hid pickles from picklescan).
    "encrypted flag on data.pkl": (lambda d: _set_flag(d, "data.pkl"), "has an encrypted member"),
    "encrypted flag on a record": (lambda d: _set_flag(d, "data/0"), "has an encrypted member"),
    "two roots": (lambda d: d[: d.rfind(b"PK\x05\x06")] and _two_roots(d), "root folders"),
}


def _set_flag(data: bytes, name: str) -> bytes:
    raw = bytearray(data)
    for signature, flag_at, length_at, name_at in ((b"PK\x03\x04", 6, 26, 30), (b"PK\x01\x02", 8, 28, 46)):
        index = raw.find(signature)
        while index >= 0:
            length = struct.unpack_from("<H", raw, index + length_at)[0]
            if raw[index + name_at : index + name_at + length].decode().split("/", 1)[1] == name:
                raw[index + flag_at] |= 0x1
            index = raw.find(signature, index + 1)
    return bytes(raw)


def _two_roots(data: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as old, zipfile.ZipFile(out, "w") as new:
        for info in old.infolist():
            new.writestr(info.filename, old.read(info))
            new.writestr("other/" + info.filename.split("/", 1)[1], old.read(info))
    return out.getvalue()


@pytest.mark.parametrize("case", BAD_ZIPS)
def test_damaged_zip_checkpoints(case: str, tmp_path: Path) -> None:
    make, message = BAD_ZIPS[case]
    source = tmp_path / "bad.pt"
    source.write_bytes(make(_torch_file()))
    with pytest.raises(LoadError, match=message):
        open_and_read(source)
    result = CliRunner().invoke(
        cli, ["convert", str(source), str(tmp_path / "out.safetensors")], catch_exceptions=False
    )
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt"]


def test_wrong_crc_on_a_stored_record_is_refused_or_carried_not_hidden(tmp_path: Path) -> None:
    """torch.load ignores CRCs of stored records; ckptconv refuses them (see SECURITY.md).

    With check_crc=False (--no-crc-check, to rescue a damaged file) a .pt to .pt
    conversion copies the record with its recorded CRC, so a reader that checks
    CRCs still sees the damage in the output.
    """
    source = tmp_path / "crc.pt"
    source.write_bytes(_set_crc(_torch_file(), "data/0"))
    with pytest.raises(MalformedCheckpointError, match=r"has CRC-32 [0-9a-f]{8} but the archive records"):
        ckptconv.convert(source, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()
    ckptconv.convert(source, tmp_path / "out.pt", check_crc=False)
    with zipfile.ZipFile(tmp_path / "out.pt") as archive:
        assert archive.testzip() is not None  # the bad CRC is still there to be found


def test_errors_are_ckptconv_errors_for_random_garbage_after_valid_headers(tmp_path: Path) -> None:
    data = _torch_file()
    path = tmp_path / "garbage.pt"
    for offset in range(0, len(data), 97):
        damaged = data[:offset] + bytes(range(256))[:64] + data[offset + 64 :]
        path.write_bytes(damaged)
        with contextlib.suppress(CkptconvError):
            open_and_read(path)


@pytest.mark.parametrize("legacy", [False, True])
def test_a_storage_class_ckptconv_does_not_know_is_unsupported_not_damage(legacy: bool, tmp_path: Path) -> None:
    """A dtype newer than ckptconv (here a made-up torch.Float7Storage) is said to be one, in one line."""
    data = _torch_file(_use_new_zipfile_serialization=not legacy)
    if legacy:
        data = data.replace(b"ctorch\nHalfStorage\n", b"ctorch\nFloat7Storage\n")
    else:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            pickle_bytes = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
        data = _rezip(
            data, replace={"data.pkl": pickle_bytes.replace(b"ctorch\nHalfStorage\n", b"ctorch\nFloat7Storage\n")}
        )
    source = tmp_path / "new.pt"
    source.write_bytes(data)
    with pytest.raises(
        ckptconv.UnsupportedFormatError, match=r"holds storages of type torch\.Float7Storage, whose dtype"
    ):
        open_and_read(source)
    result = CliRunner().invoke(cli, ["convert", str(source), str(tmp_path / "out.pt")], catch_exceptions=False)
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.pt"]


def test_the_format_version_is_checked_before_the_pickle_is_read(tmp_path: Path) -> None:
    """As torch.load: a version it refuses is the refusal, before data.pkl (up to 2 GiB) is read; here
    data.pkl is also damaged, which was said instead."""
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, buffer)
    path = tmp_path / "v.pt"
    path.write_bytes(_flip_in_record(_rezip(buffer.getvalue(), replace={"version": b"11"}), "data.pkl"))
    with pytest.raises(RuntimeError, match="version"):
        torch.load(path, weights_only=True)
    with pytest.raises(CkptconvError, match="format version 11"):
        ckptconv.open(path)


@pytest.mark.parametrize("code", ["F6_E2M3", "F6_E3M2"])
def test_a_safetensors_dtype_torch_has_none_of_is_unsupported_not_damaged(code: str, tmp_path: Path) -> None:
    """Six-bit floats are valid safetensors that no torch dtype holds: the file was called damaged."""
    import safetensors.torch

    path = tmp_path / "f6.safetensors"
    raw = b'{"a": {"dtype": "%s", "shape": [4], "data_offsets": [0, 3]}}' % code.encode()
    path.write_bytes(_safetensors(None, b"\0" * 3, raw_header=raw))
    with pytest.raises(Exception):  # noqa: B017 - the library's own refusal, whatever its type
        safetensors.torch.load_file(path)
    with pytest.raises(
        ckptconv.UnsupportedFormatError, match=f"holds tensor 'a' as {code}, a safetensors dtype that no torch"
    ):
        ckptconv.open(path)
