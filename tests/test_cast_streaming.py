"""The cast path of the streaming reader: mapped and read pieces, reused buffers, and the
CRC-32 of each whole record taken from the bytes that were cast.

Every output is compared with ``Tensor.to`` on the tensors torch itself loads.
"""

from __future__ import annotations

import io
import struct
import threading
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import ckptconv
import ckptconv.reading.streaming
from ckptconv.cli import cli
from ckptconv.errors import MalformedCheckpointError
from ckptconv.reading.streaming import reads_whole_record

from .conftest import refusal_in_child

TARGETS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.fixture
def piece_style(monkeypatch: pytest.MonkeyPatch) -> str:
    """Small pieces, so every tensor below streams in many of them."""
    monkeypatch.setattr(ckptconv.reading.streaming, "DEFAULT_CHUNK_BYTES", 8192)
    return "small pieces"


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    big = torch.randn(123, 457) * 0.02
    big[3, 5] = float("nan")
    big[7, 9] = -0.0
    big[9, 1] = 1e-30  # below every 16-bit subnormal
    return {
        "big": big,  # many pieces, the last one short; a NaN in one block
        "double": torch.randn(2000, dtype=torch.float64) * 1000,
        "half": torch.randn(5001).half(),
        "small": torch.randn(7),
        "tail": torch.randn(100, 100)[13:],  # a view that ends where its storage does
        "ids": torch.arange(9000),
    }


def _expected(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("cast", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_cast_pieces_are_bit_exact(cast: str, suffix: str, piece_style: str, tmp_path: Path) -> None:
    state = _state()
    source = tmp_path / "in.pt"
    torch.save(state, source)
    output = tmp_path / f"out{suffix}"
    ckptconv.convert(source, output, transforms=[ckptconv.Cast(cast)], source_hash=False)
    if suffix == ".pt":
        got = torch.load(output, weights_only=True)
        with zipfile.ZipFile(output) as archive:
            assert archive.testzip() is None  # the records' CRC-32s are those of the cast bytes
    else:
        from safetensors.torch import load_file

        got = load_file(output)
    expected = _expected(state, TARGETS[cast])
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert _same_bits(got[key], value), key


def test_a_cast_records_the_crc_of_each_whole_record_it_reads(piece_style: str, tmp_path: Path) -> None:
    state = _state()
    source = tmp_path / "in.pt"
    torch.save(state, source)
    weights = ckptconv.open(source).select().weights
    bf16 = ckptconv.Cast("bf16").target
    with zipfile.ZipFile(source) as archive:
        recorded = {info.filename.rsplit("/", 1)[1]: info.CRC for info in archive.infolist()}
        raw = {info.filename.rsplit("/", 1)[1]: archive.read(info) for info in archive.infolist()}
    for key, ref in weights.items():
        cast = ref.cast(bf16) if ref.dtype.kind == "float" else ref
        crcs: dict[ckptconv.values.tensor.Storage, int] = {}
        torch_bits = (state[key].to(torch.bfloat16) if state[key].is_floating_point() else state[key]).contiguous()
        streamed = b"".join(bytes(chunk) for chunk in cast.iter_bytes(record_crcs=crcs))
        assert streamed == torch_bits.view(torch.uint8).numpy().tobytes(), key
        record = ref.storage.name.rsplit("/", 1)[-1]
        if cast.cast_to is not None and reads_whole_record(cast):  # uncast records are the writers' copy's
            assert key not in ("tail", "ids")  # a view of part of its record; an integer tensor
            assert zlib.crc32(raw[record]) == recorded[record]
            assert crcs == {ref.storage: recorded[record]}
        else:
            assert key in ("tail", "ids") and crcs == {}


def test_record_crcs_are_left_alone_when_the_stream_stops_early(piece_style: str, tmp_path: Path) -> None:
    source = tmp_path / "in.pt"
    torch.save({"w": torch.randn(10_000)}, source)
    ref = ckptconv.open(source).select().weights["w"].cast(ckptconv.Cast("fp16").target)
    crcs: dict[ckptconv.values.tensor.Storage, int] = {}
    chunks = ref.iter_bytes(record_crcs=crcs)
    next(chunks)
    chunks.close()
    assert crcs == {}


def _flip_in_record(data: bytes, name: str, where: int) -> bytes:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/" + name))
    name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
    at = info.header_offset + 30 + name_length + extra_length + where
    return data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1 :]


@pytest.mark.parametrize("cast", ["bf16", "fp16"])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_damaged_record_is_refused_when_a_cast_reads_it(
    cast: str, suffix: str, piece_style: str, tmp_path: Path
) -> None:
    """The cast's own read checks the record (the source is not read a second time for it):
    a flipped byte in any piece is refused with the one-line error, and nothing is written;
    --no-crc-check converts the bytes as they are."""
    buffer = io.BytesIO()
    torch.save({"w": torch.randn(20_000)}, buffer)
    source = tmp_path / "in.pt"
    source.write_bytes(_flip_in_record(buffer.getvalue(), "0", where=70_001))
    output = tmp_path / f"out{suffix}"
    runner = CliRunner()
    result = runner.invoke(
        cli, ["convert", str(source), str(output), "--dtype", cast, "--no-source-hash"], catch_exceptions=False
    )
    assert result.exit_code == 1, result.output
    assert result.stderr.count("\n") == 1 and "has CRC-32" in result.stderr and "--no-crc-check" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]
    with pytest.raises(MalformedCheckpointError, match=r"record '.*0' \(tensor 'w'\) has CRC-32"):
        ckptconv.convert(source, output, transforms=[ckptconv.Cast(cast)], source_hash=False)
    ckptconv.convert(source, output, transforms=[ckptconv.Cast(cast)], source_hash=False, check_crc=False)
    damaged = torch.load(source, weights_only=True)["w"]  # torch does not check stored records' CRCs
    got = ckptconv.load(output)["w"]
    assert _same_bits(got, damaged.to(TARGETS[cast]))


