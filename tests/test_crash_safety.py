"""Paths and crash safety: outputs never land on inputs, and a killed or failed write leaves no torn file."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(*args: str) -> tuple[int, str]:
    code, _, stderr = run_cli(*args)
    return code, stderr


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "in.pt"
    torch.save({"module.w": torch.randn(8), "module.b": torch.zeros(2)}, path)
    return path


def test_output_that_is_a_folder(source: Path, tmp_path: Path) -> None:
    """An existing folder is never replaced by a file: it receives the sharded layout instead."""
    folder = tmp_path / "out.pt"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    code, stderr = _run("convert", str(source), str(folder), "--overwrite")
    assert code == 0, stderr
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors", "notes.txt"]
    assert (folder / "notes.txt").read_text() == "mine"
    assert _run("convert", str(source), str(tmp_path / "file.pt"))[0] == 0
    code, stderr = _run("convert", str(source), str(tmp_path / "file.pt"), "--max-shard-size", "1GB", "--overwrite")
    assert code == 1 and stderr.endswith("is a file; give a folder for a sharded or DCP output\n")


def _special(kind: str, path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        import socket

        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(path))
    else:  # a character device like /dev/null (major 1, minor 3); needs root, as replacing /dev/null does
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("creating a device node needs root")


@pytest.mark.parametrize("kind", ["fifo", "socket", "character device"])
@pytest.mark.parametrize("command", ["convert", "strip-module"])
def test_overwrite_never_replaces_a_device_fifo_or_socket(
    kind: str, command: str, source: Path, tmp_path: Path
) -> None:
    """`ckptconv convert in.pt /dev/null --to pt --overwrite`, run as root, replaced /dev/null with a regular file."""
    target = tmp_path / "out.pt"
    _special(kind, target)
    before = os.lstat(target)
    code, stderr = _run(command, str(source), str(target), "--to", "pt", "--overwrite", "-q")
    assert code == 1 and stderr.count("\n") == 1, stderr
    assert f"{str(target)!r} is a {kind}, not a file; ckptconv replaces only files" in stderr, stderr
    after = os.lstat(target)
    assert (after.st_ino, stat.S_IFMT(after.st_mode)) == (before.st_ino, stat.S_IFMT(before.st_mode))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt", "out.pt"]


@pytest.mark.parametrize("output", ["out.pt", "out.safetensors"])
def test_an_input_named_like_a_left_over_partial_file_is_never_removed(output: str, tmp_path: Path) -> None:
    """Before writing OUT, ckptconv removes `.OUT.<8 characters>.partial` files a killed run left; an
    input of that name (a file rescued from such a run) was deleted, and the conversion then failed."""
    source = tmp_path / f".{output}.abcdefgh.partial"
    torch.save({"w": torch.arange(4.0)}, source)
    before = _sha(source)
    code, stderr = _run("convert", str(source), str(tmp_path / output), "-q")
    assert code == 0, stderr
    assert _sha(source) == before
    written = tmp_path / output
    loaded = torch.load(written, weights_only=True) if output.endswith(".pt") else load_file(written)
    assert torch.equal(loaded["w"], torch.arange(4.0))


@pytest.mark.parametrize("link", ["symlink", "hardlink", "same path spelled differently"])
def test_output_that_is_the_input_under_another_name(link: str, source: Path, tmp_path: Path) -> None:
    before = _sha(source)
    other = tmp_path / "alias.pt"
    if link == "symlink":
        other.symlink_to(source)
    elif link == "hardlink":
        os.link(source, other)
    else:
        other = tmp_path / "sub" / ".." / "in.pt"
        (tmp_path / "sub").mkdir()
    code, stderr = _run("convert", str(source), str(other), "--overwrite")
    assert code == 1 and "onto its own input" in stderr, stderr
    assert _sha(source) == before
    assert not list(tmp_path.glob(".*.partial"))


def test_a_symlinked_input_is_read_and_never_modified(source: Path, tmp_path: Path) -> None:
    link = tmp_path / "link.pt"
    link.symlink_to(source)
    before = _sha(source)
    assert _run("strip-module", str(link), str(tmp_path / "out.safetensors"), "-q") == (0, "")
    assert _sha(source) == before and link.is_symlink()
    assert os.readlink(link) == str(source)


def test_output_symlink_is_replaced_not_followed(source: Path, tmp_path: Path) -> None:
    """--overwrite replaces a symlink at the destination; the file it pointed to is untouched."""
    target = tmp_path / "elsewhere.pt"
    target.write_bytes(b"precious")
    link = tmp_path / "out.pt"
    link.symlink_to(target)
    assert _run("convert", str(source), str(link), "--overwrite", "-q") == (0, "")
    assert target.read_bytes() == b"precious" and not link.is_symlink()


# A conversion slowed to one tensor per 20 ms, so the test can kill it mid-write. It touches
# STARTED once a few tensors are written; CKPTCONV_TEST_NO_TMPFILE=1 makes it use named
# temporary files, as on file systems without O_TMPFILE.
_SLOW_CONVERT = """
import os, sys, time
import ckptconv.writing.atomic as atomic, ckptconv.writing.copying as copying
if os.environ.get("CKPTCONV_TEST_NO_TMPFILE"):
    atomic._USE_TMPFILE = False
