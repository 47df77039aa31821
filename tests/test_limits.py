"""Resource exhaustion: hostile sizes fail fast, in bounded memory and time, with one clear error."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
import tracemalloc
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptconv
from ckptconv.errors import LoadError, MalformedCheckpointError
from ckptconv.reading.formats import torch_legacy, torch_zip
from ckptconv.reading.unpickling.unpickler import Unpickler

from .conftest import refusal_in_child, run_cli
from .hostile import legacy_pickles

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def bounded(seconds: float = 2.0, megabytes: float = 16.0) -> Iterator[None]:
    """The block allocates at most ``megabytes`` (Python allocations) and uses at most ``seconds`` of CPU.

    CPU time rather than wall time: the bound catches work proportional to a size the file claims,
    which would take minutes, and must not trip on a machine busy with other processes.
    """
    tracemalloc.start()
    started = time.process_time()
    try:
        yield
    finally:
        elapsed = time.process_time() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert elapsed < seconds, f"took {elapsed:.2f} s"
    assert peak < megabytes * 2**20, f"allocated {peak / 2**20:.1f} MiB"


def _safetensors(header: dict[str, object], data: bytes = b"", *, length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def test_header_length_of_2_63_does_not_allocate(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    path.write_bytes(
        _safetensors({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, length=2**63)
    )
    with bounded(), pytest.raises(MalformedCheckpointError, match="header claims 9223372036854775808 bytes"):
        ckptconv.open(path)


def test_header_over_100_mb_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "big_header.safetensors"
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", 100_000_001) + b"{")
        file.truncate(8 + 100_000_001 + 16)  # sparse: costs no disk
    with bounded(), pytest.raises(MalformedCheckpointError, match=r"claims 100000001 bytes \(the limit is 100000000\)"):
        ckptconv.open(path)


@pytest.mark.parametrize(
    "shape, offsets, message",
    [
        ([2**62, 2**62, 2**62], [0, 16], "product overflow int64"),  # the product overflows any int64
        ([2**31, 2**31], [0, 2**64], "is truncated"),  # consistent, but far beyond the file
        ([4], [0, 2**63], "has data_offsets"),
        ([-1, 4], [0, 16], "has shape"),
        ([1.5], [0, 4], "has shape"),
    ],
)
def test_shapes_that_overflow_or_exceed_the_file(
    shape: list[object], offsets: list[int], message: str, tmp_path: Path
) -> None:
    path = tmp_path / "shape.safetensors"
    path.write_bytes(_safetensors({"w": {"dtype": "F32", "shape": shape, "data_offsets": offsets}}, b"\0" * 16))
    with bounded(), pytest.raises(MalformedCheckpointError, match=message):
        ckptconv.open(path)


def _patch_sizes(data: bytes, name: str, *, file_size: int) -> bytes:
    """Rewrite a member's uncompressed size in its local header and central directory entry."""
    raw = bytearray(data)
    encoded = name.encode()
    # signature, offset of the name length, of the name, of the uncompressed size
    for signature, length_at, name_at, size_at in ((b"PK\x03\x04", 26, 30, 22), (b"PK\x01\x02", 28, 46, 24)):
        index = raw.find(signature)
        while index >= 0:
            length = struct.unpack_from("<H", raw, index + length_at)[0]
            if raw[index + name_at : index + name_at + length] == encoded:
                struct.pack_into("<I", raw, index + size_at, file_size)
            index = raw.find(signature, index + 1)
    return bytes(raw)


def _deflated_checkpoint(
    tmp_path: Path, state: dict[str, torch.Tensor], mutate_pickle: Callable[[bytes], bytes] = lambda data: data
) -> tuple[Path, str]:
    stored = tmp_path / "stored.pt"
    torch.save(state, stored)
    path = tmp_path / "deflated.pt"
    with zipfile.ZipFile(stored) as old, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as new:
        for info in old.infolist():
            data = old.read(info)
            new.writestr(info.filename, mutate_pickle(data) if info.filename.endswith("data.pkl") else data)
        record = next(name for name in old.namelist() if "/data/" in name)
    stored.unlink()
    return path, record


def test_a_record_claiming_gigabytes_from_kilobytes_is_refused_before_inflating(tmp_path: Path) -> None:
    # A zip bomb: 4 KB of deflated zeros that claim 4 GiB, and a pickle that agrees.
    def claim_a_billion(data: bytes) -> bytes:
        assert b"M\xe8\x03t" in data  # numel 1000 as BININT2
        return data.replace(b"M\xe8\x03t", b"J" + struct.pack("<i", 2**30 - 1) + b"t", 1)

    path, record = _deflated_checkpoint(tmp_path, {"w": torch.zeros(1000)}, claim_a_billion)
    path.write_bytes(_patch_sizes(path.read_bytes(), record, file_size=4 * (2**30 - 1)))
    with bounded(), pytest.raises(MalformedCheckpointError, match="more than deflate can produce"):
        ckptconv.open(path)


