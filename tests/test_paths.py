"""Files, links, names and a hostile file system (issue 13): never read or write where ckptconv should not,
never hang, never litter.

Each test reproduces one way the readers and writers went wrong before ``ckptconv/read_policy.py`` and
``ckptconv/write_policy.py`` decided what may be read and written. Commands that could hang run in a
subprocess with a timeout, so a regression fails instead of stalling the suite.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
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
        f"ckptconv: error: {str(index)!r} is a character device, not a regular file; "
        "ckptconv reads only regular files\n"
    )


def test_an_index_over_the_size_cap_is_refused_unread(tmp_path: Path) -> None:
    from ckptconv.reading.formats import sharded

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


# ---------------------------------------------------------------------------------------
# Batch: writes and reads where they must not go
# ---------------------------------------------------------------------------------------


def _zoo(root: Path) -> Path:
    (root / "a").mkdir(parents=True)
    torch.save({"w": torch.arange(4.0)}, root / "a" / "x.pt")
    torch.save({"v": torch.ones(3)}, root / "y.pt")
    return root


def test_batch_refuses_a_manifest_that_is_a_link(tmp_path: Path) -> None:
    zoo = _zoo(tmp_path / "zoo")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "ckptconv-manifest.jsonl").symlink_to(victim)
    for extra in ([], ["--resume"]):
        code, _, stderr = run_cli("batch", str(zoo), str(out), "-q", *extra)
        assert code == 1, stderr
        assert stderr == (
            f"ckptconv: error: refusing to write {str(out / 'ckptconv-manifest.jsonl')!r}: it is a link, and "
            "ckptconv never writes through links it did not create; remove it\n"
        )
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in out.iterdir()) == ["ckptconv-manifest.jsonl"]


def test_batch_refuses_a_manifest_that_is_a_fifo(tmp_path: Path) -> None:
    zoo = _zoo(tmp_path / "zoo")
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "ckptconv-manifest.jsonl")
    for extra in ([], ["--resume"]):
        result = _cli("batch", str(zoo), str(out), "-q", *extra)
        assert result.returncode == 1 and "not a regular file" in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1


def test_a_failed_batch_start_leaves_no_output_folder(tmp_path: Path) -> None:
    zoo = _zoo(tmp_path / "zoo")
    out = tmp_path / "new" / "out"
    (tmp_path / "new").mkdir()
    (tmp_path / "elsewhere").mkdir()
    from ckptconv.batching import manifest

    # The manifest cannot be opened (here: a link planted after the folder was made).
    original = manifest.Manifest.__enter__

    def planted(self: manifest.Manifest) -> manifest.Manifest:
        os.symlink(tmp_path / "elsewhere" / "m", self.path)
        return original(self)

    manifest.Manifest.__enter__ = planted  # type: ignore[method-assign]
    try:
        with pytest.raises(ckptconv.WriteError, match="it is a link"):
            ckptconv.batch(zoo, out)
    finally:
        manifest.Manifest.__enter__ = original  # type: ignore[method-assign]
    assert (out / "ckptconv-manifest.jsonl").is_symlink()  # the planted link stays; nothing was written


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_batch_never_writes_through_a_linked_output_subfolder(jobs: str, tmp_path: Path) -> None:
    zoo = _zoo(tmp_path / "zoo")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "a").symlink_to(elsewhere)
    code, _, stderr = run_cli("batch", str(zoo), str(out), "-j", jobs)
    assert code == 3, stderr
    assert f"failed: a/x.pt: refusing to write into {str(out / 'a')!r}: it is a link" in stderr
    assert list(elsewhere.iterdir()) == []
    assert load_file(out / "y.safetensors")["v"].equal(torch.ones(3))


def test_batch_into_its_source_spelled_through_a_link_is_refused(tmp_path: Path) -> None:
    zoo = _zoo(tmp_path / "zoo")
    (tmp_path / "srclink").symlink_to("zoo")
    before = _tree(zoo)
    for src, dst in ((tmp_path / "srclink", zoo), (zoo, tmp_path / "srclink"), (tmp_path / "srclink", f"{zoo}/./")):
        code, _, stderr = run_cli("batch", str(src), str(dst), "-q")
        assert code == 1 and "is the source folder; choose another one" in stderr, stderr
    assert _tree(zoo) == before


def test_batch_output_inside_the_source_spelled_through_a_link_is_never_an_input(tmp_path: Path) -> None:
    zoo = _zoo(tmp_path / "zoo")
    (tmp_path / "srclink").symlink_to("zoo")
    for _ in range(2):
        report = ckptconv.batch(tmp_path / "srclink", zoo / "out", overwrite=True)
        assert sorted(r.source for r in report.results) == ["a/x.pt", "y.pt"]
        assert report.exit_code == 0
    assert not (zoo / "out" / "out").exists()


def test_zoo_links_leaving_the_source_are_skipped_with_a_note(tmp_path: Path) -> None:
    zoo = _zoo(tmp_path / "zoo")
    private = tmp_path / "private.pt"
    torch.save({"secret": torch.ones(1)}, private)
    (zoo / "x.pt").symlink_to(private)
    (zoo / "inside.pt").symlink_to("y.pt")  # a link that stays inside is followed
    (tmp_path / "private_dir").mkdir()
    torch.save({"secret": torch.ones(1)}, tmp_path / "private_dir" / "m.pt")
    (zoo / "dirlink").symlink_to(tmp_path / "private_dir")  # links to folders are never followed
    out = tmp_path / "out"
    code, _, stderr = run_cli("batch", str(zoo), str(out))
    assert code == 0, stderr
    assert f"note: skipped 'x.pt': a link that leads outside the source folder (to {str(private)!r}); not followed" in (
        stderr.splitlines()
    )
    assert sorted(p.name for p in out.rglob("*.safetensors")) == [
        "inside.safetensors",
        "x.safetensors",
        "y.safetensors",
    ]
    assert [p.relative_to(out).as_posix() for p in out.rglob("x.safetensors")] == ["a/x.safetensors"]
    records = [json.loads(line) for line in (out / "ckptconv-manifest.jsonl").read_text().splitlines()]
    assert any("x.pt" in note for note in records[0]["notes"])


def test_a_shard_in_a_subfolder_is_part_of_its_index_only(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    zoo = tmp_path / "zoo"
    (zoo / "hf" / "shards").mkdir(parents=True)
    save_file({"a": torch.arange(3.0)}, zoo / "hf" / "shards" / "one.safetensors")
    save_file({"b": torch.ones(2)}, zoo / "hf" / "two.safetensors")
    (zoo / "hf" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "shards/one.safetensors", "b": "two.safetensors"}})
    )
    report = ckptconv.batch(zoo, tmp_path / "out")
    assert [(r.source, r.status) for r in report.results] == [("hf/model.safetensors.index.json", "converted")]
    (item,) = ckptconv.reading.discovery.discover(zoo)
    assert item.members == (
        "hf/model.safetensors.index.json",
        "hf/two.safetensors",
        "hf/shards/one.safetensors",
    )
    weights = load_file(tmp_path / "out" / "hf" / "model.safetensors")
    assert weights["a"].equal(torch.arange(3.0)) and weights["b"].equal(torch.ones(2))


@pytest.mark.parametrize(
    "name", ["x.pt", "hf/model.safetensors.index.json", "run/.metadata", "run/__0_0.distcp", "notes.txt"]
)
def test_batch_zoo_with_a_fifo_does_not_hang(name: str, tmp_path: Path) -> None:
    zoo = _zoo(tmp_path / "zoo")
    (zoo / name).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(zoo / name)
    result = _cli("batch", str(zoo), str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    if name != "notes.txt":
        assert f"note: skipped {name!r}: a FIFO (named pipe), not a regular file" in result.stderr.splitlines()
    assert sorted(p.name for p in (tmp_path / "out").rglob("*.safetensors")) == ["x.safetensors", "y.safetensors"]


def test_batch_zoo_with_dev_zero_as_an_index_is_skipped(tmp_path: Path) -> None:
    zoo = _zoo(tmp_path / "zoo")
    (zoo / "x.safetensors.index.json").symlink_to("/dev/zero")
    (zoo / "inside").mkdir()
    (zoo / "inside" / "m.pt").symlink_to("/dev/zero")
    result = _cli("batch", str(zoo), str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert "MemoryError" not in result.stderr and "Traceback" not in result.stderr
    assert "note: skipped 'x.safetensors.index.json': a link that leads outside the source folder" in result.stderr


# ---------------------------------------------------------------------------------------
# Names and terminals
# ---------------------------------------------------------------------------------------

NOT_UTF8 = os.fsdecode(b"caf\xe9")  # 'caf\udce9': a Latin-1 file name on a UTF-8 system


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_convert_a_file_whose_name_is_not_utf8(suffix: str, tmp_path: Path) -> None:
    source = tmp_path / f"{NOT_UTF8}.pt"
    torch.save({"w": torch.arange(5.0)}, source)
    output = tmp_path / f"{NOT_UTF8}-out{suffix}"
    result = _cli("convert", str(source), str(output))  # arguments are passed as the raw bytes
    assert result.returncode == 0, result.stderr
    assert result.stderr == f"wrote {tmp_path}/caf\\xe9-out{suffix} ({suffix[1:]}, 1 tensor, 20 B)\n"
    assert os.fsencode(output.name) == b"caf\xe9-out" + suffix.encode()
    if suffix == ".safetensors":
        import shutil

        from safetensors import safe_open

        shutil.copyfile(output, tmp_path / "copy.safetensors")  # the safetensors library takes UTF-8 paths only
        with safe_open(tmp_path / "copy.safetensors", "pt") as file:
            assert file.metadata()["ckptconv.source"] == "caf\\xe9.pt"  # the bytes, escaped: valid UTF-8
            assert file.get_tensor("w").equal(torch.arange(5.0))
    else:
        assert torch.load(output, weights_only=True)["w"].equal(torch.arange(5.0))


def test_batch_with_names_that_are_not_utf8_or_hold_newlines(tmp_path: Path) -> None:
    zoo = _zoo(tmp_path / "zoo")
    torch.save({"w": torch.ones(2)}, zoo / f"{NOT_UTF8}.pt")
    (zoo / "forged\nfailed: y.pt: fake.pt").write_bytes(b"not a checkpoint at all, but named like one")
    os.rename(zoo / "forged\nfailed: y.pt: fake.pt", zoo / "forged\nfailed: y.pt: fake.pt")
    (zoo / "evil\x1b]0;pwned\x07.pt").write_bytes(b"PK\x03\x04 broken")
    out = tmp_path / "out"
    result = _cli("batch", str(zoo), str(out))
    assert result.returncode == 3, result.stderr
    lines = result.stderr.splitlines()
    assert lines[:2] == [
        "failed: evil\\x1b]0;pwned\\x07.pt: "
        + lines[0].split(": ", 2)[2],  # the error text itself quotes the path with repr()
        "failed: forged\\nfailed: y.pt: fake.pt: " + lines[1].split(".pt: ", 2)[2],
    ]
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr
    assert lines[-1].startswith("converted 3 of 5 items (") and "); 2 failed; manifest: " in lines[-1]
    assert (out / f"{NOT_UTF8}.safetensors").exists()
    records = [json.loads(line) for line in (out / "ckptconv-manifest.jsonl").read_bytes().splitlines()]
    sources = sorted(r["source"] for r in records if r["record"] == "item")
    assert f"{NOT_UTF8}.pt" in sources and "forged\nfailed: y.pt: fake.pt" in sources  # exact, not escaped
    # --resume reads the same names back and skips what is done.
    result = _cli("batch", str(zoo), str(out), "--resume")
    assert result.stderr.splitlines()[-1].startswith("converted 0 of 5 items; 3 skipped, 2 failed")


SURROGATE = "w\ud800"  # a lone surrogate: torch.save and torch.load(weights_only=True) accept it


@pytest.fixture
def surrogates(tmp_path: Path) -> Path:
    path = tmp_path / "s.pt"
    state = {"state_dict": {SURROGATE: torch.ones(2), "ok": torch.zeros(1)}, "note": "x\udce9y", "n\ud801k": 1}
    torch.save(state, path)
    assert list(torch.load(path, weights_only=True)["state_dict"]) == [SURROGATE, "ok"]
    return path


def test_inspect_names_with_lone_surrogates(surrogates: Path) -> None:
    result = _cli("inspect", str(surrogates))
    assert result.returncode == 0, result.stderr
    assert ["w\\ud800", "float32", "[2]"] in [line.split() for line in result.stdout.splitlines()]
    assert ["n\\ud801k", "1"] in [line.split() for line in result.stdout.splitlines()]
    result = _cli("inspect", str(surrogates), "--json")
    info = json.loads(result.stdout)
    assert [t["key"] for t in info["tensors"]] == [SURROGATE, "ok"]  # exact
    assert {"key": "n\ud801k", "value": "1"} in info["outline"]


def test_safetensors_output_refuses_names_it_cannot_store_and_keeps_metadata_exact(
    surrogates: Path, tmp_path: Path
) -> None:
    code, _, stderr = run_cli("convert", str(surrogates), str(tmp_path / "o.safetensors"))
    assert (code, stderr) == (
        1,
        "ckptconv: error: tensor 'w\\ud800' has a name that is not valid Unicode (a lone surrogate), and "
        "safetensors stores names as UTF-8; rename it (--rename) or write a .pt file (--to pt)\n",
    )
    assert not (tmp_path / "o.safetensors").exists()
    code, _, stderr = run_cli("convert", str(surrogates), str(tmp_path / "o.safetensors"), "--rename", "^w.$=w")
    assert code == 0, stderr
    from safetensors import safe_open

    with safe_open(tmp_path / "o.safetensors", "pt") as file:
        metadata = file.metadata()
        assert json.loads(metadata["checkpoint.note"]) == "x\udce9y"  # JSON escapes keep it exact
        assert file.get_tensor("w").equal(torch.ones(2))


def test_pt_output_keeps_names_with_lone_surrogates_exactly(surrogates: Path, tmp_path: Path) -> None:
    code, _, stderr = run_cli("convert", str(surrogates), str(tmp_path / "o.pt"), "--keep-meta")
    assert code == 0, stderr
    loaded = torch.load(tmp_path / "o.pt", weights_only=True)
    assert list(loaded["state_dict"]) == [SURROGATE, "ok"] and loaded["note"] == "x\udce9y"
    assert loaded["state_dict"][SURROGATE].equal(torch.ones(2))


def test_integers_of_thousands_of_digits_in_metadata(tmp_path: Path) -> None:
    path = tmp_path / "big.pt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "big": 10**5000, 10**5000: 3, "epoch": 7}, path)
    code, stdout, stderr = run_cli("inspect", str(path))
    assert code == 0, stderr
    assert "  big                  <int of 16610 bits>" in stdout.splitlines()
    code, stdout, _ = run_cli("inspect", str(path), "--json")
    assert code == 0 and json.loads(stdout)["selected"] == "state_dict"
    for output, extra in (("o.safetensors", []), ("o.pt", ["--keep-meta"])):
        code, _, stderr = run_cli("convert", str(path), str(tmp_path / output), *extra)
        assert code == 0, stderr
    loaded = torch.load(tmp_path / "o.pt", weights_only=True)
    assert loaded["epoch"] == 7 and "big" not in loaded  # too large to record as JSON: left out


def test_escape_sequences_in_tensor_names_are_printed_escaped(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    title = "\x1b]0;owned\x07"
    clipboard = "\x1b]52;c;cm0gLXJmIH4K\x07"
    torch.save({f"a{title}": torch.ones(1), f"b{clipboard}": torch.ones(1), "c\u202egnp.exe": torch.ones(1)}, path)
    result = _cli("inspect", str(path))
    assert result.returncode == 0
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout and "\u202e" not in result.stdout
    table = result.stdout.splitlines()[-3:]
    assert [line.split() for line in table] == [
        ["a\\x1b]0;owned\\x07", "float32", "[1]"],
        ["b\\x1b]52;c;cm0gLXJmIH4K\\x07", "float32", "[1]"],
        ["c\\u202egnp.exe", "float32", "[1]"],
    ]
    assert len({line.index("float32") for line in table}) == 1  # aligned on what is shown
    result = _cli("inspect", str(path), "--json")
    assert [t["key"] for t in json.loads(result.stdout)["tensors"]] == [
        f"a{title}",
        f"b{clipboard}",
        "c\u202egnp.exe",
    ]
    result = _cli("convert", str(path), str(tmp_path / "o.pt"), "--dry-run", "--add-prefix", "m")
    assert "\x1b" not in result.stdout + result.stderr


@pytest.mark.parametrize("encoding", ["latin-1", "cp1252"])
def test_names_a_terminal_cannot_encode_are_printed_escaped(encoding: str, tmp_path: Path) -> None:
    """A console in latin-1 or cp1252 (Windows) cannot print 日本: inspect died with UnicodeEncodeError."""
    path = tmp_path / "日本.pt"
    torch.save({"日本.weight": torch.ones(1), "héllo": torch.ones(2)}, path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONIOENCODING": encoding}
    for args in (
        ["inspect", str(path)],
        ["inspect", str(path), "--json"],
        ["convert", str(path), str(path), "--overwrite"],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "ckptconv", *args], capture_output=True, env=env, timeout=60, check=False
        )
        stderr = result.stderr.decode(encoding)
        assert "Traceback" not in stderr, stderr
        if args[0] == "convert":  # a refusal naming the file: one line
            assert result.returncode == 1 and stderr.count("\n") == 1 and "onto its own input" in stderr, stderr
        elif "--json" in args:
            assert result.returncode == 0, stderr
            keys = [t["key"] for t in json.loads(result.stdout.decode(encoding))["tensors"]]
            assert keys == ["日本.weight", "héllo"]
        else:
            assert result.returncode == 0, stderr
            assert "\\u65e5\\u672c.weight" in result.stdout.decode(encoding)


# ---------------------------------------------------------------------------------------
# Smaller: usage errors, self-describing refusals, exit codes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["0", "0.5", "0B", "0.4B", "1.5", "0.0001KB"])
def test_shard_sizes_below_one_byte_or_fractional_are_usage_errors(size: str, tmp_path: Path) -> None:
    source = tmp_path / "in.pt"
    torch.save({"w": torch.ones(2)}, source)
    code, _, stderr = run_cli("convert", str(source), str(tmp_path / "out"), "--max-shard-size", size)
    assert code == 2 and "Invalid value for '--max-shard-size'" in stderr, stderr
    assert not (tmp_path / "out").exists()


def test_fractional_shard_sizes_with_units_are_exact(tmp_path: Path) -> None:
    from ckptconv.cli.params import Size

    assert Size().convert("0.5KB", None, None) == 500
    assert Size().convert("0.1GB", None, None) == 100_000_000  # not 100000000.00000001 rounded down
    assert Size().convert("1.5KiB", None, None) == 1536


@pytest.mark.parametrize("rule", ["w=\\x", "w=\\u12", "w=\\q", "(w)=\\g<2>", "w=\\g<x"])
def test_invalid_rename_replacements_are_usage_errors(rule: str, tmp_path: Path) -> None:
    source = tmp_path / "in.pt"
    torch.save({"w": torch.ones(2)}, source)
    code, _, stderr = run_cli("convert", str(source), str(tmp_path / "o.pt"), "--rename", rule)
    assert code == 2 and "Invalid value for '--rename'" in stderr, stderr
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize(
    ("make", "kind", "hint"),
    [
        # torch.ao quantized tensors are read as their dequantize() (tests/test_quantized_cli.py)
        (lambda: torch.ones(3, 3).to_sparse(), "sparse", "tensor.to_dense()"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested", "tensor.unbind()"),
    ],
)
def test_tensors_ckptconv_cannot_read_are_named(make: object, kind: str, hint: str, tmp_path: Path) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized and nested tensors warn about being deprecated/prototypes
        special = make()  # type: ignore[operator]
    source = tmp_path / "in.pt"
    torch.save({"state_dict": {"plain": torch.ones(2), "special": special}}, source)
    code, _, stderr = run_cli("convert", str(source), str(tmp_path / "o.safetensors"))
    assert code == 1
    assert stderr == (
        f"ckptconv: error: {str(source)!r} holds {kind} tensors ('state_dict.special'), which ckptconv cannot "
        f"convert; {_hint(hint)} with torch and save again\n"
    )
    code, stdout, _ = run_cli("inspect", str(source))
    assert code == 0 and f"holds {kind} tensors" in stdout


def _hint(call: str) -> str:
    return {
        "tensor.to_dense()": "make them dense (tensor.to_dense())",
        "tensor.unbind()": "unbind them into ordinary tensors (tensor.unbind())",
    }[call]


def test_inspect_a_legacy_file_with_a_damaged_magic_number_fails(tmp_path: Path) -> None:
    source = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, source, _use_new_zipfile_serialization=False)
    data = bytearray(source.read_bytes())
    assert data[:3] == b"\x80\x02\x8a"  # LONG1: the magic number
    data[5] ^= 0xFF
    source.write_bytes(bytes(data))
    for command in (["inspect", str(source)], ["convert", str(source), str(tmp_path / "o.pt")]):
        code, _, stderr = run_cli(*command)
        assert code == 1 and stderr.count("\n") == 1
        assert "as a legacy torch.save file does, but the first is" in stderr and "the file is damaged" in stderr


@pytest.mark.parametrize("content", [[], ["README.md", "config.json"], ["a.pt", "b.pt"]])
def test_inspect_a_folder_that_is_not_a_checkpoint_fails(content: list[str], tmp_path: Path) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    for name in content:
        (folder / name).write_text("{}")
    code, stdout, stderr = run_cli("inspect", str(folder))
    assert code == 1 and stdout == "" and stderr.startswith(f"ckptconv: error: {str(folder)!r} is a folder but")


# ---------------------------------------------------------------------------------------
# Environment errors: one line, nothing left behind
# ---------------------------------------------------------------------------------------

_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so a write past the limit fails with EFBIG, like a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
from ckptconv.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize(
    ("destination", "extra", "failing"),
    [
        ("out_dcp", ["--to", "dcp"], "out_dcp/__0_0.distcp"),
        ("out_shards", ["--max-shard-size", "2MB"], "out_shards/model-00001-of-00008.safetensors"),
        ("out_pt/", ["--to", "pt"], "out_pt/pytorch_model.bin"),
    ],
)
def test_a_full_disk_while_writing_a_folder_removes_the_folder(
    destination: str, extra: list[str], failing: str, tmp_path: Path
) -> None:
    source = tmp_path / "big.pt"
    torch.save({f"w{i}": torch.randn(1 << 18) for i in range(8)}, source)  # 8 MiB; files may hold 1 MiB
    result = subprocess.run(
        [sys.executable, "-c", _LIMITED, "convert", str(source), f"{tmp_path}/{destination}", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr == (
        f"ckptconv: error: cannot write {str(tmp_path / failing)!r}: the file would exceed the allowed size; "
        "nothing was written\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.pt"]  # the folder it created is gone


@pytest.mark.parametrize("destination", ["{long}.pt", "{long}/", "out/{long}.safetensors"])
def test_a_name_too_long_is_one_line(destination: str, tmp_path: Path) -> None:
    source = tmp_path / "in.pt"
    torch.save({"w": torch.ones(2)}, source)
    (tmp_path / "out").mkdir()
    target = f"{tmp_path}/{destination.format(long='x' * 300)}"
    code, _, stderr = run_cli("convert", str(source), target)
    assert code == 1
    assert stderr == (
        f"ckptconv: error: cannot write {target.rstrip('/')!r}: the name is too long for the file system; "
        "nothing was written\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt", "out"]


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (errno.EROFS, "the file system is read-only"),
        (errno.EACCES, "permission denied"),
        (errno.EPERM, "permission denied"),
    ],
)
@pytest.mark.parametrize("layout", ["file", "shards", "dcp", "batch"])
def test_a_read_only_or_forbidden_destination_is_one_line(
    code: int, reason: str, layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file system refuses to create anything under ``dst`` (as a read-only mount or a folder
    without write permission does; injected, since tests may run as root, who may write anywhere)."""
    source = tmp_path / "in.pt"
    torch.save({"w": torch.ones(2)}, source)
    (tmp_path / "zoo").mkdir()
    torch.save({"w": torch.ones(2)}, tmp_path / "zoo" / "m.pt")
    dst = tmp_path / "dst"
    dst.mkdir()
    real_open, real_mkdir = os.open, os.mkdir

    def refused(path: str, *args: object, **kwargs: object) -> None:
        raise OSError(code, os.strerror(code), path)

    def guarded_open(path: str, flags: int, *args: object, **kwargs: object) -> int:
        creating = flags & (os.O_CREAT | getattr(os, "O_TMPFILE", 0)) or flags & (os.O_WRONLY | os.O_RDWR)
        if creating and str(path).startswith(str(dst)):
            refused(path)
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    def guarded_mkdir(path: str, *args: object, **kwargs: object) -> None:
        if str(path).startswith(str(dst)):
            refused(path)
        real_mkdir(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", guarded_open)
    monkeypatch.setattr(os, "mkdir", guarded_mkdir)
    command = {
        "file": ["convert", str(source), str(dst / "o.safetensors")],
        "shards": ["convert", str(source), str(dst / "sub"), "--max-shard-size", "1KB"],
        "dcp": ["convert", str(source), str(dst / "sub"), "--to", "dcp"],
        "batch": ["batch", str(tmp_path / "zoo"), str(dst / "out")],
    }[layout]
    status, _, stderr = run_cli(*command)
    monkeypatch.undo()
    assert status == 1, stderr
    assert stderr.startswith("ckptconv: error: cannot write ") and stderr.endswith(f": {reason}; nothing was written\n")
    assert stderr.count("\n") == 1
    assert list(dst.iterdir()) == []


def test_batch_removes_the_folders_it_made_for_items_that_failed(tmp_path: Path) -> None:
    zoo = _zoo(tmp_path / "zoo")
    (zoo / "deep" / "er").mkdir(parents=True)
    (zoo / "deep" / "er" / "broken.pt").write_bytes(b"PK\x03\x04 not really")
    out = tmp_path / "out"
    report = ckptconv.batch(zoo, out)
    assert [r.source for r in report.failed] == ["deep/er/broken.pt"]
    assert not (out / "deep").exists()
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [
        "a",
        "a/x.safetensors",
        "ckptconv-manifest.jsonl",
        "y.safetensors",
    ]


def test_every_file_is_opened_through_the_policies() -> None:
    """No module opens a file itself: reads go through read_policy, writes through writing/write_policy."""
    import ast

    package = ROOT / "ckptconv"
    allowed = {
        ("read_policy.py", "open_descriptor"),  # the one place files are opened for reading
        ("read_policy.py", "open_file"),  # a buffered file around it
        ("write_policy.py", "open_append"),  # the manifest
        ("atomic.py", "_temporary"),  # O_TMPFILE or a locked named temporary file
        ("atomic.py", "_publish"),  # the folder, to link the finished file into it
        ("atomic.py", "atomic_output"),  # the folder, to fsync it
        ("atomic.py", "remove_abandoned"),  # partial files, O_NOFOLLOW, to test their lock
        ("atomic.py", "_umask"),  # /proc/self/status
        ("staging.py", "remove_abandoned_staging"),  # an earlier version's staging folders, O_NOFOLLOW, their lock
        ("locks.py", "acquire"),  # the lock file beside an output, O_NOFOLLOW
        ("parts.py", "_publish_if_last"),  # convert --part: the lock the last part takes to publish, O_NOFOLLOW
        ("transaction.py", "_fsync_folder"),  # the staging folder and the destination's parent, to fsync them
        ("loading.py", "load"),  # ckptconv.open, not the builtin
        ("worker.py", "main"),  # its own stdout, for results
        ("archives.py", "_copied"),  # scan: an archive member's copy, mkstemp in scan's own 0700 temporary folder
    }
    found = set()
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for function in [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for node in ast.walk(function):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                name = (
                    func.id
                    if isinstance(func, ast.Name)
                    else f"{getattr(func.value, 'id', '?')}.{func.attr}"
                    if isinstance(func, ast.Attribute)
                    else ""
                )
                if name in ("open", "os.open", "io.open", "os.fdopen", "tempfile.mkstemp"):
                    found.add((path.name, function.name))
    assert found <= allowed, sorted(found - allowed)


def test_a_zoo_link_into_the_output_folder_is_not_an_input(tmp_path: Path) -> None:
    zoo = _zoo(tmp_path / "zoo")
    ckptconv.batch(zoo, zoo / "out")
    (zoo / "again.safetensors").symlink_to("out/y.safetensors")
    report = ckptconv.batch(zoo, zoo / "out", overwrite=True)
    assert sorted(r.source for r in report.results) == ["a/x.pt", "y.pt"]
    assert report.notes == (
        "skipped 'again.safetensors': a link into the output folder (to 'out/y.safetensors'); not followed",
    )


def test_progress_bars_show_file_names_escaped(tmp_path: Path) -> None:
    from tqdm import tqdm

    from ckptconv.writing.writer import _progress_callback

    _, close = _progress_callback(True, 10, str(tmp_path / "evil\x1b]0;t\x07.pt"))
    try:
        (bar,) = list(tqdm._instances)  # type: ignore[attr-defined]
        assert bar.desc == "evil\\x1b]0;t\\x07.pt"
    finally:
        close()


@pytest.mark.parametrize("failure", [KeyboardInterrupt, lambda: OSError(errno.ENOSPC, "No space left on device")])
def test_an_interruption_while_writing_a_dcp_record_is_not_hidden(failure: object) -> None:
    """Ctrl-C, SIGTERM or a failed write in the middle of a DCP record comes out as itself (when torch.save
    wrote the records, it was replaced by the RuntimeError torch's zip writer raises while closing,
    "unexpected pos", a traceback)."""
    import contextlib
    import io
    from collections.abc import Iterator

    from ckptconv.writing import dcp as dcp_writer
    from ckptconv.writing.writer import _entries

    class Failing(io.BytesIO):
        def write(self, data: bytes) -> int:  # type: ignore[override]
            if self.tell() > 2000:
                raise failure()  # type: ignore[operator]
            return super().write(data)

    @contextlib.contextmanager
    def open_output(name: str) -> Iterator[io.BytesIO]:
        yield Failing()

    expected = KeyboardInterrupt if failure is KeyboardInterrupt else OSError
    with pytest.raises(expected):
        dcp_writer.write(
            _entries({f"t{i}": torch.ones(1000) for i in range(3)}),
            "unused",
            open_output=open_output,
            on_bytes=lambda n: None,
        )


def _hub_snapshot(root: Path, files: dict[str, bytes]) -> Path:
    """A Hugging Face hub cache repository: blobs by sha256, a snapshot of links to them."""
    repo = root / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        digest = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / digest).write_bytes(data)
        (snapshot / name).symlink_to(f"../../blobs/{digest}")
    return snapshot


def test_hugging_face_cache_snapshots_are_read(tmp_path: Path) -> None:
    """Every file of a hub cache snapshot is a link to ../../blobs: followed there, and only there."""
    work = tmp_path / "work"
    _sharded(work)
    files = {p.name: p.read_bytes() for p in work.iterdir()}
    snapshot = _hub_snapshot(tmp_path, files)
    weights = ckptconv.load(snapshot)
    assert weights["a"].equal(torch.arange(64.0)) and weights["b"].equal(torch.ones(64))
    single = _hub_snapshot(
        tmp_path / "single", {"model.safetensors": (work / "model-00002-of-00002.safetensors").read_bytes()}
    )
    assert ckptconv.load(single)["b"].equal(torch.ones(64))
    report = ckptconv.batch(single, tmp_path / "out")
    assert [(r.source, r.status) for r in report.results] == [("model.safetensors", "converted")] and not report.notes
    # A snapshot link anywhere else is refused as in any folder.
    (tmp_path / "private.safetensors").write_bytes(files["model-00001-of-00002.safetensors"])
    (snapshot / "model-00001-of-00002.safetensors").unlink()
    (snapshot / "model-00001-of-00002.safetensors").symlink_to(tmp_path / "private.safetensors")
    with pytest.raises(ckptconv.MalformedCheckpointError, match="leads outside the checkpoint folder"):
        ckptconv.open(snapshot)


def test_a_look_alike_hub_cache_whose_blobs_folder_is_a_link_is_refused(tmp_path: Path) -> None:
    """A snapshot's ``../../blobs`` links count as inside the checkpoint only when ``blobs`` is the
    repository's own folder: with ``blobs`` a link to a private folder, every file there was read."""
    private = tmp_path / "private"
    private.mkdir()
    safetensors.torch.save_file({"secret": torch.tensor([1.0, 2.0, 3.0])}, str(private / "secret.safetensors"))
    zoo = tmp_path / "zoo"
    repo = zoo / "models--evil--x"
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (repo / "blobs").symlink_to(private)
    (snapshot / "model.safetensors").symlink_to("../../blobs/secret.safetensors")
    with pytest.raises(ckptconv.MalformedCheckpointError, match="leads outside the checkpoint folder"):
        ckptconv.open(snapshot)
    output = tmp_path / "out.safetensors"
    code, _, stderr = run_cli("convert", str(snapshot), str(output))
    assert code == 1 and "leads outside the checkpoint folder" in stderr, stderr
    assert not output.exists()
    report = ckptconv.batch(zoo, tmp_path / "bout")
    assert not [r for r in report.results if r.status == "converted"], report.results
    assert not list((tmp_path / "bout").rglob("*.safetensors"))
    assert all(report.verdict != "safe" for report in ckptconv.scan_many([zoo]).reports)


# ---------------------------------------------------------------------------------------
# The paths the Python API takes: str, bytes, os.PathLike of either; taken as written
# ---------------------------------------------------------------------------------------


class _BytesPath:
    """An ``os.PathLike[bytes]``, as ``os.fsencode``-minded code passes paths."""

    def __init__(self, path: Path) -> None:
        self.path = os.fsencode(path)

    def __fspath__(self) -> bytes:
        return self.path


@pytest.mark.parametrize("spell", [os.fsencode, _BytesPath], ids=["bytes", "PathLike[bytes]"])
def test_every_entry_point_takes_bytes_paths(tmp_path: Path, spell: object) -> None:
    """bytes paths went in as far as a str method and failed there with "a bytes-like object is
    required, not 'str'"; they are now what os.fsdecode makes of them, in every function."""
    path = spell  # type: ignore[assignment]
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    source = zoo / "caf\udce9.pt"  # not UTF-8: the same bytes must be opened
    expected = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "i": torch.tensor([7], dtype=torch.int64)}
    torch.save(expected, source)

    def same(actual: dict[str, torch.Tensor]) -> None:
        assert actual.keys() == expected.keys()
        assert all(torch.equal(actual[k], expected[k]) and actual[k].dtype == expected[k].dtype for k in expected)

    same(ckptconv.load(path(source)))  # type: ignore[operator]
    assert ckptconv.open(path(source)).format == "torch-zip"  # type: ignore[operator]
    assert ckptconv.inspect(path(source)).format == "torch-zip"  # type: ignore[operator]
    assert ckptconv.scan(path(source)).verdict == "safe"  # type: ignore[operator]
    assert [r.verdict for r in ckptconv.scan_many([path(zoo)]).reports] == ["safe"]  # type: ignore[operator]
    converted = tmp_path / "out.safetensors"
    ckptconv.convert(path(source), path(converted))  # type: ignore[operator]
    same(load_file(converted))
    assert ckptconv.verify(path(source), path(converted)).ok  # type: ignore[operator]
    assert ckptconv.diff(path(source), path(converted)).identical  # type: ignore[operator]
    saved = tmp_path / "saved.pt"
    ckptconv.save(expected, path(saved))  # type: ignore[operator]
    same(torch.load(saved, weights_only=True))
    report = ckptconv.batch(path(zoo), path(tmp_path / "out"))  # type: ignore[operator]
    assert report.failed == ()
    same(safetensors.torch.load((tmp_path / "out" / "caf\udce9.safetensors").read_bytes()))  # it takes no such name
    fitted, _ = ckptconv.fit(expected, path(converted))  # type: ignore[operator]
    assert fitted.keys() == expected.keys()


