"""Writing: outputs load with plain torch and safetensors, bit for bit; ties, views and casts are right."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import struct
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import ckptconv
from ckptconv.writing.torch_zip import plan_storages

from .conftest import (
    all_dtypes_state,
    assert_same_state,
    assert_same_tensor,
    run_cli,
    tiny_state_dict,
    views_state,
)

SAFETENSORS_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
}


def _safetensors_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value for key, value in state.items() if value.dtype in SAFETENSORS_DTYPES}


@pytest.mark.parametrize("builder", [tiny_state_dict, all_dtypes_state, views_state])
def test_pt_output_loads_with_weights_only_and_mmap(
    builder: Callable[[], dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    state = builder()
    source = tmp_path / "in.pt"
    torch.save(state, source)
    output = tmp_path / "out.pt"
    ckptconv.convert(source, output)
    assert_same_state(torch.load(output, weights_only=True), state)
    assert_same_state(torch.load(output, weights_only=True, mmap=True), state)


@pytest.mark.parametrize("builder", [tiny_state_dict, all_dtypes_state, views_state])
def test_safetensors_output_loads_with_safe_open(
    builder: Callable[[], dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    state = _safetensors_state(builder())
    source = tmp_path / "in.pt"
    torch.save(state, source)
    output = tmp_path / "out.safetensors"
    report = ckptconv.convert(source, output)
    with safe_open(output, framework="pt") as handle:
        metadata = handle.metadata()
        names = handle.keys()
        stored = {key: handle.get_tensor(key) for key in names}
    assert metadata["format"] == "pt"
    assert metadata["ckptconv.source"] == "in.pt"
    assert json.loads(metadata["ckptconv.transforms"]) == []
    for key, tensor in stored.items():
        assert_same_tensor(tensor, state[key], key)
    assert set(stored) | set(report.aliases) == set(state)
    assert_same_state(ckptconv.load(output), state, ordered=False)


def test_tied_weights_in_safetensors(tmp_path: Path) -> None:
    state = views_state()
    source = tmp_path / "in.pt"
    torch.save(state, source)
    output = tmp_path / "out.safetensors"
    report = ckptconv.convert(source, output)
    assert report.aliases == {"lm_head.weight": "embed.weight"}
    with safe_open(output, framework="pt") as handle:
        names = handle.keys()
        assert "lm_head.weight" not in names
        assert json.loads(handle.metadata()["ckptconv.aliases"]) == {"lm_head.weight": "embed.weight"}
    loaded = ckptconv.load(output)
    assert_same_tensor(loaded["lm_head.weight"], state["embed.weight"])
    # Back to .pt: the two keys share one storage again.
    back = tmp_path / "back.pt"
    ckptconv.convert(output, back)
    reloaded = torch.load(back, weights_only=True)
    assert reloaded["lm_head.weight"].data_ptr() == reloaded["embed.weight"].data_ptr()


def test_views_are_written_compactly(tmp_path: Path) -> None:
    big = torch.randn(1000, 1000)
    state = {"rows": big[10:12], "column": big[:, 3], "transposed": big[:4, :5].t()}
    source = tmp_path / "in.pt"
    torch.save(state, source)
    assert source.stat().st_size > 4_000_000
    for suffix in (".pt", ".safetensors"):
        output = tmp_path / f"out{suffix}"
        ckptconv.convert(source, output)
        assert output.stat().st_size < 30_000, suffix
        assert_same_state(ckptconv.load(output), state, ordered=False)


def test_overlapping_views_keep_sharing_one_storage() -> None:
    base = torch.arange(100.0)
    import ckptconv.gpu.torch_tensors as bridge

    cache: dict[Any, Any] = {}
    entries = [
        (k, bridge.from_torch(v, cache))
        for k, v in {"a": base[0:60], "b": base[50:100], "c": base[0:60], "d": torch.zeros(0)}.items()
    ]
    storages, tensors = plan_storages(entries)
    indexes = {t.key: t.storage_index for t in tensors}
    assert indexes["a"] == indexes["b"] == indexes["c"] != indexes["d"]
    assert storages[indexes["a"]].nbytes == 400


@pytest.mark.parametrize("target", ["fp16", "bf16", "fp32"])
def test_casts_match_torch_bit_for_bit(target: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    values = torch.randn(1000) * 1000
    state = {
        "w32": values,
        "w64": values.double() / 7,
        "w16": (values / 100).half(),
        "wbf": (values / 100).bfloat16(),
        "special": torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 65504.0, 65519.0]),
        "steps": torch.arange(5),
        "flags": torch.tensor([True, False]),
    }
    source = tmp_path / "in.pt"
    torch.save(state, source)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[target]
    for suffix in (".pt", ".safetensors"):
        output = tmp_path / f"out{suffix}"
        ckptconv.convert(source, output, transforms=[ckptconv.Cast(target)], overwrite=True)
        loaded = ckptconv.load(output)
        for key, tensor in state.items():
            expected = tensor.to(dtype) if tensor.is_floating_point() else tensor
            assert_same_tensor(loaded[key], expected, f"{key}{suffix}")


def test_saving_torch_tensors_directly(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    state = dict(model.state_dict())
    state["tied"] = state["weight"]
    for name in ("direct.pt", "direct.safetensors"):
        report = ckptconv.save(state, tmp_path / name)
        assert report.tensors == 3
        assert_same_state(ckptconv.load(tmp_path / name), state, ordered=name.endswith(".pt"))


def test_non_tensors_cannot_be_saved(tmp_path: Path) -> None:
    with pytest.raises(ckptconv.WriteError, match="holds a int, not a tensor"):
        ckptconv.save({"epoch": 3}, tmp_path / "x.pt")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: torch.empty(2, device="meta"), "'m' cannot be written: it is a meta-device tensor, which holds no"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "'m' cannot be written: it is a nested"),
        (lambda: torch.ones(2, 2).to_sparse(), r"'m' cannot be written: it is a sparse tensor \(torch.sparse_coo\)"),
        (
            lambda: torch.ones(2, 2).to_sparse_csr(),
            r"'m' cannot be written: it is a sparse tensor \(torch.sparse_csr\)",
        ),
        (lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), "'m' cannot be written: it is a quant"),
    ],
)
def test_tensors_without_plain_bytes_are_refused_by_name(
    make: Callable[[], torch.Tensor], message: str, tmp_path: Path
) -> None:
    """Not a NotImplementedError or RuntimeError from deep inside torch: a WriteError naming the key,
    and a LoadError naming the file when torch itself loaded them (``--trust``)."""
    for name in ("x.pt", "x.safetensors"):
        with pytest.raises(ckptconv.WriteError, match=message):
            ckptconv.save({"w": torch.ones(2), "m": make()}, tmp_path / name)
    assert list(tmp_path.iterdir()) == []
    source = tmp_path / "source.pt"
    torch.save({"w": torch.ones(2), "m": make()}, source)
    with pytest.raises(
        ckptconv.LoadError, match="holds a tensor ckptconv cannot convert: " + message.split(": ", 1)[1]
    ):
        ckptconv.load(source, trust=True)


@pytest.mark.parametrize("extra", [[], ["--no-provenance"], ["--tied", "copy"]])
def test_a_tensor_named_like_the_safetensors_metadata_is_refused(extra: list[str], tmp_path: Path) -> None:
    """'__metadata__' is the header's metadata entry: such a tensor crashed the writer (ValueError) or,
    with no metadata to fill in, silently took the metadata's place in a file no reader opens."""
    source = tmp_path / "odd.pt"
    torch.save({"__metadata__": torch.ones(2), "w": torch.zeros(1)}, source)
    for output in (tmp_path / "out.safetensors", tmp_path / "shards"):
        code, stdout, stderr = run_cli(
            "convert", str(source), str(output) + ("/" if output.name == "shards" else ""), *extra
        )
        assert (code, stdout) == (1, ""), stderr
        assert stderr.count("\n") == 1, stderr
        assert (
            "tensor '__metadata__' cannot be stored in safetensors: the name is reserved for the file's metadata"
            in stderr
        )
        assert not output.exists()
    code, _, stderr = run_cli("convert", str(source), str(tmp_path / "out.pt"))
    assert code == 0, stderr
    assert_same_state(torch.load(tmp_path / "out.pt", weights_only=True), torch.load(source, weights_only=True))


