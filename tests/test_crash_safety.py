"""Paths and crash safety: outputs never land on inputs, and a killed or failed write leaves no torn file."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

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


# A conversion slowed to one tensor per 20 ms, so the test can kill it mid-write.
_SLOW_CONVERT = """
import sys, time
import ckptconv.writing as writing
write_tensor, write_storage = writing._write_tensor, writing._write_planned_storage
def slow_tensor(*args, **kwargs):
    time.sleep(0.02)
    yield from write_tensor(*args, **kwargs)
def slow_storage(*args, **kwargs):
    time.sleep(0.02)
    return write_storage(*args, **kwargs)
writing._write_tensor, writing._write_planned_storage = slow_tensor, slow_storage
from ckptconv.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("previous", [False, True], ids=["no previous output", "previous output"])
def test_sigkill_during_a_write_never_leaves_a_torn_output(suffix: str, previous: bool, tmp_path: Path) -> None:
    source = tmp_path / "many.pt"
    torch.save({f"t{i}": torch.full((4096,), float(i)) for i in range(300)}, source)
    output = tmp_path / f"out{suffix}"
    if previous:
        output.write_bytes(b"the previous complete output")
    process = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CONVERT, "convert", str(source), str(output), "--overwrite", "-q"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    deadline = time.monotonic() + 60
    partial: list[Path] = []
    while time.monotonic() < deadline and process.poll() is None:
        partial = [p for p in tmp_path.glob(f".{output.name}.*.partial") if p.stat().st_size > 100_000]
        if partial:
            break
        time.sleep(0.01)
    assert partial and process.poll() is None, "the write finished before it could be interrupted"
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    if previous:
        assert output.read_bytes() == b"the previous complete output"
    else:
        assert not output.exists()
    # The killed process's temporary file stays (see SECURITY.md); it never has the output's name,
    # and the next conversion is not disturbed by it.
    assert [p.name for p in tmp_path.glob(f".{output.name}.*.partial")] == [partial[0].name]
    assert _run("convert", str(source), str(output), "--overwrite", "-q") == (0, "")
    assert len(list(tmp_path.glob(f".{output.name}.*.partial"))) == 1


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