_NOT_EXPANDED = "(a leading '~' is not expanded: ckptconv, like torch.load, takes paths as written)"


def test_tilde_is_taken_as_written_as_torch_does_and_the_error_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    torch.save({"w": torch.ones(2)}, home / "m.pt")
    monkeypatch.setenv("HOME", str(home))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(FileNotFoundError):  # torch does not expand it either
        torch.load("~/m.pt", weights_only=True)
    said = f"'~/m.pt' does not exist {_NOT_EXPANDED}; check the path"
    for call in (
        lambda: ckptconv.load("~/m.pt"),
        lambda: ckptconv.inspect("~/m.pt"),
        lambda: ckptconv.convert("~/m.pt", "o.safetensors"),
        lambda: ckptconv.scan_many(["~/m.pt"]),
    ):
        with pytest.raises(ckptconv.LoadError) as caught:
            call()
        assert str(caught.value) == said
    assert ckptconv.scan("~/m.pt").reason == said.removeprefix("'~/m.pt' ")  # a reason about the path shown
    with pytest.raises(ckptconv.LoadError) as caught:
        ckptconv.batch("~", "out")
    assert str(caught.value) == f"'~' does not exist {_NOT_EXPANDED}; check the path"
    with pytest.raises(ckptconv.WriteError) as caught:
        ckptconv.save({"w": torch.ones(2)}, "~/o.pt")
    assert str(caught.value) == f"folder {str(work / '~')!r} does not exist {_NOT_EXPANDED}; create it first"
    assert run_cli("convert", "~/m.pt", "o.pt") == (1, "", f"ckptconv: error: {said}\n")
    assert os.listdir(work) == []