def test_data_pkl_claiming_more_than_the_limit_is_refused_unread(tmp_path: Path) -> None:
    path, _ = _deflated_checkpoint(tmp_path, {"w": torch.zeros(3)})
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
    path.write_bytes(_patch_sizes(path.read_bytes(), name, file_size=torch_zip.MAX_PICKLE_BYTES + 1))
    with bounded(), pytest.raises(MalformedCheckpointError, match=r"data\.pkl claims"):
        ckptconv.open(path)


def _rezipped(tmp_path: Path, name: str, change: Callable[[str, bytes], bytes | None]) -> Path:
    """A torch.save checkpoint re-zipped with deflate where ``change`` gives a member new bytes,
    plus an extra ``<root>/extra.pkl`` where it gives bytes for the name ``"EXTRA"``."""
    source = tmp_path / "plain.pt"
    torch.save({"w": torch.zeros(4)}, source)
    path = tmp_path / name
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(path, "w") as new:
        for info in old.infolist():
            data = old.read(info)
            changed = change(info.filename, data)
            method = zipfile.ZIP_STORED if changed is None else zipfile.ZIP_DEFLATED
            new.writestr(info.filename, data if changed is None else changed, compress_type=method, compresslevel=9)
        extra = change("EXTRA", b"")
        if extra is not None:
            root = old.namelist()[0].split("/")[0]
            new.writestr(f"{root}/extra.pkl", extra, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return path


BOMB_BYTES = 64 << 20  # deflates to ~64 KB: 1000:1, within what deflate can do


@pytest.mark.parametrize("record", ["data.pkl", "byteorder"])
def test_records_read_whole_may_not_inflate_like_a_zip_bomb(record: str, tmp_path: Path) -> None:
    """data.pkl padded with zeros after its STOP, or a byteorder record of megabytes (deflate can do
    1000:1): both were inflated whole before being refused, 300 MB of memory from a 300 KB file."""
    path = _rezipped(
        tmp_path, "bomb.pt", lambda name, data: data + b"\0" * BOMB_BYTES if name.endswith(f"/{record}") else None
    )
    with bounded(megabytes=8), pytest.raises(MalformedCheckpointError, match=r"inflates from|byteorder record holds"):
        ckptconv.open(path)
    code, _, stderr = run_cli("inspect", str(path))
    assert code == 1 and len(stderr.splitlines()) == 1, stderr


def test_a_rezipped_checkpoint_whose_pickle_deflates_as_pickles_do_is_read(tmp_path: Path) -> None:
    path = _rezipped(
        tmp_path, "rezipped.pt", lambda name, data: data if name.endswith(("/data.pkl", "/byteorder")) else None
    )
    assert ckptconv.load(path)["w"].equal(torch.zeros(4))


def test_scan_inflates_an_extra_member_no_further_than_a_pickle_does(tmp_path: Path) -> None:
    """scan reads the pickles in every member (torch.load ignores extra ones): a 64 KB zip bomb among
    them was inflated to the 256 MiB limit."""
    path = _rezipped(
        tmp_path, "extra.pt", lambda name, data: b"\x80\x02}." + b"\0" * BOMB_BYTES if name == "EXTRA" else None
    )
    with bounded(megabytes=24):
        report = ckptconv.scan(path)
    assert report.verdict == "safe"


def test_other_compression_methods_are_refused(tmp_path: Path) -> None:
    stored = tmp_path / "stored.pt"
    torch.save({"w": torch.zeros(3)}, stored)
    path = tmp_path / "bzip2.pt"
    with zipfile.ZipFile(stored) as old, zipfile.ZipFile(path, "w", zipfile.ZIP_BZIP2) as new:
        for info in old.infolist():
            new.writestr(info.filename, old.read(info))
    with pytest.raises(LoadError, match=r"with zip method 12, which torch\.load cannot read either"):
        ckptconv.open(path)


def test_compressed_records_are_inflated_once_not_once_per_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: every 16 MiB chunk reopened the member and inflated it from the start.
    state = {"w": torch.arange(1 << 18, dtype=torch.float32)}
    path, _ = _deflated_checkpoint(tmp_path, state)
    ref = ckptconv.open(path).select().weights["w"]
    opened = []
    original = zipfile.ZipFile.open

    def counting_open(self: zipfile.ZipFile, name: object, *args: object, **kwargs: object) -> object:
        opened.append(name)
        return original(self, name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(zipfile.ZipFile, "open", counting_open)
    chunks = b"".join(bytes(chunk) for chunk in ref.iter_bytes(chunk_bytes=4096))  # 256 chunks
    assert chunks == state["w"].numpy().tobytes()
    assert len(opened) == 1
    opened.clear()
    cast = ref.cast(ckptconv.Cast("bf16").target)
    assert sum(len(chunk) for chunk in cast.iter_bytes(chunk_bytes=4096)) == 2 * (1 << 18)
    assert len(opened) == 1


def test_a_storage_larger_than_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.zeros(4)}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    start, end = legacy_pickles(data)[3]
    # numel 4 -> 2**40 in the persistent id; the element count before the bytes stays 4.
    grown = data[start:end].replace(b"K\x04N", b"\x8a\x06" + (2**40).to_bytes(6, "little") + b"N", 1)
    assert grown != data[start:end]
    path.write_bytes(data[:start] + grown + data[end:])
    with bounded(), pytest.raises(MalformedCheckpointError, match="holds 4 elements, the pickle says otherwise"):
        ckptconv.open(path)


def test_legacy_pickles_may_not_run_on_for_gigabytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.zeros(4)}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    start, _ = legacy_pickles(data)[3]
    # The object pickle claims a 2**40-byte string: the reader would grow its buffer to the whole file.
    path.write_bytes(data[:start] + b"\x80\x02\x8e" + (2**40).to_bytes(8, "little") + b"\0" * (1 << 16))
    monkeypatch.setattr(torch_legacy, "MAX_PICKLE_BYTES", 4096)
    monkeypatch.setattr(torch_legacy, "_FIRST_READ", 1024)
    with pytest.raises(MalformedCheckpointError, match="its pickles run past the first 4096 bytes"):
        ckptconv.open(path)