def test_complex128_cannot_go_to_safetensors(tmp_path: Path) -> None:
    with pytest.raises(ckptconv.WriteError, match="complex128, which safetensors cannot store"):
        ckptconv.save({"c": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_output_permissions_follow_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o027)
    try:
        ckptconv.save({"w": torch.ones(2)}, tmp_path / "x.pt")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "x.pt").stat().st_mode) == 0o640


def test_pt_records_are_64_byte_aligned(tmp_path: Path) -> None:
    ckptconv.save(tiny_state_dict(), tmp_path / "x.pt")
    with zipfile.ZipFile(tmp_path / "x.pt") as archive, open(tmp_path / "x.pt", "rb") as file:
        assert archive.testzip() is None  # every CRC is right
        for info in archive.infolist():
            if "/data/" in info.filename:
                file.seek(info.header_offset + 26)
                name_length, extra_length = struct.unpack("<HH", file.read(4))
                assert (info.header_offset + 30 + name_length + extra_length) % 64 == 0


def test_many_records_use_zip64(tmp_path: Path) -> None:
    state = {f"t{i}": torch.tensor([float(i)]) for i in range(70_000)}
    ckptconv.save(state, tmp_path / "many.pt")
    loaded = torch.load(tmp_path / "many.pt", weights_only=True)
    assert len(loaded) == 70_000
    assert loaded["t69999"].item() == 69999.0