def test_spare_buffers_stay_bounded(piece_style: str, tmp_path: Path) -> None:
    source = tmp_path / "in.pt"
    torch.save({f"w{i}": torch.randn(5000) for i in range(20)}, source)
    for ref in ckptconv.open(source).select().weights.values():
        for _ in ref.cast(ckptconv.Cast("fp16").target).iter_bytes():
            pass
    spare = ckptconv.reading.streaming._SPARE
    assert spare and sum(buffer.nbytes for buffer in spare) <= ckptconv.reading.streaming._SPARE_BYTES
    assert all(isinstance(buffer, np.ndarray) for buffer in spare)


def test_chunk_crcs_are_those_of_the_chunks(piece_style: str, tmp_path: Path) -> None:
    """iter_bytes_with_crcs: a cast's chunks come with their CRC-32 (taken by the cast threads),
    other chunks with None; the bytes are iter_bytes' bytes."""
    from ckptconv.reading.streaming import iter_bytes_with_crcs

    source = tmp_path / "in.pt"
    torch.save({"w": torch.randn(30_000), "ids": torch.arange(5000)}, source)
    weights = ckptconv.open(source).select().weights
    cast = weights["w"].cast(ckptconv.Cast("fp16").target)
    pieces = [(bytes(view), crc) for view, crc in iter_bytes_with_crcs(cast)]
    assert len(pieces) > 2 and all(crc == zlib.crc32(data) for data, crc in pieces)
    assert b"".join(data for data, _ in pieces) == torch.load(source)["w"].half().numpy().tobytes()
    plain = [(bytes(view), crc) for view, crc in iter_bytes_with_crcs(weights["ids"])]
    assert plain and all(crc is None for _, crc in plain)
    assert b"".join(data for data, _ in plain) == torch.arange(5000).numpy().tobytes()


def test_a_cast_from_a_file_cut_short_after_it_was_opened_is_refused_in_one_line(tmp_path: Path) -> None:
    """The cast reads its pieces (never maps them), so a source truncated after it was opened, as a
    training job overwriting its checkpoint does, gets the truncation error, not SIGBUS. Run in a child
    process, which SIGBUS would kill."""

    source = tmp_path / "in.pt"
    torch.save({"w": torch.randn(1 << 20)}, source)  # 4 MiB: several pieces
    code = (
        "import os, ckptconv\n"
        "weights = ckptconv.open(sys.argv[1]).select().weights\n"
        "os.truncate(sys.argv[1], 3 << 20)\n"
        "ckptconv.save({k: v.cast(ckptconv.Cast('fp16').target) for k, v in weights.items()}, sys.argv[2])"
    )
    message = refusal_in_child(code, str(source), str(tmp_path / "out.safetensors"))
    assert "is truncated" in message and message.count("\n") == 1
    assert not (tmp_path / "out.safetensors").exists()


def test_a_spare_buffer_too_small_stays_for_a_smaller_request() -> None:
    """A worker's read buffer and the pieces' outputs differ in size: taking one must not drop
    the other (it would be allocated again, its pages faulted in, for the next piece)."""
    from ckptconv.reading.streaming import _give_back, _take

    spare = ckptconv.reading.streaming._SPARE
    saved = spare[:]
    spare.clear()
    try:
        small, big = np.empty(1000, np.uint8), np.empty(5000, np.uint8)
        _give_back(big)
        _give_back(small)
        assert _take(3000) is big
        assert _take(800) is small
        assert spare == []
    finally:
        spare[:] = saved