def test_a_file_named_as_a_folder_says_it_is_a_file(tmp_path: Path) -> None:
    """``scan m.pt/`` said 'm.pt/' does not exist; convert said "cannot be read: Not a directory"."""
    source = tmp_path / "m.pt"
    torch.save({"w": torch.ones(2)}, source)
    said = f"{str(source) + '/'!r} ends in '/', but {str(source)!r} is a file, not a folder; check the path"
    for command in ("scan", "inspect"):
        assert run_cli(command, f"{source}/") == (1, "", f"ckptconv: error: {said}\n")
    assert run_cli("convert", f"{source}/", str(tmp_path / "o.pt")) == (1, "", f"ckptconv: error: {said}\n")
    inner = f"{source}/x.pt"
    assert run_cli("inspect", inner) == (
        1,
        "",
        f"ckptconv: error: {inner!r} does not exist: {str(source)!r} is a file, not a folder; check the path\n",
    )
    assert sorted(os.listdir(tmp_path)) == ["m.pt"]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_an_output_on_a_file_system_of_no_size_gets_the_real_error(tmp_path: Path) -> None:
    """/proc answers 0 bytes free: "needs 88 B but only 0 B are free there" hid why nothing can be written."""
    source = tmp_path / "m.pt"
    torch.save({"w": torch.ones(4)}, source)
    code, _, stderr = run_cli("convert", str(source), "/proc/self/ckptconv-test.safetensors")
    assert code == 1 and "free there" not in stderr and "cannot write" in stderr, stderr