def test_verify_catches_a_corrupted_output(tmp_path: Path) -> None:
    state = tiny_state_dict()
    source = tmp_path / "in.pt"
    torch.save(state, source)
    output = tmp_path / "out.safetensors"
    ckptconv.convert(source, output)
    assert ckptconv.verify(source, output).ok
    data = bytearray(output.read_bytes())
    data[-3] ^= 0x01  # flip one bit in the last tensor
    output.write_bytes(bytes(data))
    report = ckptconv.verify(source, output)
    assert not report.ok and report.mismatched[0][1] == "values differ"


def test_verbatim_copies_keep_correct_crcs(tmp_path: Path) -> None:
    source = tmp_path / "in.pt"
    torch.save({"module.w": torch.randn(1000), "module.b": torch.randn(10)[2:5]}, source)
    output = tmp_path / "out.pt"
    ckptconv.convert(source, output, transforms=[ckptconv.StripPrefix("module")])
    with zipfile.ZipFile(output) as archive:
        assert archive.testzip() is None


@pytest.mark.parametrize("source_style", ["zip", "legacy", "safetensors"])
@pytest.mark.parametrize("cast", [None, "bf16", "fp16"])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_streaming_in_many_chunks_is_exact(
    source_style: str, cast: str | None, suffix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small chunk and window sizes drive every streaming path (threads, memory maps) through many pieces."""
    import ckptconv.reading.streaming
    import ckptconv.writing.copying
    import ckptconv.writing.torch_zip

    monkeypatch.setattr(ckptconv.reading.streaming, "DEFAULT_CHUNK_BYTES", 4100)
    monkeypatch.setattr(ckptconv.writing.copying, "_COPY_CHUNK", 70_000)
    monkeypatch.setattr(ckptconv.writing.copying, "_COPY_BUFFER", 4099)  # copies through the buffer in odd pieces
    monkeypatch.setattr(ckptconv.writing.copying, "_COPY_STRIPE", 3 * 4099 + 5)  # ... in runs shared by two threads
    monkeypatch.setattr(ckptconv.runtime.cores, "spare", lambda: 1)
    monkeypatch.setattr(ckptconv.writing.torch_zip, "PHASE_MATCH_BYTES", 1)  # page-phase padding everywhere
    torch.manual_seed(0)
    state = {
        "big": torch.randn(300, 333),
        "half": torch.randn(5000).half(),
        "ids": torch.arange(9000),
        "view": torch.randn(100, 100)[7:90],
    }
    source = tmp_path / ("in.safetensors" if source_style == "safetensors" else "in.pt")
    if source_style == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, source)
    else:
        torch.save(state, source, _use_new_zipfile_serialization=source_style == "zip")
    output = tmp_path / f"out{suffix}"
    ckptconv.convert(source, output, transforms=[ckptconv.Cast(cast)] if cast else [])
    dtype = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[cast]
    expected = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in state.items()}
    assert_same_state(ckptconv.load(output), expected, ordered=False)
    if suffix == ".pt":
        with zipfile.ZipFile(output) as archive:
            assert archive.testzip() is None
        assert_same_state(torch.load(output, weights_only=True, mmap=True), expected, ordered=False)


def test_pt_output_loads_when_torch_computes_record_offsets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch can compute record offsets instead of reading them (calculate_storage_offsets); with
    TORCH_SERIALIZATION_DEBUG=1 it checks every computed offset, including page-phase-padded records."""
    import subprocess
    import sys

    import ckptconv.writing.torch_zip

    pytest.importorskip("torch.utils.serialization.config", reason="this torch cannot compute record offsets")
    monkeypatch.setattr(ckptconv.writing.torch_zip, "PHASE_MATCH_BYTES", 1)
    source = tmp_path / "in.pt"
    torch.save({"module.a": torch.randn(1000), "module.b": torch.randn(300, 7), "module.c": torch.arange(10)}, source)
    output = tmp_path / "out.pt"
    ckptconv.convert(source, output, transforms=[ckptconv.StripPrefix("module")])
    script = (
        "import sys, torch\n"
        "from torch.utils.serialization import config\n"
        "config.load.calculate_storage_offsets = True\n"
        "ref = torch.load(sys.argv[1])\n"
        "for mmap in (False, True):\n"
        "    got = torch.load(sys.argv[2], mmap=mmap)\n"
        "    assert all(torch.equal(got[k[7:]], v) for k, v in ref.items())\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(source), str(output)],
        check=True,
        env={**os.environ, "TORCH_SERIALIZATION_DEBUG": "1"},
    )


def test_full_disk_during_a_checksummed_copy_reports_the_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors -> .pt copies in the kernel while a thread checksums a map of the source; when the
    copy fails the map must still close cleanly, so the user sees the disk error and no partial file."""
    import errno

    from safetensors.torch import save_file

    from ckptconv.writing import copying as writing

    source = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(64, 64), "b": torch.randn(64)}, source)

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")
        yield 0  # a generator, like the real one

    monkeypatch.setattr(writing, "_copy_range", full_disk)
    output = tmp_path / "out.pt"
    with pytest.raises(ckptconv.errors.WriteError, match="the disk is full"):
        ckptconv.convert(source, output, source_hash=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_pt_outputs_are_reproducible_byte_for_byte(tmp_path: Path) -> None:
    """Same input and options give the same file (torch.save draws its serialization id at random);
    other content gets another id, and torch reads the file as before."""
    source = tmp_path / "in.pt"
    torch.save(tiny_state_dict(0), source)
    first, second = tmp_path / "a.pt", tmp_path / "b.pt"
    for output in (first, second):
        code, _, stderr = run_cli("convert", str(source), str(output), "-q")
        assert (code, stderr) == (0, "")
    assert first.read_bytes() == second.read_bytes()
    other_source, other = tmp_path / "other_in.pt", tmp_path / "other.pt"
    torch.save(tiny_state_dict(1), other_source)
    assert run_cli("convert", str(other_source), str(other), "-q")[0] == 0

    def serialization_id(path: Path) -> bytes:
        with zipfile.ZipFile(path) as archive:
            return archive.read(next(n for n in archive.namelist() if n.endswith(".data/serialization_id")))

    assert len(serialization_id(first)) == 40 and serialization_id(first) != serialization_id(other)
    assert_same_state(torch.load(first, weights_only=True), torch.load(source, weights_only=True))


@pytest.mark.parametrize("fails", [False, True])
def test_the_output_is_written_back_while_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    """With fsync on, the disk is asked to write the output's pages while it grows (so the final
    fsync has little left), and that helper is gone before the file is closed, also on failure."""
    import threading
    import time

    from ckptconv.writing import atomic as writing

    started = writing._start_writeback_function()
    if started is None:
        pytest.skip("no sync_file_range here")
    calls: list[int] = []
    monkeypatch.setattr(writing, "WRITEBACK_INTERVAL", 0.001)
    monkeypatch.setattr(writing, "_start_writeback_function", lambda: lambda fd: calls.append(started(fd)) or 0)
    output = tmp_path / "out.bin"
    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext(), writing.atomic_output(output) as file:
        for _ in range(20):
            file.write(b"x" * 4096)
            file.flush()
            time.sleep(0.005)
        if fails:
            raise RuntimeError("stop")
    assert calls and set(calls) == {0}  # it ran, and the kernel accepted every request
    assert not any(thread.name == "ckptconv-writeback" for thread in threading.enumerate())
    assert output.exists() != fails
    if not fails:
        assert output.read_bytes() == b"x" * 4096 * 20


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", "_dcp/"])
def test_records_copied_whole_are_checked_from_the_copy_not_read_again(
    suffix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A zip record copied whole takes its CRC-32 as it is copied: the source's records are read once,
    by the copy, and the output holds the bytes torch reads from the source."""
    from ckptconv.values.tensor import Storage

    torch.manual_seed(0)
    state = {"w": torch.randn(64, 65), "ids": torch.arange(300), "half": torch.randn(77).half()}
    source = tmp_path / "in.pt"
    torch.save(state, source)
    opened: list[str] = []
    reader = Storage.reader

    def counting_reader(self: Storage) -> Any:
        opened.append(self.name)
        return reader(self)

    monkeypatch.setattr(Storage, "reader", counting_reader)
    output = tmp_path / f"out{suffix}"
    ckptconv.convert(source, output, source_hash=False, to="dcp" if suffix == "_dcp/" else None)
    assert opened == []  # the check read no record of its own
    monkeypatch.undo()
    if suffix == "_dcp/":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(output, tmp_path / "from_dcp.pt")
        loaded = torch.load(tmp_path / "from_dcp.pt", weights_only=True)
    else:
        loaded = torch.load(output, weights_only=True) if suffix == ".pt" else load_file(output)
    assert_same_state(loaded, torch.load(source, weights_only=True), ordered=False)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", "/"])