def _cast_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name.startswith("ckptconv-cast")}


def _casting_threads(monkeypatch: pytest.MonkeyPatch) -> set[threading.Thread]:
    """The threads that cast pieces from now on (thread objects, which are never reused)."""
    seen: set[threading.Thread] = set()
    cast = ckptconv.reading.streaming._cast

    def spying(ref: Any, values: Any, out: Any = None) -> Any:
        seen.add(threading.current_thread())
        return cast(ref, values, out)

    monkeypatch.setattr(ckptconv.reading.streaming, "_cast", spying)
    return seen


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_one_pool_of_cast_threads_serves_a_whole_write_and_ends_with_it(
    suffix: str, piece_style: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {f"w{i}": torch.randn(5000) * 0.02 for i in range(4)}  # five pieces each
    source = tmp_path / "in.pt"
    torch.save(state, source)
    before = _cast_threads()
    seen = _casting_threads(monkeypatch)
    ckptconv.convert(source, tmp_path / f"out{suffix}", transforms=[ckptconv.Cast("fp16")], source_hash=False)
    # At most two threads for the four tensors (a pool per tensor starts at least one for each;
    # a fast machine may finish every piece on one).
    assert 1 <= len(seen) <= ckptconv.reading.streaming.cast_workers()
    assert _cast_threads() == before
    got = ckptconv.open(tmp_path / f"out{suffix}").select().weights
    for key, value in state.items():
        assert got[key].tobytes() == value.half().view(torch.uint8).numpy().tobytes(), key


def test_a_stream_outside_a_write_has_threads_of_its_own_that_end_with_it(
    piece_style: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "in.pt"
    torch.save({"a": torch.randn(5000), "b": torch.randn(5000)}, source)
    refs = [ref.cast(ckptconv.Cast("fp16").target) for ref in ckptconv.open(source).select().weights.values()]
    before = _cast_threads()
    seen = _casting_threads(monkeypatch)
    for ref in refs:
        assert sum(len(chunk) for chunk in ref.iter_bytes()) == 10_000
        assert _cast_threads() == before
    assert (
        len(refs) <= len(seen) <= len(refs) * ckptconv.reading.streaming.cast_workers()
    )  # new threads for each tensor


def test_a_stream_left_early_in_a_kept_pool_lets_the_next_tensor_cast_exactly(piece_style: str, tmp_path: Path) -> None:
    state = {"a": torch.randn(50_000), "b": torch.randn(50_000)}
    source = tmp_path / "in.pt"
    torch.save(state, source)
    fp16 = ckptconv.Cast("fp16").target
    a, b = (ref.cast(fp16) for ref in ckptconv.open(source).select().weights.values())
    before = _cast_threads()
    with ckptconv.reading.streaming.keeping_workers():
        chunks = a.iter_bytes()
        next(chunks)
        chunks.close()  # its pieces in flight end here, before the next tensor's start
        streamed = b"".join(bytes(chunk) for chunk in b.iter_bytes())
        assert len(_cast_threads() - before) == ckptconv.reading.streaming.cast_workers()
    assert streamed == state["b"].half().view(torch.uint8).numpy().tobytes()
    assert _cast_threads() == before


def test_a_refused_cast_leaves_no_cast_thread_behind(piece_style: str, tmp_path: Path) -> None:
    source = tmp_path / "in.pt"
    values = torch.randn(50_000)
    values[40_000] = 1e6  # overflows float16, in a late piece
    torch.save({"a": torch.randn(50_000), "b": values}, source)
    before = _cast_threads()
    with pytest.raises(ckptconv.errors.CastOverflowError):
        ckptconv.convert(source, tmp_path / "out.safetensors", transforms=[ckptconv.Cast("fp16")], source_hash=False)
    assert _cast_threads() == before
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize(("cores", "workers"), [(1, 2), (2, 2), (3, 2), (4, 3), (7, 6), (64, 6)])
def test_casts_take_a_thread_per_core_but_the_writers_between_two_and_six(
    cores: int, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ckptconv.runtime.cores, "usable", lambda: cores)
    assert ckptconv.reading.streaming.cast_workers() == workers


def test_verifying_a_cast_conversion_casts_on_one_pool_of_threads(
    piece_style: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, output = tmp_path / "in.pt", tmp_path / "out.safetensors"
    torch.save({f"w{i}": torch.randn(5000) for i in range(4)}, source)
    ckptconv.convert(source, output, transforms=[ckptconv.Cast("fp16")], source_hash=False)
    seen = _casting_threads(monkeypatch)
    assert ckptconv.verify(source, output, transforms=[ckptconv.Cast("fp16")]).ok
    assert 1 <= len(seen) <= ckptconv.reading.streaming.cast_workers()
