"""Parallel reads into torch tensors (ckptconv.gpu.transfer), bit for bit against torch.load and safetensors.

The pieces are made tiny here so that every tensor is cut into many pieces read
by several threads in any order. The GPU tests run only where CUDA is available.
"""

from __future__ import annotations

import json
import mmap
import os
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import ckptconv
from ckptconv.errors import MalformedCheckpointError
from ckptconv.gpu import page_cache
from ckptconv.gpu import transfer as _transfer
from ckptconv.reading.checksums import crc32_combine

from .conftest import all_dtypes_state, assert_same_state, reference_load, views_state

CUDA = torch.cuda.is_available()


def big_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    state = {f"w{i}": torch.randn(37 + i, 129, generator=generator) for i in range(6)}
    state["ids"] = torch.arange(10_001)
    state["half"] = torch.randn(333, generator=generator).half()
    state["empty"] = torch.zeros(0)
    state["scalar"] = torch.tensor(3.5)
    return state


def saved_big_state(tmp_path: Path, suffix: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """:func:`big_state` saved as ``.pt`` or ``.safetensors``, and what torch or the safetensors library reads back."""
    path = tmp_path / f"m{suffix}"
    if suffix == ".safetensors":
        save_file(big_state(), path)
        return path, load_file(path)
    torch.save(big_state(), path)
    return path, reference_load(path)


def _gpu_load_taking_crcs(tmp_path: Path) -> tuple[Path, dict[str, Any], dict[object, int]]:
    """:func:`big_state` saved as ``.pt``, its tensors loaded to cuda:0 with the records' CRC-32s taken:
    ``(path, refs, crcs)``."""
    from ckptconv.gpu.torch_tensors import to_torch

    path = tmp_path / "m.pt"
    torch.save(big_state(), path)
    refs = dict(ckptconv.open(path).tensors())
    crcs: dict[object, int] = {}
    to_torch(refs, device="cuda:0", crcs=crcs)  # type: ignore[arg-type]
    return path, refs, crcs


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of 8 KiB payload (16 KiB buffers less room to align O_DIRECT reads): every tensor
    above spans several pieces."""
    monkeypatch.setattr(_transfer, "PIECE_BYTES", 16384)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors", ".legacy.pt"])
def test_parallel_cpu_load_equals_reference(tmp_path: Path, suffix: str, small_pieces: None) -> None:
    state = big_state()
    path = tmp_path / f"m{suffix}"
    if suffix == ".safetensors":
        save_file(state, path)
        reference = load_file(path)
    else:
        torch.save(state, path, _use_new_zipfile_serialization=suffix == ".pt")
        reference = reference_load(path)
    assert_same_state(ckptconv.load(path), reference, ordered=False)


@pytest.mark.parametrize("builder", [all_dtypes_state, views_state])
def test_shared_storages_and_views_survive(tmp_path: Path, builder: object, small_pieces: None) -> None:
    path = tmp_path / "m.pt"
    torch.save(builder(), path)  # type: ignore[operator]
    loaded = ckptconv.load(path)
    assert_same_state(loaded, reference_load(path), ordered=False)


def test_compressed_records_are_read_in_order(tmp_path: Path, small_pieces: None) -> None:
    """A zip whose records are deflated: one thread per record, read front to back."""
    import zipfile

    path = tmp_path / "m.pt"
    torch.save(big_state(), path)
    deflated = tmp_path / "deflated.pt"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info))
    assert_same_state(ckptconv.load(deflated), reference_load(path), ordered=False)


def test_truncated_file_raises_one_error(tmp_path: Path, small_pieces: None) -> None:
    path = tmp_path / "m.safetensors"
    save_file(big_state(), path)
    size = path.stat().st_size
    with open(path, "r+b") as file:
        file.truncate(size - 20_000)
    with pytest.raises(MalformedCheckpointError, match="is truncated"):
        ckptconv.load(path)


def test_reader_threads_bounds() -> None:
    assert 2 <= _transfer.reader_threads() <= _transfer.MAX_THREADS
    assert 2 <= _transfer.reader_threads(gpu=True) <= _transfer.MAX_GPU_THREADS
    assert _transfer.reader_threads(gpu=True) <= _transfer.reader_threads()


@given(
    start=st.integers(0, 1 << 20),
    length=st.integers(0, 1 << 22),
    payload=st.sampled_from([4096, 8192, 12288, 65536 - 8192, (8 << 20) - 8192]),
)
def test_pieces_cover_the_span_once(start: int, length: int, payload: int) -> None:
    pieces = _transfer.plan_pieces(start, start + length, payload)
    position = start
    for piece_start, count in pieces:
        assert piece_start == position and 0 < count <= payload
        position += count
    assert position == start + length
    assert len(pieces) == -(-length // payload)  # as few as the payload allows
    if len(pieces) > 1:  # about equal: no tiny remainder
        assert all(count % 4096 == 0 for _, count in pieces[:-1])
        assert pieces[-1][1] > pieces[0][1] - len(pieces) * 4096


@given(a=st.binary(max_size=5000), b=st.binary(max_size=5000), seed=st.integers(0, 2**32 - 1))
def test_crc32_combine_equals_zlib(a: bytes, b: bytes, seed: int) -> None:
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    start = seed & 0xFFFFFFFF
    assert crc32_combine(zlib.crc32(a, start), zlib.crc32(b), len(b)) == zlib.crc32(a + b, start)


def test_crc32_combine_long_lengths() -> None:
    block = os.urandom(1 << 16)
    whole = zlib.crc32(block * 300)
    assert crc32_combine(zlib.crc32(block * 100), zlib.crc32(block * 200), len(block) * 200) == whole


def test_join_crcs_needs_every_byte_once() -> None:
    data = os.urandom(10_000)
    pieces = [(p, min(3000, 10_000 - p), zlib.crc32(data[p : p + 3000])) for p in range(0, 10_000, 3000)]
    assert _transfer._join_crcs(list(reversed(pieces)), 10_000) == zlib.crc32(data)
    assert _transfer._join_crcs(pieces[:-1], 10_000) is None  # a gap at the end
    assert _transfer._join_crcs(pieces[1:], 10_000) is None  # a gap at the start
    assert _transfer._join_crcs([*pieces, pieces[1]], 10_000) is None  # a piece twice


def test_pinned_buffers_come_one_by_one_and_errors_reach_the_readers(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []

    def fake_staging(nbytes: int) -> torch.Tensor:  # plain memory: pinning needs CUDA
        made.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(_transfer, "_staging", fake_staging)
    monkeypatch.setattr(_transfer, "registered_staging", False)  # torch's buffers, as where CUDA refuses
    pinned = _transfer._Pinned(3)
    buffers = [pinned.first(), pinned.first(), pinned.first()]
    assert all(b.numel() == _transfer.PIECE_BYTES for b in buffers)
    assert pinned.more() is None  # all three taken; only the wake-up markers are left
    pinned.close()
    assert made == [_transfer.PIECE_BYTES] * 3

    def failing(nbytes: int) -> torch.Tensor:
        raise RuntimeError("cudaHostAlloc failed")

    monkeypatch.setattr(_transfer, "_staging", failing)
    pinned = _transfer._Pinned(2)
    with pytest.raises(RuntimeError, match="cudaHostAlloc failed"):
        pinned.first()
    pinned.close()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_loads_stage_in_one_registered_area_kept_for_the_next_load(
    tmp_path: Path, small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptconv.gpu import host_staging

    made: list[int] = []
    real = host_staging.Area

    def counted(nbytes: int) -> host_staging.Area:
        made.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(host_staging, "Area", counted)
    monkeypatch.setattr(host_staging, "_idle", [])
    monkeypatch.setattr(_transfer, "_staging", lambda nbytes: pytest.fail("torch's pinned buffers were made"))
    for suffix in (".safetensors", ".pt"):
        path, want = saved_big_state(tmp_path, suffix)
        got = ckptconv.load(path, device="cuda:0")
        assert_same_state({k: v.cpu() for k, v in got.items()}, want)
    assert len(made) == 1  # the second load took the first one's area
    assert len(host_staging._idle) == 1


def _load_interrupted_at_a_piece(
    path: Path, device: str | None, monkeypatch: pytest.MonkeyPatch, after: Callable[[], None] = lambda: None
) -> list[int]:
    """``ckptconv.load(path, device=device)`` with one reader, interrupted by SIGINT to the main thread (as
    Ctrl-C sends it; ``_thread.interrupt_main()`` would wake no join) while the reader is held at its first
    piece; ``after`` runs once KeyboardInterrupt came, the reader still held. Returns the pieces the reader
    took, once it is done."""
    import signal
    import threading

    monkeypatch.setattr(_transfer, "reader_threads", lambda gpu=False: 1)
    reading, release = threading.Event(), threading.Event()
    real_run = _transfer._Worker.run
    pieces: list[int] = []

    def held(worker: Any, task: Any) -> None:
        pieces.append(task.position)
        reading.set()
        release.wait(30)
        real_run(worker, task)

    monkeypatch.setattr(_transfer._Worker, "run", held)
    main = threading.main_thread().ident
    assert main is not None
    interrupter = threading.Thread(
        target=lambda: reading.wait(30) and signal.pthread_kill(main, signal.SIGINT), daemon=True
    )
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ckptconv.load(path, device=device)
        after()
    finally:
        release.set()
        interrupter.join()
        for thread in threading.enumerate():
            if thread.name.startswith("ckptconv-reader-"):
                thread.join(30)
    return pieces


def test_an_interrupted_load_tells_its_readers_to_stop_at_their_next_piece(
    tmp_path: Path, small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while the readers are joined: the reader at work finishes its piece and takes no other (it reads
    into buffers, and from descriptors, that the interrupted load no longer owns)."""
    path, _ = saved_big_state(tmp_path, ".safetensors")
    pieces = _load_interrupted_at_a_piece(path, None, monkeypatch)
    assert len(pieces) == 1  # of the file's many pieces (small_pieces), only the one it held


def test_a_load_waits_for_its_readers_in_turns_that_a_ctrl_c_always_ends(
    tmp_path: Path, small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGINT that lands after the main thread let the GIL go and before its wait began only flags the
    signal: an unbounded join sleeps through it until the readers end (3 of 10 interrupted loads on Python
    3.12 read the whole file). Waited for in bounded turns, the flag is seen at the next one."""
    import threading

    waits: list[float | None] = []
    waiting = threading.Event()
    real_join, real_run = threading.Thread.join, _transfer._Worker.run

    def recorded(thread: threading.Thread, timeout: float | None = None) -> None:
        if thread.name.startswith("ckptconv-reader-"):
            waits.append(timeout)
            waiting.set()
        real_join(thread, timeout)

    def held(worker: Any, task: Any) -> None:
        waiting.wait(30)  # the readers work once the main thread waits for them
        real_run(worker, task)

    monkeypatch.setattr(threading.Thread, "join", recorded)
    monkeypatch.setattr(_transfer._Worker, "run", held)
    path, want = saved_big_state(tmp_path, ".safetensors")
    assert_same_state(ckptconv.load(path), want)
    assert waits
    assert all(timeout is not None and 0 < timeout <= 1 for timeout in waits), waits


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_an_interrupted_gpu_load_keeps_no_staging_area_its_readers_still_use(
    tmp_path: Path, small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during a load (a notebook's interrupt) leaves its reader threads at work in their buffers: the area
    they stage in must not be kept for the next load, whose readers would stage in the same memory. The reader
    is the one whose join is interrupted: CPython then calls it stopped while it runs (is_alive() is False)."""
    from ckptconv.gpu import host_staging

    monkeypatch.setattr(host_staging, "_idle", [])
    path, _ = saved_big_state(tmp_path, ".safetensors")

    def no_area_kept() -> None:
        assert host_staging._idle == []

    _load_interrupted_at_a_piece(path, "cuda:0", monkeypatch, after=no_area_kept)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("reserve", [True, False])
def test_gpu_destinations_come_out_of_one_reservation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reserve: bool
) -> None:
    """Large destinations are split out of one cudaMalloc, each still a storage of its own."""
    from ckptconv.gpu import torch_tensors

    monkeypatch.setattr(torch_tensors, "reserve_destinations", reserve)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    generator = torch.Generator().manual_seed(8)
    state = {f"w{i}": torch.randn(1 << 20, generator=generator) for i in range(24)}  # 4 MiB each: large pool
    state["small"] = torch.randn(7, generator=generator)
    path = tmp_path / "m.safetensors"
    save_file(state, path)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_stats()["segment.large_pool.allocated"]
    got = ckptconv.load(path, device="cuda:0")
    segments = torch.cuda.memory_stats()["segment.large_pool.allocated"] - before
    assert_same_state({k: v.cpu() for k, v in got.items()}, load_file(path))
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == len(got)
    assert segments == 1 if reserve else segments > 1
    del got
    torch.cuda.empty_cache()


@pytest.mark.parametrize("whole_record", [True, False])
def test_readers_check_zip_crcs_without_a_second_read(tmp_path: Path, small_pieces: None, whole_record: bool) -> None:
    """A flipped bit in a record is found from the pieces' CRC-32s; the error names the tensor."""
    path = tmp_path / "m.pt"
    torch.save(big_state(), path)
    ckpt = ckptconv.open(path)
    refs = dict(ckpt.tensors())
    crcs: dict[object, int] = {}
    from ckptconv.gpu.torch_tensors import to_torch

    to_torch(refs, crcs=crcs)  # type: ignore[arg-type]
    record = refs["w3"].storage
    assert crcs[record] == record.source.crc32  # type: ignore[union-attr]
    assert len(crcs) == sum(1 for r in refs.values() if r.storage.nbytes > 0)
    data = bytearray(path.read_bytes())
    offset = record.source.offset + (record.nbytes // 2 if whole_record else 0)  # type: ignore[union-attr]
    data[offset] ^= 0x10
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(bytes(data))
    with pytest.raises(MalformedCheckpointError, match=r"record .* \(tensor 'w3'\) has CRC-32"):
        ckptconv.load(damaged)
    loaded = ckptconv.load(damaged, check_crc=False)  # the damaged bytes, as they are
    assert not torch.equal(loaded["w3"], big_state()["w3"])
    assert torch.equal(loaded["w2"], big_state()["w2"])


def sharded_folder(tmp_path: Path, state: dict[str, torch.Tensor], shards: int = 3) -> Path:
    """``state`` saved as a folder of safetensors shards with an index, as transformers writes it."""
    folder = tmp_path / "sharded"
    folder.mkdir()
    names = list(state)
    weight_map = {}
    for index in range(shards):
        part = {k: state[k] for k in names[index::shards]}
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def test_sharded_folder_is_read_by_one_reader_pool(
    tmp_path: Path, small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every shard's pieces go to the same readers (one read_spans call); bit for bit against safetensors."""
    state = big_state()
    folder = sharded_folder(tmp_path, state)
    calls: list[int] = []
    real = _transfer.read_spans

    def counting(spans: object, **kwargs: object) -> None:
        calls.append(len({span.storage.source.path for span in spans}))  # type: ignore[attr-defined]
        real(spans, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ckptconv.gpu.torch_tensors, "read_spans", counting)
    loaded = ckptconv.load(folder)
    assert calls == [3]
    reference = {}
    for shard in sorted(folder.glob("*.safetensors")):
        reference.update(load_file(shard))
    assert_same_state(loaded, reference, ordered=False)


def test_resident_fraction(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 20))
    with open(path, "rb") as file:
        file.read()
    assert 0.0 <= page_cache.resident_fraction(str(path)) <= 1.0
    assert page_cache.resident_fraction(str(path)) > 0.5  # just written and read: in the page cache
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert page_cache.resident_fraction(str(empty)) == 1.0


@pytest.mark.parametrize("extra", [0, 1, 4095])
def test_resident_fraction_samples_big_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: int) -> None:
    """A big file is asked about in runs of pages spread over it; warm and dropped read the same as
    asking about every page (where the filesystem drops pages at all)."""
    monkeypatch.setattr(page_cache, "SAMPLE_PAGES", 64)
    monkeypatch.setattr(page_cache, "SAMPLE_RUN", 8)
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(300 * mmap.PAGESIZE + extra))  # 300 or 301 pages: sampled
    with open(path, "rb") as file:
        file.read()
    assert page_cache.resident_fraction(str(path)) == page_cache.resident_fraction(str(path), sample=False) == 1.0
    with open(path, "rb") as file:
        os.fsync(file.fileno())
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    whole = page_cache.resident_fraction(str(path), sample=False)
    if whole > 0.5:
        pytest.skip("this filesystem keeps the pages (tmpfs)")
    assert page_cache.resident_fraction(str(path)) < 0.5