_PATTERNS = {
    "empty sets": b"\x8f" * 30_000_000,
    "empty dicts": b"}" * 30_000_000,
    "marks": b"(" * 30_000_000,
    "tuples": b"N" + b"\x85" * 30_000_000,
    "memo entries": b"N" + b"\x94" * 30_000_000,
    "stand-ins": b"cfoo\nBar\n\x94" + b"h\x00)\x81" * 8_000_000,
    "set() of a memoised list": b"("
    + b"N" * 1_000_000
    + b"l\x94cbuiltins\nset\n\x94"
    + b"h\x01h\x00\x85R0" * 1_000_000,
    "bytearray() of a memoised 10 MB": b"B"
    + (10 << 20).to_bytes(4, "little")
    + b"\0" * (10 << 20)
    + b"\x94cbuiltins\nbytearray\n\x94"
    + b"h\x01h\x00\x85R0" * 1_000_000,
}
_MEASURE = """
import resource, sys, time
from ckptconv.errors import MalformedCheckpointError
from ckptconv.reading.unpickling.unpickler import Unpickler
data = sys.stdin.buffer.read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.process_time()
try:
    Unpickler(data, max_items=1_000_000).load()
    print("loaded")
except MalformedCheckpointError as error:
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(f"{grown * 1024} {time.process_time() - started} {error}")
"""


@pytest.mark.parametrize("pattern", _PATTERNS)
def test_runaway_pickles_stop_within_their_budget(pattern: str) -> None:
    """Measured in a fresh process: peak memory grows <= 80 bytes per budget unit, CPU time <= 10 us per unit.

    With the default budget (20 million) that is <= 1.6 GB and ~40 s for the worst
    pattern; here the budget is 1 million to keep the test quick.
    """
    data = b"\x80\x04" + _PATTERNS[pattern] + b"N."
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE],
        input=data,
        capture_output=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    grown, elapsed, message = result.stdout.decode().split(" ", 2)
    assert "refusing to exhaust memory" in message
    assert int(grown) <= 80 * 1_000_000 + (32 << 20), f"{int(grown) >> 20} MiB"
    # CPU time, not wall time, and a generous bound: this guards against quadratic work (which would
    # take minutes at a million units), not a speed figure, so a loaded machine must not fail it.
    assert float(elapsed) <= 10e-6 * 1_000_000


def test_deeply_nested_containers_do_not_crash_select_or_inspect(tmp_path: Path) -> None:
    depth = 100_000
    path = tmp_path / "deep.pkl"
    path.write_bytes(b"\x80\x02" + (b"}X\x01\x00\x00\x00a") * depth + b"N" + b"s" * depth + b".")
    with pytest.raises(ckptconv.SelectionError):
        ckptconv.open(path).select()
    assert ckptconv.inspect(path).selection_error
    path.write_bytes(b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b".")
    assert ckptconv.inspect(path).total_tensors == 0