write_tensor, write_storage = copying.stream_tensor, copying.write_planned_storage
calls = []
def started():
    calls.append(1)
    if len(calls) == 20:
        open(os.environ["STARTED"], "w").close()
def slow_tensor(*args, **kwargs):
    time.sleep(0.02)
    started()
    yield from write_tensor(*args, **kwargs)
def slow_storage(*args, **kwargs):
    time.sleep(0.02)
    started()
    return write_storage(*args, **kwargs)
copying.stream_tensor, copying.write_planned_storage = slow_tensor, slow_storage
import ckptconv.gpu.torch_tensors as torch_bridge
to_torch = torch_bridge.to_torch
def slow_to_torch(*args, **kwargs):  # DCP outputs are written by torch.save, one tensor at a time
    time.sleep(0.02)
    started()
    return to_torch(*args, **kwargs)
torch_bridge.to_torch = slow_to_torch
from ckptconv.cli import main
main(sys.argv[1:])
"""


def _start_slow(tmp_path: Path, *args: str, tmpfile: bool = True) -> tuple[subprocess.Popen[str], Path]:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    marker = work / "started"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "STARTED": str(marker)}
    if not tmpfile:
        env["CKPTCONV_TEST_NO_TMPFILE"] = "1"
    process = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CONVERT, *args],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None and not marker.exists():
        time.sleep(0.01)
    assert marker.exists() and process.poll() is None, "the write finished before it could be interrupted"
    return process, marker


@pytest.mark.parametrize("tmpfile", [True, False], ids=["O_TMPFILE", "named temporary"])
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("previous", [False, True], ids=["no previous output", "previous output"])
def test_sigkill_during_a_write_never_leaves_a_torn_output(
    suffix: str, previous: bool, tmpfile: bool, tmp_path: Path
) -> None:
    source = tmp_path / "many.pt"
    torch.save({f"t{i}": torch.full((4096,), float(i)) for i in range(300)}, source)
    output = tmp_path / f"out{suffix}"
    if previous:
        output.write_bytes(b"the previous complete output")
    process, _ = _start_slow(tmp_path, "convert", str(source), str(output), "--overwrite", "-q", tmpfile=tmpfile)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    if previous:
        assert output.read_bytes() == b"the previous complete output"
    else:
        assert not output.exists()
    partial = list(tmp_path.glob(f".{output.name}.*.partial"))
    if tmpfile:
        assert partial == []  # the unfinished file never had a name
    else:
        assert len(partial) == 1 and partial[0].stat().st_size > 10_000
    # The next write of the same output removes what a writer that is provably gone (its lock is
    # free) left behind.
    assert _run("convert", str(source), str(output), "--overwrite", "-q") == (0, "")
    assert list(tmp_path.glob(f".{output.name}.*.partial")) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["many.pt", output.name, "work"])


def test_a_live_writers_temporary_file_is_never_removed(tmp_path: Path) -> None:
    from ckptconv.writing.atomic import atomic_output, remove_abandoned

    output = tmp_path / "out.pt"
    from ckptconv.writing import atomic as writing

    saved = writing._USE_TMPFILE
    writing._USE_TMPFILE = False
    try:
        with atomic_output(output) as file:
            file.write(b"x" * 1000)
            (partial,) = tmp_path.glob(".out.pt.*.partial")
            # Another process (or this one) cleaning up must leave a file whose writer holds its lock.
            code = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import sys; from ckptconv.writing.atomic import remove_abandoned as r; "
                    "sys.exit(len(r(sys.argv[1], 'out.pt')))",
                    str(tmp_path),
                ],
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                timeout=60,
                check=False,
            ).returncode
            assert code == 0 and partial.exists()
    finally:
        writing._USE_TMPFILE = saved
    assert output.read_bytes() == b"x" * 1000 and remove_abandoned(str(tmp_path), "out.pt") == []


@pytest.mark.parametrize("tmpfile", [True, False], ids=["O_TMPFILE", "named temporary"])
@pytest.mark.parametrize("layout", ["file", "shards", "dcp"])
def test_sigterm_is_handled_like_ctrl_c(layout: str, tmpfile: bool, tmp_path: Path) -> None:
    source = tmp_path / "many.pt"
    torch.save({f"t{i}": torch.full((4096,), float(i)) for i in range(300)}, source)
    output = tmp_path / ("out.safetensors" if layout == "file" else "out")
    extra = {"file": [], "shards": ["--max-shard-size", "100KB"], "dcp": ["--to", "dcp"]}[layout]
    process, _ = _start_slow(tmp_path, "convert", str(source), str(output), *extra, tmpfile=tmpfile)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    assert stderr == "ckptconv: interrupted (SIGTERM); no output was written\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many.pt", "work"]


_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
from ckptconv.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_full_disk_gives_one_line_and_no_file(suffix: str, tmp_path: Path) -> None:
    source = tmp_path / "big.pt"
    torch.save({"w": torch.randn(1 << 20)}, source)  # 4 MiB: over the 1 MiB file size limit
    before = _sha(source)
    output = tmp_path / f"out{suffix}"
    result = subprocess.run(
        [sys.executable, "-c", _LIMITED, "convert", str(source), str(output)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr == (
        f"ckptconv: error: cannot write {str(output)!r}: the file would exceed the allowed size; nothing was written\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.pt"]
    assert _sha(source) == before


def test_sigterm_stops_a_batch_like_ctrl_c(tmp_path: Path) -> None:
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    for index in range(3):
        torch.save({f"t{i}": torch.full((4096,), float(i)) for i in range(300)}, zoo / f"m{index}.pt")
    out = tmp_path / "out"
    process, _ = _start_slow(tmp_path, "batch", str(zoo), str(out), "-q")
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    assert stderr == (
        f"ckptconv: interrupted (SIGTERM); finished items are recorded in the manifest under {str(out)!r}; "
        "run again with --resume to carry on\n"
    )
    assert [p.name for p in out.iterdir() if p.name.endswith(".partial")] == []
    assert _run("batch", str(zoo), str(out), "--resume", "-q") == (0, "")
    assert sorted(p.name for p in out.iterdir()) == [
        "ckptconv-manifest.jsonl",
        "m0.safetensors",
        "m1.safetensors",
        "m2.safetensors",
    ]


@pytest.mark.parametrize("interrupt", ["SIGTERM", "Ctrl-C"])
@pytest.mark.parametrize("consequence", ["EBADF", "import"])
def test_an_error_raised_while_an_interruption_unwinds_reports_the_interruption(
    interrupt: str, consequence: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's read of a file the unwinding closed fails with EBADF; an import Ctrl-C cut short fails
    again when the unwinding imports the module ("cannot load module more than once per process", which
    was a traceback). Either is the interruption, not a failure."""
    from ckptconv.cli.failures import Terminated
    from ckptconv.errors import WriteError
    from ckptconv.writing import copying as writing

    signalled = Terminated() if interrupt == "SIGTERM" else KeyboardInterrupt()
    error = (
        WriteError("cannot write 'out.safetensors': Bad file descriptor")
        if consequence == "EBADF"
        else ImportError("cannot load module more than once per process")
    )

    def interrupted_write(*args: object, **kwargs: object) -> Iterator[int]:
        try:
            raise signalled
        except KeyboardInterrupt:
            raise error from None
        yield 0

    monkeypatch.setattr(writing, "stream_tensor", interrupted_write)
    source = tmp_path / "many.pt"
    torch.save({"w": torch.ones(4)}, source)
    output = tmp_path / "out.safetensors"
    code, _stdout, stderr = run_cli("convert", str(source), str(output))
    name = " (SIGTERM)" if interrupt == "SIGTERM" else ""
    assert (code, stderr) == (
        143 if interrupt == "SIGTERM" else 130,
        f"ckptconv: interrupted{name}; no output was written\n",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many.pt"]


@pytest.mark.parametrize("interrupt", ["SIGTERM", "Ctrl-C"])
def test_an_item_error_raised_while_an_interruption_unwinds_stops_the_batch_as_the_interruption(
    interrupt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a batch, the EBADF an unwinding interruption causes is not recorded as the item's failure (exit 3):
    the batch stops as interrupted (found by a SIGTERM test that failed once in a clean-clone CI run)."""
    from ckptconv.cli.failures import Terminated
    from ckptconv.errors import WriteError
    from ckptconv.writing import copying as writing

    signalled = Terminated() if interrupt == "SIGTERM" else KeyboardInterrupt()

    def interrupted_write(*args: object, **kwargs: object) -> Iterator[int]:
        try:
            raise signalled
        except KeyboardInterrupt:
            raise WriteError("cannot write 'm0.safetensors': Bad file descriptor") from None
        yield 0

    monkeypatch.setattr(writing, "stream_tensor", interrupted_write)
    zoo, out = tmp_path / "zoo", tmp_path / "out"
    zoo.mkdir()
    torch.save({"w": torch.ones(4)}, zoo / "m0.pt")
    code, _stdout, stderr = run_cli("batch", str(zoo), str(out), "-q")
    name = " (SIGTERM)" if interrupt == "SIGTERM" else ""
    assert (code, stderr) == (
        143 if interrupt == "SIGTERM" else 130,
        f"ckptconv: interrupted{name}; finished items are recorded in the manifest under {str(out)!r}; "
        "run again with --resume to carry on\n",
    )


def test_an_interruption_a_finalizer_swallowed_is_delivered_again() -> None:
    """A KeyboardInterrupt raised inside a __del__ or a weakref callback cannot leave it: Python printed
    it and went on, and the command finished as if never interrupted."""
    import sys

    from ckptconv.cli.failures import on_unraisable

    class Interrupted:
        def __del__(self) -> None:
            raise KeyboardInterrupt

    python_hook, sys.unraisablehook = sys.unraisablehook, on_unraisable
    try:
        with pytest.raises(KeyboardInterrupt):
            Interrupted()  # collected at once: its __del__ raises into the hook
            for _ in range(200):  # the signal comes again from a thread, a millisecond later
                time.sleep(0.01)
    finally:
        sys.unraisablehook = python_hook


def test_an_interruption_sent_again_never_lands_inside_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook starts the thread that sends the signal again; on a busy machine the main thread was
    still inside that Thread.start() when the signal came, so the KeyboardInterrupt was raised inside
    the hook and swallowed once more (a flaky "DID NOT RAISE"). Here Thread.start() is made slow."""
    import sys
    import threading

    from ckptconv.cli.failures import on_unraisable

    start = threading.Thread.start

    def slow_start(self: threading.Thread) -> None:
        start(self)
        for _ in range(50):  # the main thread held up in the hook for 50 ms, as a loaded machine does
            time.sleep(0.001)

    monkeypatch.setattr(threading.Thread, "start", slow_start)

    class Interrupted:
        def __del__(self) -> None:
            raise KeyboardInterrupt

    python_hook, sys.unraisablehook = sys.unraisablehook, on_unraisable
    try:
        with pytest.raises(KeyboardInterrupt):
            Interrupted()
            for _ in range(200):
                time.sleep(0.01)
    finally:
        sys.unraisablehook = python_hook


def test_signals_are_held_back_while_cpp_calls_into_python() -> None:
    """torch.save to a file object calls back into Python: Ctrl-C raised there aborted the process
    (SIGABRT). Inside signals_deferred the signal waits, and reaches its handler when the block ends."""
    import signal
    import threading

    from ckptconv.runtime.signals import signals_deferred

    reached = []
    with pytest.raises(KeyboardInterrupt), signals_deferred():
        signal.raise_signal(signal.SIGINT)
        for _ in range(10_000):
            pass
        reached.append("the end of the block")
    assert reached == ["the end of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def elsewhere() -> None:  # no handler can be changed outside the main thread: the block just runs
        with signals_deferred():
            reached.append("a thread")

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert reached[-1] == "a thread"


def test_a_failure_after_an_interruption_a_c_extension_swallowed_reports_the_interruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C inside numpy's extension initialisation: the KeyboardInterrupt is swallowed there, and the
    next import fails with an ImportError that has no trace of it. The handler remembers the signal."""
    from ckptconv.cli import failures
    from ckptconv.writing import copying as writing

    monkeypatch.setattr(failures, "_RECEIVED", [])

    def interrupted_write(*args: object, **kwargs: object) -> Iterator[int]:
        with contextlib.suppress(KeyboardInterrupt):  # as the extension's initialisation does
            failures.on_sigint(signal.SIGINT, None)
        raise ImportError("cannot load module more than once per process")
        yield 0

    monkeypatch.setattr(writing, "stream_tensor", interrupted_write)
    source = tmp_path / "m.pt"
    torch.save({"w": torch.ones(4)}, source)
    code, _stdout, stderr = run_cli("convert", str(source), str(tmp_path / "out.safetensors"))
    assert (code, stderr) == (130, "ckptconv: interrupted; no output was written\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]