@pytest.mark.parametrize("offset, count", [(0, 4096), (1, 10), (4095, 4098), (5000, 9000), (12288, 3)])
def test_direct_reads_return_the_requested_bytes(tmp_path: Path, offset: int, count: int) -> None:
    data = os.urandom(20_000)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        pytest.skip("O_DIRECT is refused on this filesystem")
    try:
        raw = np.zeros(3 * 4096 + 16384, dtype=np.uint8)
        start = (-raw.ctypes.data) % 4096  # an aligned buffer, as pinned memory is
        buffer = raw[start : start + 16384 + 8192].data
        skip = _transfer._read_direct(fd, str(path), offset, count, buffer)
        assert bytes(buffer[skip : skip + count]) == data[offset : offset + count]
        with pytest.raises(MalformedCheckpointError, match="is truncated"):
            _transfer._read_direct(fd, str(path), 19_000, 2000, buffer)
    finally:
        os.close(fd)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["buffered", "direct"])
def test_gpu_load_takes_every_records_crc_and_refuses_a_flipped_bit(
    tmp_path: Path, mode: str, small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the pieces' CRC-32s are taken from the staged bytes: every record's, read once
    (page cache or O_DIRECT), and a flipped bit near a record's end is refused."""
    from ckptconv.gpu import crc as _gpu_crc

    monkeypatch.setattr(_transfer, "direct_io", mode)
    path, refs, crcs = _gpu_load_taking_crcs(tmp_path)
    records = sum(1 for r in refs.values() if r.storage.nbytes > 0)
    assert len(crcs) == records, f"{len(crcs)} of {records} CRC-32s taken; the kernel: {_gpu_crc.failures}"
    assert all(crcs[r.storage] == r.storage.source.crc32 for r in refs.values() if r.storage.nbytes > 0)  # type: ignore[union-attr]
    record = refs["w4"].storage
    data = bytearray(path.read_bytes())
    data[record.source.offset + record.nbytes - 3] ^= 0x01  # type: ignore[union-attr]
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(bytes(data))
    with pytest.raises(MalformedCheckpointError, match=r"record .* \(tensor 'w4'\) has CRC-32"):
        ckptconv.load(damaged, device="cuda:0")


def gpu_load_matches_torch(tmp_path: Path, suffix: str) -> dict[str, torch.Tensor]:
    """Load :func:`saved_big_state` onto cuda:0 and check every tensor is there with the bytes torch
    reads from the file; return torch's tensors."""
    path, reference = saved_big_state(tmp_path, suffix)
    loaded = ckptconv.load(path, device="cuda:0")
    assert all(t.device == torch.device("cuda:0") for t in loaded.values())
    assert_same_state({k: v.cpu() for k, v in loaded.items()}, reference, ordered=False)
    return reference


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["buffered", "direct", "auto"])
def test_gpu_load_of_a_sharded_folder(
    tmp_path: Path, mode: str, small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_transfer, "direct_io", mode)
    folder = sharded_folder(tmp_path, big_state())
    reference = {}
    for shard in sorted(folder.glob("*.safetensors")):
        reference.update(load_file(shard))
    loaded = ckptconv.load(folder, device="cuda:0")
    assert all(t.device == torch.device("cuda:0") for t in loaded.values())
    assert_same_state({k: v.cpu() for k, v in loaded.items()}, reference, ordered=False)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["buffered", "direct", "auto"])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_gpu_load_equals_cpu_load(
    tmp_path: Path, suffix: str, mode: str, small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_transfer, "direct_io", mode)
    gpu_load_matches_torch(tmp_path, suffix)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("through", ["driver", "torch", "no-driver-library"])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_gpu_copies_through_the_cuda_driver_or_torch_land_the_same_bytes(
    tmp_path: Path, suffix: str, through: str, small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The readers' copies go through the CUDA driver (ctypes) where it can be had, else through torch;
    either way every byte lands where torch puts it, and the driver path is really the one taken."""
    from ckptconv.gpu import cuda_driver as _cuda_driver

    monkeypatch.setattr(_transfer, "driver_copies", through != "torch")
    if through == "no-driver-library":
        monkeypatch.setattr(_cuda_driver, "driver", lambda: None)
    copies: list[int] = []
    real = _cuda_driver.DeviceCopier.copy

    def counted(self: _cuda_driver.DeviceCopier, destination: int, source: int, count: int, slot: int) -> object:
        copies.append(count)
        return real(self, destination, source, count, slot)

    monkeypatch.setattr(_cuda_driver.DeviceCopier, "copy", counted)
    reference = gpu_load_matches_torch(tmp_path, suffix)
    total = sum(t.untyped_storage().nbytes() for t in reference.values())
    assert (sum(copies) >= total) if through == "driver" else copies == []


TWO_GPUS = CUDA and torch.cuda.device_count() >= 2


@pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("through", ["driver", "torch"])
def test_loads_to_a_second_gpu_and_split_across_two_land_the_same_bytes(
    tmp_path: Path, through: str, small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver's copies run in each device's own context: a load to cuda:1, and one reader pool
    filling a model split over cuda:0 and cuda:1 (load_into device="model"), land torch's bytes."""
    monkeypatch.setattr(_transfer, "driver_copies", through == "driver")
    state = big_state()
    path = tmp_path / "m.pt"
    torch.save(state, path)
    reference = reference_load(path)
    loaded = ckptconv.load(path, device="cuda:1")
    assert all(t.device == torch.device("cuda:1") for t in loaded.values())
    assert_same_state({k: v.cpu() for k, v in loaded.items()}, reference, ordered=False)

    class Split(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name, tensor in state.items():
                device = "cuda:0" if name in ("w0", "w2", "w4", "ids") else "cuda:1"
                self.register_buffer(name, torch.zeros_like(tensor, device=device))

    model = Split()
    ckptconv.load_into(model, path, device="model")
    for name, tensor in model.state_dict().items():
        assert tensor.device == torch.device("cuda:0" if name in ("w0", "w2", "w4", "ids") else "cuda:1")
        assert tensor.dtype == reference[name].dtype and torch.equal(tensor.cpu(), reference[name]), name


def test_without_a_cuda_driver_the_copier_is_refused_so_readers_copy_through_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ckptconv.gpu import cuda_driver as _cuda_driver

    monkeypatch.setattr(_cuda_driver, "driver", lambda: None)
    with pytest.raises(OSError, match="no CUDA driver library"):
        _cuda_driver.DeviceCopier(0, 0, 1)


def test_records_left_to_the_gpu_are_not_checksummed_by_the_readers(tmp_path: Path) -> None:
    """The readers take no CRC-32 of the spans the GPU checks (``on_gpu``), and every other whole record's."""
    path = tmp_path / "m.pt"
    torch.save(big_state(), path)
    refs = dict(ckptconv.open(path).tensors())
    storages = list(dict.fromkeys(r.storage for r in refs.values() if r.storage.nbytes > 0))
    spans = [_transfer.Span(s, 0, s.nbytes, torch.empty(s.nbytes, dtype=torch.uint8)) for s in storages]
    tasks = list(_transfer._tasks(spans, True, {0, 2}))
    wanted = {task.span.storage for task in tasks if task.crc}
    assert wanted == {s for number, s in enumerate(storages) if number not in (0, 2)}
    assert {task.span.storage for task in tasks} == set(storages)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_crc_kernel_equals_zlib() -> None:
    """The kernel's CRC-32 of records at every start alignment and of lengths around its chunks."""
    from ckptconv.gpu import crc as _gpu_crc

    kernel = _gpu_crc.kernel(0)
    assert kernel is not None
    generator = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=generator)
    on_gpu = data.to("cuda:0")
    chunk = _gpu_crc.CHUNK
    lengths = [1, 2, 3, 15, 16, 17, 31, 33, 4095, chunk - 1, chunk, chunk + 1, 2 * chunk, 5 * chunk + 13, 1 << 21]
    cases = [(offset, length) for offset in range(0, 40, 3) for length in lengths]
    got = _gpu_crc.record_crcs([on_gpu[o : o + n] for o, n in cases], kernel)
    raw = data.numpy().tobytes()
    assert got == [zlib.crc32(raw[o : o + n]) for o, n in cases]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("on_gpu", [True, False])
def test_gpu_crcs_come_from_the_gpu_or_the_readers(
    tmp_path: Path, on_gpu: bool, small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``gpu_crc`` every record's CRC-32 is taken by one kernel launch after the copies; without,
    by the readers; the same values either way, those the archive records."""
    from ckptconv.gpu import crc as _gpu_crc

    monkeypatch.setattr(_transfer, "gpu_crc", on_gpu)
    launches: list[int] = []
    real = _gpu_crc.record_crcs

    def counted(outs: list[torch.Tensor], kernel: object) -> list[int]:
        launches.append(len(outs))
        return real(outs, kernel)  # type: ignore[arg-type]

    monkeypatch.setattr(_gpu_crc, "record_crcs", counted)
    _, refs, crcs = _gpu_load_taking_crcs(tmp_path)
    records = {r.storage for r in refs.values() if r.storage.nbytes > 0}
    assert launches == ([len(records)] if on_gpu else [])
    assert {s: crcs[s] for s in records} == {s: s.source.crc32 for s in records}  # type: ignore[union-attr]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_load_without_the_kernel_still_refuses_a_flipped_bit(
    tmp_path: Path, small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel cannot be made after the readers left the CRC-32s to it, the records are read
    again and checked (check_record_crcs), so a flipped bit is still refused."""
    from ckptconv.gpu import crc as _gpu_crc

    monkeypatch.setattr(_gpu_crc, "kernel", lambda device: None)
    path = tmp_path / "m.pt"
    torch.save(big_state(), path)
    record = dict(ckptconv.open(path).tensors())["w1"].storage
    data = bytearray(path.read_bytes())
    data[record.source.offset + 5] ^= 0x40  # type: ignore[union-attr]
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(bytes(data))
    with pytest.raises(MalformedCheckpointError, match=r"record .* \(tensor 'w1'\) has CRC-32"):
        ckptconv.load(damaged, device="cuda:0")
    loaded = ckptconv.load(path, device="cuda:0")
    assert_same_state({k: v.cpu() for k, v in loaded.items()}, reference_load(path), ordered=False)