def test_outputs_reserve_their_tensor_bytes_and_never_more(
    suffix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each output file has its tensor bytes reserved on disk before they are written (fallocate); a
    reservation never exceeds what the file then holds, so no block stays allocated past its end."""
    from ckptconv.writing import atomic as writing

    reserved: list[int] = []
    reserve = writing._reserve

    def spy(fd: int, length: int) -> None:
        if length:  # an index file reserves nothing
            reserved.append(length)
        reserve(fd, length)

    monkeypatch.setattr(writing, "_reserve", spy)
    torch.manual_seed(0)
    embed = torch.randn(300, 64)
    state = {"embed": embed, "head": embed, "b": torch.randn(64).half(), "view": torch.randn(50, 50)[5:20]}
    source = tmp_path / "in.pt"
    torch.save(state, source)
    output = tmp_path / ("out" + suffix if suffix != "/" else "shards")
    ckptconv.convert(source, output, source_hash=False, max_shard_size=60_000 if suffix == "/" else None)
    files = sorted(output.glob("*.safetensors")) if suffix == "/" else [output]
    assert len(reserved) == len(files) and (len(files) > 1 or suffix != "/")
    for length, path in zip(reserved, files):
        size = path.stat().st_size
        assert length <= size, (path.name, length, size)
        assert path.stat().st_blocks * 512 < size + (64 << 10), path.name  # nothing reserved past the end
    if suffix == ".pt":
        loaded = torch.load(output, weights_only=True)
    else:
        loaded = {key: value for path in files for key, value in load_file(path).items()}
        assert set(state) - set(loaded) == {"head"}  # the tied copy, stored once as Hugging Face does
    assert_same_state(loaded, {key: state[key] for key in loaded}, ordered=False)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("flipped", [None, "first", "middle", "last"])
def test_copies_in_runs_take_every_run_into_the_record_crc(
    threads: int, flipped: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record copied in runs (by one thread, or shared with a second) gets the CRC-32 of all its
    bytes in order: an intact record converts to what torch reads, and one flipped bit anywhere in it,
    in a run either thread copied, is refused with nothing left behind."""
    from ckptconv.runtime import cores as _cores
    from ckptconv.writing import copying as writing

    monkeypatch.setattr(writing, "_COPY_BUFFER", 1000)
    monkeypatch.setattr(writing, "_COPY_STRIPE", 4096 + 3)
    monkeypatch.setattr(_cores, "spare", lambda: threads - 1)
    torch.manual_seed(0)
    state = {"w": torch.randn(20_000), "b": torch.randn(7)}
    source = tmp_path / "in.pt"
    torch.save(state, source)
    if flipped is not None:
        with zipfile.ZipFile(source) as archive:
            info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
        with open(source, "rb") as file:
            file.seek(info.header_offset + 26)
            name_length, extra_length = struct.unpack("<HH", file.read(4))
        start = info.header_offset + 30 + name_length + extra_length
        at = start + {"first": 5, "middle": info.file_size // 2, "last": info.file_size - 1}[flipped]
        data = bytearray(source.read_bytes())
        data[at] ^= 0x10
        source.write_bytes(bytes(data))
    for suffix in (".pt", ".safetensors"):
        output = tmp_path / f"out{suffix}"
        if flipped is not None:
            with pytest.raises(ckptconv.errors.MalformedCheckpointError, match="CRC-32"):
                ckptconv.convert(source, output, source_hash=False)
            assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]
            continue
        ckptconv.convert(source, output, source_hash=False)
        loaded = torch.load(output, weights_only=True) if suffix == ".pt" else load_file(output)
        assert_same_state(loaded, torch.load(source, weights_only=True), ordered=False)


def test_a_copy_shared_by_two_threads_reports_every_byte_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The progress counts of a copy that two threads share add up to its length, and the bytes and
    CRC-32 are the source's."""
    import zlib

    from ckptconv.reading.sources import FileRegion
    from ckptconv.runtime import cores as _cores
    from ckptconv.writing import copying as writing

    monkeypatch.setattr(writing, "_COPY_BUFFER", 777)
    monkeypatch.setattr(writing, "_COPY_STRIPE", 5000)
    monkeypatch.setattr(_cores, "spare", lambda: 1)
    data = os.urandom(123_457)
    source = tmp_path / "source.bin"
    source.write_bytes(b"head" + data)
    with open(tmp_path / "out", "wb") as output:
        output.write(b"x" * 11)
        steps = writing._copy_file_region(FileRegion(str(source), 4), 0, len(data), output, checksum=True)
        counts: list[int] = []
        while True:
            try:
                counts.append(next(steps))
            except StopIteration as end:
                crc = end.value
                break
        output.write(b"tail")
    assert sum(counts) == len(data) and crc == zlib.crc32(data)
    assert (tmp_path / "out").read_bytes() == b"x" * 11 + data + b"tail"


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_save_opens_each_source_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str) -> None:
    """Tensors read for one save share one open descriptor of their file (read_policy.keeping_open),
    and the output still equals what torch reads from the source."""
    from ckptconv.reading import read_policy

    source = tmp_path / f"many{suffix}"
    state = {f"t{i}": torch.arange(5, dtype=torch.float32) * i for i in range(40)}
    state["big"] = torch.arange(100_000, dtype=torch.float32)  # past the 64 KiB buffered copies
    if suffix == ".pt":
        torch.save(state, source)
    else:
        from safetensors.torch import save_file

        save_file(state, source)
    opened: list[str] = []
    real_open = read_policy.open_file

    def counting(path: str, **kwargs: Any) -> Any:
        opened.append(os.path.basename(path))
        return real_open(path, **kwargs)

    monkeypatch.setattr(read_policy, "open_file", counting)
    for out in ("o.pt", "o.safetensors"):
        opened.clear()
        ckptconv.convert(source, tmp_path / out, source_hash=False, overwrite=True)
        reads = opened.count(source.name)
        assert reads <= 4, f"{out}: {reads} opens of the source for {len(state)} tensors"  # open, detect, CRC check
        got = torch.load(tmp_path / out, weights_only=True) if out.endswith(".pt") else load_file(tmp_path / out)
        assert got.keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(got[key], value), key


