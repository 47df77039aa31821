"""One list of checkpoint names: opening, inspecting, hashing and batch agree on which files a checkpoint is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import ckptconv
from ckptconv.reading.discovery import discover
from ckptconv.suffixes import CHECKPOINT_SUFFIXES, SHARD_SUFFIXES

from .conftest import assert_same_state


def _pth_shards(folder: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A sharded checkpoint of two .pth shards (~150 KB) and its index."""
    torch.manual_seed(seed)
    state = {"a.weight": torch.randn(96, 192), "b.weight": torch.randn(96, 192)}
    folder.mkdir(exist_ok=True)
    weight_map = {}
    for number, key in enumerate(state, start=1):
        name = f"model-{number:05d}-of-00002.pth"
        torch.save({key: state[key]}, folder / name)
        weight_map[key] = name
    (folder / "model.pth.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return state


def _provenance_sha256(path: Path) -> str:
    with safe_open(str(path), "pt") as file:
        return str(file.metadata()["ckptconv.source_sha256"])


def test_every_pth_shard_counts_in_the_provenance_sha256(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    state = _pth_shards(folder)
    ckptconv.convert(folder, tmp_path / "a.safetensors")
    changed = {"b.weight": state["b.weight"] + 1}
    torch.save(changed, folder / "model-00002-of-00002.pth")
    ckptconv.convert(folder, tmp_path / "b.safetensors")
    assert not torch.equal(ckptconv.load(tmp_path / "a.safetensors")["b.weight"], changed["b.weight"])
    assert_same_state(ckptconv.load(tmp_path / "b.safetensors"), {**state, **changed}, ordered=False)
    assert _provenance_sha256(tmp_path / "a.safetensors") != _provenance_sha256(tmp_path / "b.safetensors")


@pytest.mark.parametrize("where", ["folder", "index"])
def test_inspect_counts_every_shard_of_a_sharded_checkpoint(where: str, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    _pth_shards(folder)
    on_disk = sum(path.stat().st_size for path in folder.iterdir())
    assert on_disk > 140_000
    info = ckptconv.inspect(folder if where == "folder" else folder / "model.pth.index.json")
    assert info.size == on_disk


@pytest.mark.parametrize("name", [f"x{suffix}" for suffix in CHECKPOINT_SUFFIXES] + ["weights", "x.tar"])
def test_a_folder_holding_one_checkpoint_opens_as_batch_finds_it(name: str, tmp_path: Path) -> None:
    """Whatever the file is called, `open(folder)` reads the one checkpoint `batch` would convert there."""
    torch.manual_seed(0)
    state = {"w": torch.randn(4, 5), "steps": torch.arange(3)}
    folder = tmp_path / "only"
    folder.mkdir()
    if name.endswith(".safetensors"):
        save_file(state, folder / name)
    else:
        torch.save(state, folder / name)
    (folder / "config.json").write_text("{}")
    assert [item.name for item in discover(folder)] == [name]
    assert_same_state(ckptconv.load(folder), state, ordered=False)


def test_a_folder_of_two_checkpoints_names_both(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(2)}, tmp_path / "best.pth.tar")
    torch.save({"w": torch.ones(2)}, tmp_path / "last.pt")
    with pytest.raises(ckptconv.UnsupportedFormatError, match=r"it holds best\.pth\.tar, last\.pt; give the file"):
        ckptconv.open(tmp_path)


def test_every_shard_suffix_has_an_index_name_the_reader_accepts(tmp_path: Path) -> None:
    for suffix in SHARD_SUFFIXES:
        folder = tmp_path / suffix.strip(".")
        folder.mkdir()
        state = {"w": torch.arange(6.0)}
        shard = f"model-00001-of-00001{suffix}"
        if suffix == ".safetensors":
            save_file(state, folder / shard)
        else:
            torch.save(state, folder / shard)
        (folder / f"model{suffix}.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
        assert ckptconv.open(folder).format == "sharded"
        assert_same_state(ckptconv.load(folder), state)
