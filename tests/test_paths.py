"""Files, links, names and a hostile file system (issue 13): never read or write where ckptconv should not,
never hang, never litter.

Each test reproduces one way the readers and writers went wrong before ``ckptconv/read_policy.py`` and
``ckptconv/write_policy.py`` decided what may be read and written. Commands that could hang run in a
subprocess with a timeout, so a regression fails instead of stalling the suite.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptconv

from .conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str, timeout: float = 60, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``ckptconv ARGS`` in a fresh process; a hang fails the test instead of stalling it."""
    return subprocess.run(
        [sys.executable, "-m", "ckptconv", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=cwd,
        check=False,
    )


def _tree(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` (links not followed) with a digest of its content, or its link target."""
    result = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.is_symlink():
            result[name] = "-> " + os.readlink(path)
        elif path.is_file():
            result[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.is_dir():
            result[name] = "dir"
        else:
            result[name] = "special"
    return result


def _sharded(folder: Path) -> Path:
    """A two-shard safetensors checkpoint: 'a' in the first shard, 'b' in the second."""
    ckptconv.save({"a": torch.arange(64.0), "b": torch.ones(64)}, folder, max_shard_size=300)
    assert sorted(p.name for p in folder.iterdir()) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    return folder


# ---------------------------------------------------------------------------------------
# Writes where they must not go
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["hf", "hf/", "./hf", "./hf/", "link", "link/", "../{}/hf/"])
def test_convert_onto_its_own_folder_is_refused_whatever_the_spelling(spelling: str, tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "hf")
    (tmp_path / "link").symlink_to("hf")
    before = _tree(tmp_path)
    destination = spelling.format(tmp_path.name)
    result = _cli("convert", "hf/", destination, "--overwrite", "--drop", "^b$", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("ckptconv: error: refusing to write ") and "onto its own input" in result.stderr
    assert result.stderr.count("\n") == 1
    assert _tree(tmp_path) == before
    assert load_file(folder / "model-00002-of-00002.safetensors")["b"].equal(torch.ones(64))


@pytest.mark.parametrize("source", ["hf/", "hf/model.safetensors.index.json", "link/"])
def test_no_file_the_input_reads_is_ever_replaced(source: str, tmp_path: Path) -> None:
    _sharded(tmp_path / "hf")
    (tmp_path / "link").symlink_to("hf")
    (tmp_path / "shard-link.safetensors").symlink_to("hf/model-00002-of-00002.safetensors")
    os.link(tmp_path / "hf/model-00001-of-00002.safetensors", tmp_path / "hard.safetensors")
    before = _tree(tmp_path)
    for target in ("hf/model-00002-of-00002.safetensors", "shard-link.safetensors", "hard.safetensors"):
        code, _, stderr = run_cli("convert", str(tmp_path / source), str(tmp_path / target), "--overwrite")
        assert code == 1 and "onto its own input" in stderr, (target, stderr)
    assert _tree(tmp_path) == before


def test_a_dropped_shard_is_still_an_input(tmp_path: Path) -> None:
    _sharded(tmp_path / "hf")
    checkpoint = ckptconv.open(tmp_path / "hf")
    assert sorted(os.path.basename(f) for f in checkpoint.files) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    with pytest.raises(ckptconv.WriteError, match="onto its own input"):
        ckptconv.convert(tmp_path / "hf", tmp_path / "hf", transforms=[ckptconv.Drop("^b$")], overwrite=True)


# ---------------------------------------------------------------------------------------
# Reads where they must not go
# ---------------------------------------------------------------------------------------


def test_dcp_metadata_linked_outside_the_folder_is_refused(tmp_path: Path) -> None:
    import shutil

    from .test_sharded import GPU

    folder = tmp_path / "dcp"
    shutil.copytree(GPU / "fsdp2_dcp", folder)
    (folder / ".metadata").rename(tmp_path / "elsewhere")
    (folder / ".metadata").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ckptconv.MalformedCheckpointError, match="leads outside the checkpoint folder"):
        ckptconv.open(folder)
    code, _, stderr = run_cli("inspect", str(folder))
    assert code == 1 and stderr.count("\n") == 1 and "outside the checkpoint folder" in stderr


@pytest.mark.parametrize("member", ["index", "shard"])
def test_sharded_files_linked_outside_the_folder_are_refused(member: str, tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "hf")
    name = "model.safetensors.index.json" if member == "index" else "model-00001-of-00002.safetensors"
    (folder / name).rename(tmp_path / name)
    (folder / name).symlink_to(tmp_path / name)
    with pytest.raises(ckptconv.MalformedCheckpointError, match="leads outside the checkpoint folder"):
        ckptconv.open(folder)


def test_links_inside_the_folder_are_followed(tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "hf")
    (folder / "model-00001-of-00002.safetensors").rename(folder / "blob1")
    (folder / "model-00001-of-00002.safetensors").symlink_to("blob1")
    weights = ckptconv.load(folder)
    assert weights["a"].equal(torch.arange(64.0)) and weights["b"].equal(torch.ones(64))


# ---------------------------------------------------------------------------------------
# Hangs and unbounded memory
# ---------------------------------------------------------------------------------------


def test_convert_a_fifo_index_does_not_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "x.safetensors.index.json"
    os.mkfifo(fifo)
    result = _cli("convert", str(fifo), str(tmp_path / "o.safetensors"))
    assert result.returncode == 1
    assert result.stderr == (
        f"ckptconv: error: {str(fifo)!r} is a FIFO (named pipe), not a regular file; "
        "ckptconv reads only regular files\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors.index.json"]


@pytest.mark.parametrize("name", ["model.safetensors.index.json", ".metadata", "model.pt"])
def test_inspect_a_folder_with_a_fifo_does_not_hang(name: str, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    os.mkfifo(folder / name)
    result = _cli("inspect", str(folder))
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "FIFO (named pipe), not a regular file" in result.stderr or "no checkpoint files" in result.stderr


def test_a_fifo_shard_does_not_hang(tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "hf")
    (folder / "model-00002-of-00002.safetensors").unlink()
    os.mkfifo(folder / "model-00002-of-00002.safetensors")
    result = _cli("convert", str(folder), str(tmp_path / "o.safetensors"))
    assert result.returncode == 1 and "FIFO (named pipe), not a regular file" in result.stderr


def test_fit_like_a_fifo_does_not_hang(tmp_path: Path) -> None:
    source = tmp_path / "a.pt"
    torch.save({"w": torch.ones(2)}, source)
    fifo = tmp_path / "reference"
    os.mkfifo(fifo)
    result = _cli("fit", str(source), str(tmp_path / "o.pt"), "--like", str(fifo))
    assert result.returncode == 1
    assert result.stderr == (
        f"ckptconv: error: {str(fifo)!r} is a FIFO (named pipe), not a regular file; "
        "ckptconv reads only regular files\n"
    )


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom", "/dev/null"])
def test_a_device_linked_as_an_index_is_refused(device: str, tmp_path: Path) -> None:
    index = tmp_path / "x.safetensors.index.json"
    index.symlink_to(device)
    result = _cli("convert", str(index), str(tmp_path / "o.safetensors"), timeout=60)
    assert result.returncode == 1
    assert result.stderr == (
        f"ckptconv: error: {str(index)!r} is a character device, not a regular file; ckptconv reads only regular files\n"
    )


def test_an_index_over_the_size_cap_is_refused_unread(tmp_path: Path) -> None:
    from ckptconv.formats import sharded

    index = tmp_path / "x.safetensors.index.json"
    with open(index, "wb") as file:
        file.truncate(sharded.MAX_INDEX_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(ckptconv.MalformedCheckpointError, match="is larger than 100,000,000 bytes"):
        ckptconv.open(index)


def test_an_index_that_names_itself_is_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model.safetensors.index.json"}})
    )
    code, _, stderr = run_cli("convert", str(folder), str(tmp_path / "o.safetensors"))
    assert code == 1 and stderr.count("\n") == 1
    assert "names the index 'model.safetensors.index.json' as a shard" in stderr
    assert "recursion" not in stderr


def test_two_indexes_naming_each_other_are_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "a.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "b.safetensors.index.json"}}))
    (folder / "b.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "a.safetensors.index.json"}}))
    with pytest.raises(ckptconv.MalformedCheckpointError, match="as a shard"):
        ckptconv.open(folder / "a.safetensors.index.json")


# ---------------------------------------------------------------------------------------
# Smaller
# ---------------------------------------------------------------------------------------


def test_verify_into_an_existing_folder_checks_the_files_it_wrote(tmp_path: Path) -> None:
    source = tmp_path / "in.pt"
    torch.save({"w": torch.arange(10.0), "v": torch.ones(10), "u": torch.zeros(10)}, source)
    out = tmp_path / "out"
    out.mkdir()
    torch.save({"other": torch.zeros(3)}, out / "someone_elses.pt")  # another checkpoint already there
    code, _, stderr = run_cli("convert", str(source), f"{out}/", "--verify")
    assert (code, stderr.splitlines()[-1]) == (0, f"wrote {out} (safetensors, 3 tensors, 120 B, verified bit for bit)")
    assert load_file(out / "model.safetensors")["w"].equal(torch.arange(10.0))
    code, _, stderr = run_cli("convert", str(source), f"{out}/", "--verify", "--max-shard-size", "16B", "--overwrite")
    assert code == 0, stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
        "someone_elses.pt",
    ]