def _file_system_of(path: Path) -> str:
    """The type /proc/mounts names for the mount holding ``path`` (the longest mount point above it)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        point = fields[1]
        if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


@pytest.mark.skipif(not Path("/proc/mounts").exists(), reason="Linux only")
def test_outputs_in_tmpfs_are_not_reserved_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tmpfs's fallocate zeroes pages the writes then fill again: outputs there skip the reservation;
    whether a file is in tmpfs is asked of statfs, and held here against /proc/mounts."""
    from ckptconv.writing import atomic as writing

    shm = Path("/dev/shm")
    if _file_system_of(shm) != "tmpfs" or not os.access(shm, os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm")
    for folder in (shm, tmp_path):
        with tempfile.TemporaryFile(dir=folder) as file:
            assert writing._in_memory(file.fileno()) == (_file_system_of(folder) == "tmpfs")
    reserved: list[int] = []
    monkeypatch.setattr(writing, "_reserve_function", lambda: lambda fd, length: reserved.append(length) or 0)
    source = tmp_path / "in.pt"
    torch.save({"w": torch.randn(100, 10)}, source)
    with tempfile.TemporaryDirectory(dir=shm) as folder:
        ckptconv.convert(source, Path(folder) / "out.safetensors", source_hash=False)
        assert_same_state(load_file(Path(folder) / "out.safetensors"), torch.load(source, weights_only=True))
    assert reserved == []