def test_numpy_arrays_cannot_claim_more_bytes_than_they_hold() -> None:
    header = b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85C\x01b\x87R"
    state = b"(K\x01J\x00\x00\x00\x40\x85cnumpy\ndtype\nX\x02\x00\x00\x00f4\x89\x88\x87R\x89C\x08" + b"\0" * 8 + b"tb."
    with pytest.raises(MalformedCheckpointError, match="holds 8 bytes"):
        Unpickler(header + state).load()
    assert np.dtype("f4").itemsize == 4


@pytest.mark.parametrize("cast", [None, "bf16"])
def test_a_file_truncated_after_it_was_opened_is_refused_not_crashed(cast: str | None, tmp_path: Path) -> None:
    """Casts and CRC checks of a file cut short after it was opened (a read past its end) get
    the one-line truncation error."""
    from ckptconv.reading.integrity import check_record_crcs

    path = tmp_path / "model.pt"
    torch.save({"w": torch.arange(1 << 20, dtype=torch.float32)}, path)
    ref = ckptconv.open(path).select().weights["w"]
    os.truncate(path, os.path.getsize(path) // 2)
    if cast:
        ref = ref.cast(ckptconv.Cast(cast).target)
    with pytest.raises(MalformedCheckpointError, match=r"is truncated: .* bytes missing at offset"):
        b"".join(bytes(chunk) for chunk in ref.iter_bytes(chunk_bytes=1 << 16))
    with pytest.raises(MalformedCheckpointError, match=r"is truncated: .* bytes missing at offset"):
        check_record_crcs([("w", ref)])


@pytest.mark.parametrize("size", [0, 1, 7, 4096, (1 << 20) + 3])
def test_the_fast_crc32_is_zlibs(size: int) -> None:
    """integrity.crc32 (ISA-L's where installed) gives zlib's values, also continued from a running value."""
    import zlib

    from ckptconv.reading.checksums import crc32

    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data, 0x12345678) == zlib.crc32(data, 0x12345678)
    half = size // 2
    assert crc32(data[half:], crc32(data[:half])) == zlib.crc32(data)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_copy_from_a_file_truncated_after_it_was_opened_is_refused_not_crashed(threads: int, tmp_path: Path) -> None:
    """The writer's checksummed copy (a safetensors tensor into a .pt record) reads into a buffer, so a
    source cut short since it was opened gets the one-line truncation error (a memory map of it gave a
    ValueError traceback, or SIGBUS), also when the second copying thread meets the end. Run in a child
    process, which SIGBUS would kill."""

    source = tmp_path / "model.bin"
    source.write_bytes(bytes(range(256)) * (1 << 14))  # 4 MiB
    os.truncate(source, 1 << 20)
    code = (
        "from ckptconv.runtime import cores as _cores\n"
        "from ckptconv.writing import copying as writing\n"
        "from ckptconv.reading.sources import FileRegion\n"
        f"_cores.spare = lambda: {threads - 1}\n"
        "writing._COPY_STRIPE = 3 << 18\n"
        "output = open(sys.argv[2], 'wb')\n"
        "list(writing._copy_file_region(FileRegion(sys.argv[1], 0), 0, 4 << 20, output, checksum=True))"
    )
    assert "is truncated" in refusal_in_child(code, str(source), str(tmp_path / "out"))


@pytest.mark.parametrize("layout", ["one tensor under every name", "a slice of one storage under every name"])
def test_inspect_of_many_names_on_one_storage_stays_linear(layout: str, tmp_path: Path) -> None:
    """Each row names a few of the keys sharing its storage and counts the rest, so a small file of
    thousands of tied names or views (a pickle memo makes each a few bytes) cannot make ``inspect``
    list every pair: 20,000 names took 16 s and 3 GiB before."""
    count = 2000
    base = torch.arange(count, dtype=torch.float32)
    state = {f"k{i}": base if layout.startswith("one tensor") else base[i : i + 1] for i in range(count)}
    source = tmp_path / "tied.pt"
    torch.save(state, source)
    loaded = torch.load(source, weights_only=True)
    anchor = loaded["k0"].untyped_storage().data_ptr()
    sharing = sum(1 for t in loaded.values() if t.untyped_storage().data_ptr() == anchor) - 1
    info = ckptconv.inspect(source)
    assert len(info.tensors) == count
    for row in info.tensors:
        assert row.shares_count == sharing == count - 1
        assert len(row.shares_with) <= 8 and row.key not in row.shares_with
        assert set(row.shares_with) <= set(state)
    listed = json.dumps(info.to_dict())
    assert len(listed) < 400 * count, len(listed)
    code, stdout, stderr = run_cli("inspect", str(source), "--limit", "1")
    assert code == 0, stderr
    assert f"shares storage with k1, k2, k3 and {count - 4} more" in stdout
