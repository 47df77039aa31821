"""The CPU cores a conversion keeps busy (ckptconv.runtime.cores)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckptconv.runtime import cores as _cores


def test_usable_cores_follow_the_affinity_and_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    affinity = len(os.sched_getaffinity(0))
    for cap, expected in (
        ("", affinity),
        ("1", 1),
        (str(affinity + 5), affinity),
        ("0", affinity),
        ("x", affinity),
        ("\u00b2", affinity),
    ):
        monkeypatch.setenv(_cores.CORES_VARIABLE, cap)
        assert _cores.usable.__wrapped__() == expected, cap


def test_background_work_takes_a_core_while_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cores, "usable", lambda: 3)
    assert _cores.spare() == 2
    seen: list[int] = []
    inside = threading.Event()
    release = threading.Event()

    def hashing() -> str:
        seen.append(_cores.spare())
        inside.set()
        release.wait(10)
        return "done"

    worker = threading.Thread(target=_cores.in_background(hashing))
    worker.start()
    assert inside.wait(10)
    assert _cores.spare() == 1  # seen from another thread, too
    with _cores.busy():
        assert _cores.spare() == 0
        with _cores.busy():
            assert _cores.spare() == 0  # never negative
    release.set()
    worker.join()
    assert seen == [1] and _cores.spare() == 2


def test_a_failing_background_task_gives_its_core_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cores, "usable", lambda: 2)

    def failing() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError):
        _cores.in_background(failing)()
    assert _cores.spare() == 1


def test_the_source_hash_counts_as_background_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a conversion hashes its source, copies see one core fewer spare."""
    import torch

    import ckptconv
    from ckptconv.writing import provenance as metadata

    monkeypatch.setattr(_cores, "usable", lambda: 4)
    seen: list[int] = []
    hash_file = metadata.file_sha256

    def observed(path: str, stop: threading.Event | None = None) -> str:
        seen.append(_cores.spare())
        return hash_file(path, stop)

    monkeypatch.setattr(metadata, "file_sha256", observed)
    source = tmp_path / "in.pt"
    torch.save({"w": torch.randn(10)}, source)
    ckptconv.convert(source, tmp_path / "out.safetensors", check_crc=False)  # the hash alone in the background
    assert seen == [2]


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096, 50_001])
def test_file_sha256_is_hashlibs_read_ahead_or_not(
    cores: int, size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hashlib

    from ckptconv.writing import provenance as metadata

    monkeypatch.setattr(metadata, "_HASH_CHUNK", 4096)
    monkeypatch.setattr(_cores, "usable", lambda: cores)
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(size))
    assert metadata.file_sha256(str(path)) == hashlib.sha256(path.read_bytes()).hexdigest()
    stopped = threading.Event()
    stopped.set()
    assert metadata.file_sha256(str(path), stop=stopped) == ""


def test_a_read_error_while_reading_ahead_reaches_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from ckptconv.writing import provenance as metadata

    monkeypatch.setattr(_cores, "usable", lambda: 2)
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 100)

    def failing_read(fd: int, buffers: list[memoryview], offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(metadata.os, "preadv", failing_read)
    with pytest.raises(OSError, match="Input/output error"):
        metadata.file_sha256(str(path))
    assert [t.name for t in threading.enumerate() if t.name == "ckptconv-hash-read"] == []


def test_joining_a_thread_outlasts_an_interruption_then_raises_it() -> None:
    """A copying thread is waited for to its end even when Ctrl-C interrupts the wait."""
    release = threading.Event()
    finished: list[bool] = []

    def work() -> None:
        release.wait(10)
        time.sleep(0.2)  # still running when the first wait is interrupted
        finished.append(True)

    thread = threading.Thread(target=work)
    thread.start()
    joins = 0

    class Interrupted(threading.Thread):
        def join(self, timeout: float | None = None) -> None:
            nonlocal joins
            joins += 1
            if joins == 1:
                release.set()
                raise KeyboardInterrupt
            thread.join(timeout)

        def is_alive(self) -> bool:
            return thread.is_alive()

    with pytest.raises(KeyboardInterrupt):
        _cores.join_uninterrupted(Interrupted())
    assert finished == [True] and joins == 2 and not thread.is_alive()


def test_switching_often_gives_the_interval_back_after_a_failure_too() -> None:
    before = sys.getswitchinterval()
    with pytest.raises(KeyError), _cores.switching_often():
        assert abs(sys.getswitchinterval() - _cores.SWITCH_INTERVAL_S) < 1e-9
        raise KeyError("x")
    assert sys.getswitchinterval() == before


def test_batch_workers_switch_the_gil_often() -> None:
    """A batch worker is a process of ckptconv's own: its cast threads get the same short switch
    interval as the command line's (the job here reports the interval it ran under)."""
    from ckptconv.batching.frames import read_frame, write_frame

    code = (
        "import sys, ckptconv.batching.executors as executors, ckptconv.batching.worker as worker\n"
        "executors.run_job = lambda job: sys.getswitchinterval()\n"
        "worker.main()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdin is not None and child.stdout is not None
    try:
        write_frame(child.stdin, sys.path)
        assert read_frame(child.stdout)[0] == "ready"
        write_frame(child.stdin, (7, pickle.dumps("a job")))
        sequence, interval, error = read_frame(child.stdout)
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert (sequence, error) == (7, None)
    assert abs(interval - _cores.SWITCH_INTERVAL_S) < 1e-9
