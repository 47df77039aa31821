"""--overwrite into a folder replaces the previous output as a whole or not at all, and never removes
a file ckptconv did not write."""

from __future__ import annotations

import hashlib
import json
import signal
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from .conftest import dcp_one_process, run_cli
from .test_crash_safety import _start_slow


def _tensors(count: int, *, overflow_at: int | None = None) -> dict[str, torch.Tensor]:
    state = {f"t{i}": torch.arange(256, dtype=torch.float32) + i for i in range(count)}
    if overflow_at is not None:
        state[f"t{overflow_at}"][3] = 1e10  # fp16 overflows here: the write is refused late
    return state


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "" for p in folder.iterdir()}


def _load_sharded(folder: Path, suffix: str) -> dict[str, torch.Tensor]:
    """The folder's tensors, as transformers reads them: through the index, with the format's own library."""
    index = folder / ("model.safetensors.index.json" if suffix == "safetensors" else "pytorch_model.bin.index.json")
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        path = folder / shard
        state.update(load_file(path) if suffix == "safetensors" else torch.load(path, weights_only=True))
    return state


def _assert_same(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(state) == sorted(expected)
    for key, value in expected.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), key


@pytest.mark.parametrize("to", ["safetensors", "pt"])
def test_a_failed_overwrite_of_shards_keeps_the_previous_output_whole(to: str, tmp_path: Path) -> None:
    first, second, out = tmp_path / "a.pt", tmp_path / "b.pt", tmp_path / "dst"
    torch.save(_tensors(6), first)
    torch.save(_tensors(6, overflow_at=5), second)  # the same shard names, the last one refused
    assert run_cli("convert", str(first), f"{out}/", "--max-shard-size", "4KB", "--to", to, "-q")[0] == 0
    before = _digests(out)
    assert len(before) == 3  # two shards and the index
    code, _, stderr = run_cli(
        "convert", str(second), f"{out}/", "--max-shard-size", "2KB", "--dtype", "fp16", "--overwrite", "--to", to
    )
    assert code == 1 and "t5" in stderr, stderr
    assert _digests(out) == before  # nothing replaced, nothing removed, nothing left behind
    _assert_same(_load_sharded(out, to), _tensors(6))


def test_a_failed_overwrite_of_a_dcp_folder_keeps_the_previous_output_loadable(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    first, second, out = tmp_path / "a.pt", tmp_path / "b.pt", tmp_path / "dst"
    torch.save(_tensors(6), first)
    torch.save(_tensors(6, overflow_at=5), second)  # the same shard names, the last one refused
    assert run_cli("convert", str(first), str(out), "--to", "dcp", "-q")[0] == 0
    before = _digests(out)
    code, _, stderr = run_cli("convert", str(second), str(out), "--to", "dcp", "--dtype", "fp16", "--overwrite")
    assert code == 1 and "t5" in stderr, stderr
    assert _digests(out) == before
    state = {key: torch.zeros_like(value) for key, value in _tensors(6).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(state, checkpoint_id=str(out), **dcp_one_process())
    _assert_same(state, _tensors(6))


def test_overwrite_never_removes_files_ckptconv_did_not_write(tmp_path: Path) -> None:
    source, out = tmp_path / "a.pt", tmp_path / "dst"
    torch.save(_tensors(6), source)
    out.mkdir()
    # The user's own files, of the names a sharded output has, with no ckptconv provenance.
    save_file({"mine": torch.ones(3)}, out / "model.safetensors")
    save_file({"mine": torch.ones(4)}, out / "model-00003-of-00003.safetensors")
    (out / "notes.txt").write_text("mine")
    foreign = _digests(out)
    assert run_cli("convert", str(source), f"{out}/", "--max-shard-size", "4KB", "--overwrite", "-q") == (0, "", "")
    after = _digests(out)
    assert {name: after.get(name) for name in foreign} == foreign
    _assert_same(_load_sharded(out, "safetensors"), _tensors(6))


def test_a_successful_overwrite_removes_the_shards_of_the_previous_output_it_wrote(tmp_path: Path) -> None:
    source, out = tmp_path / "a.pt", tmp_path / "dst"
    torch.save(_tensors(6), source)
    assert run_cli("convert", str(source), f"{out}/", "--max-shard-size", "2KB", "-q")[0] == 0
    assert len(list(out.iterdir())) == 7  # six shards and the index
    assert run_cli("convert", str(source), f"{out}/", "--max-shard-size", "4KB", "--overwrite", "-q")[0] == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    _assert_same(_load_sharded(out, "safetensors"), _tensors(6))


@pytest.mark.parametrize("tmpfile", [True, False], ids=["O_TMPFILE", "named temporary"])
@pytest.mark.parametrize("layout", ["shards", "dcp"])
def test_sigkill_during_an_overwrite_leaves_the_previous_output_loadable(
    layout: str, tmpfile: bool, tmp_path: Path
) -> None:
    first, second, out = tmp_path / "a.pt", tmp_path / "many.pt", tmp_path / "dst"
    torch.save(_tensors(6), first)
    torch.save({f"t{i}": torch.full((4096,), float(i)) for i in range(300)}, second)
    extra = ["--max-shard-size", "4KB"] if layout == "shards" else ["--to", "dcp"]
    assert run_cli("convert", str(first), f"{out}/", *extra, "-q")[0] == 0
    before = _digests(out)
    process, _ = _start_slow(tmp_path, "convert", str(second), f"{out}/", *extra, "--overwrite", "-q", tmpfile=tmpfile)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert _digests(out) == before  # the new files are staged beside the folder, never in it
    if layout == "shards":
        _assert_same(_load_sharded(out, "safetensors"), _tensors(6))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".dst.ckptconv-staging-")]
    # The next write into the folder removes the staging folder (and the lock file) the killed writer left.
    assert run_cli("convert", str(first), f"{out}/", *extra, "--overwrite", "-q")[0] == 0
    assert not [p for p in tmp_path.iterdir() if "ckptconv-" in p.name]
    assert _digests(out) == before


def test_an_overwrite_that_keeps_files_ckptconv_did_not_write_names_them_in_one_note(tmp_path: Path) -> None:
    source, out = tmp_path / "a.pt", tmp_path / "dst"
    torch.save(_tensors(6), source)
    out.mkdir()
    save_file({"mine": torch.ones(3)}, out / "model.safetensors")  # no ckptconv provenance: the user's own
    save_file({"mine": torch.ones(4)}, out / "model-00003-of-00003.safetensors")
    code, _, stderr = run_cli("convert", str(source), f"{out}/", "--max-shard-size", "4KB", "--overwrite")
    assert code == 0, stderr
    notes = [line for line in stderr.splitlines() if line.startswith("note: kept")]
    assert notes == [
        f"note: kept 2 files in {str(out)!r} that the new output does not use and ckptconv cannot tell it wrote: "
        "model-00003-of-00003.safetensors, model.safetensors; remove them if they do not belong with the new output"
    ], stderr
    assert load_file(out / "model.safetensors")["mine"].tolist() == [1.0, 1.0, 1.0]  # kept, unchanged
    _assert_same(_load_sharded(out, "safetensors"), _tensors(6))
    # With the user's files gone, an overwrite keeps nothing and says nothing of it.
    (out / "model.safetensors").unlink()
    (out / "model-00003-of-00003.safetensors").unlink()
    code, _, stderr = run_cli("convert", str(source), f"{out}/", "--max-shard-size", "4KB", "--overwrite")
    assert code == 0 and "note: kept" not in stderr, stderr
