"""Sharded checkpoints and DCP folders: in and out, merge and reshard, bit for bit, safely."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

import ckptconv
from ckptconv.gpu.torch_tensors import to_torch
from ckptconv.reading.sources import InMemory
from ckptconv.values.tensor import Storage, TensorRef
from ckptconv.writing.shards import plan_shards

from .conftest import FIXTURES, assert_same_state, assert_same_tensor, dcp_one_process, views_state

GPU = FIXTURES / "gpu"


def shard_reference(folder: Path) -> dict[str, torch.Tensor]:
    """What the shards hold, read by their own libraries."""
    index = json.loads(next(folder.glob("*.index.json")).read_text())
    state: dict[str, torch.Tensor] = {}
    for name in dict.fromkeys(index["weight_map"].values()):
        path = folder / name
        if name.endswith(".safetensors"):
            state.update(load_file(path))
        else:
            state.update(torch.load(path, map_location="cpu", weights_only=True))
    return state


@pytest.mark.parametrize("folder", ["hf_sharded_safetensors", "hf_sharded_bin"])
def test_transformers_shards_read_as_one_state_dict(folder: str) -> None:
    for path in (GPU / folder, next((GPU / folder).glob("*.index.json"))):
        checkpoint = ckptconv.open(path)
        assert checkpoint.format == "sharded"
        assert_same_state(to_torch(checkpoint.select().weights), shard_reference(GPU / folder), ordered=False)


def test_dcp_folder_reads_as_the_full_model() -> None:
    checkpoint = ckptconv.open(GPU / "fsdp2_dcp")
    assert checkpoint.format == "dcp"
    selection = checkpoint.select()
    assert selection.where == "model"  # the optimizer state beside it is skipped
    full = torch.load(GPU / "fsdp2_full_state_dict.pt", map_location="cpu", weights_only=True)
    assert_same_state(to_torch(selection.weights), full, ordered=False)
    assert checkpoint.foreign_globals == {}  # DCP's own classes are not reported as stand-ins


@pytest.mark.parametrize("kind", ["safetensors", "pt"])
def test_single_to_sharded_to_single_round_trip(kind: str, tmp_path: Path) -> None:
    state = {**views_state(), **{f"layer.{i}.w": torch.randn(64, 64) for i in range(6)}}
    source = tmp_path / "model.pt"
    torch.save(state, source)
    shards = tmp_path / "shards"
    report = ckptconv.convert(source, shards, to=kind, max_shard_size=40_000)
    stem, suffix = ("model", "safetensors") if kind == "safetensors" else ("pytorch_model", "bin")
    names = sorted(p.name for p in shards.iterdir())
    count = len(names) - 1
    assert count > 3 and f"{stem}.{suffix}.index.json" in names
    assert f"{stem}-00001-of-{count:05d}.{suffix}" in names
    index = json.loads((shards / f"{stem}.{suffix}.index.json").read_text())
    stored = set(state) - set(report.aliases)
    assert set(index["weight_map"]) == stored
    assert index["metadata"]["total_size"] == report.bytes
    if kind == "safetensors":  # stored once; the alias travels in the shard's metadata
        assert report.aliases == {"lm_head.weight": "embed.weight"}
    else:  # tied tensors share a storage, so they land in one shard
        assert index["weight_map"]["lm_head.weight"] == index["weight_map"]["embed.weight"]
    assert_same_state(shard_reference(shards), {k: v for k, v in state.items() if k in stored}, ordered=False)
    merged = tmp_path / f"merged.{'safetensors' if kind == 'safetensors' else 'pt'}"
    ckptconv.convert(shards, merged)
    assert_same_state(ckptconv.load(merged), state, ordered=False)


def test_a_folder_destination_with_one_shard_gets_the_plain_name(tmp_path: Path) -> None:
    source = tmp_path / "model.pt"
    torch.save({"w": torch.ones(3)}, source)
    report = ckptconv.convert(source, str(tmp_path / "out") + os.sep)
    assert [Path(f).name for f in report.files] == ["model.safetensors"]
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_dcp_round_trip_and_torch_reads_it(tmp_path: Path) -> None:
    merged = tmp_path / "merged.safetensors"
    ckptconv.convert(GPU / "fsdp2_dcp", merged)
    out = tmp_path / "dcp_out"
    ckptconv.convert(merged, out, to="dcp")
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp"]
    expected = ckptconv.load(merged)
    state = {key: torch.zeros_like(value) for key, value in expected.items()}
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(state, checkpoint_id=str(out), **dcp_one_process())
    assert_same_state(state, expected, ordered=False)
    assert_same_state(ckptconv.load(out), expected, ordered=False)


def test_writing_into_a_folder_keeps_other_files_and_reports_stale_shards(tmp_path: Path) -> None:
    source = tmp_path / "model.pt"
    torch.save({f"w{i}": torch.randn(100) for i in range(6)}, source)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    ckptconv.convert(source, out, max_shard_size=500)  # 400-byte tensors: one per shard
    assert len(list(out.glob("model-*-of-00006.safetensors"))) == 6
    with pytest.raises(ckptconv.OutputExistsError, match="pass --overwrite"):
        ckptconv.convert(source, out, max_shard_size=1300)
    assert len(list(out.glob("model-*.safetensors"))) == 6  # nothing was touched
    ckptconv.convert(source, out, max_shard_size=1300, overwrite=True)  # three per shard
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert (out / "config.json").read_text() == "{}"


def test_output_may_not_replace_an_input_shard(tmp_path: Path) -> None:
    source = tmp_path / "shards"
    ckptconv.convert(GPU / "hf_sharded_safetensors", source, max_shard_size=30_000)
    with pytest.raises(ckptconv.WriteError, match="onto its own input"):
        ckptconv.convert(source, source, max_shard_size=30_000, overwrite=True)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors", "", 3])
def test_index_may_only_name_files_inside_its_folder(shard: object, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    with pytest.raises(ckptconv.MalformedCheckpointError, match="inside its folder"):
        ckptconv.open(folder)


def test_index_shard_symlinked_outside_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.safetensors"
    ckptconv.save({"w": torch.ones(2)}, outside)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model-00001-of-00001.safetensors").symlink_to(outside)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}})
    )
    with pytest.raises(ckptconv.MalformedCheckpointError, match="leads outside the checkpoint folder"):
        ckptconv.open(folder)


def test_missing_shard_and_mismatched_index(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    ckptconv.convert(GPU / "hf_sharded_safetensors", folder, max_shard_size=30_000)
    index = folder / "model.safetensors.index.json"
    document = json.loads(index.read_text())
    first, second = sorted(set(document["weight_map"].values()))[:2]
    document["weight_map"]["invented.weight"] = first
    index.write_text(json.dumps(document))
    with pytest.raises(ckptconv.MalformedCheckpointError, match="does not hold it"):
        ckptconv.open(folder)
    (folder / second).unlink()
    with pytest.raises(ckptconv.MalformedCheckpointError, match="is missing"):
        ckptconv.open(folder)


def test_a_key_held_by_two_shards_is_refused(tmp_path: Path) -> None:
    """The index maps 'k' to the first shard, but the second holds a 'k' too: transformers, which loads
    every shard in turn, ends with the second's values, ckptconv took the index's. Neither is a safe guess."""
    from safetensors.torch import save_file

    folder = tmp_path / "ckpt"
    folder.mkdir()
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({"k": torch.ones(2), "a": torch.zeros(1)}, folder / first)
    save_file({"k": torch.full((2,), 7.0), "b": torch.zeros(1)}, folder / second)
    weight_map = {"k": first, "a": first, "b": second}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(ckptconv.MalformedCheckpointError, match=f"'k' is in {first!r} and in {second!r}"):
        ckptconv.open(folder)


@pytest.mark.parametrize(
    ("index", "said"),
    [
        (
            '{"weight_map": {"k": "a.safetensors", "k": "b.safetensors"}}',
            "is a damaged sharded checkpoint index: it is not valid JSON (duplicate key 'k')",
        ),
        (
            '{"weight_map": {"k": ["a.safetensors"]}}',
            "names the shard ['a.safetensors'], which is not a file inside its folder (it is not a file name); "
            "the checkpoint is damaged",
        ),
    ],
    ids=["key named twice", "shard not a name"],
)
def test_an_index_that_names_a_key_twice_or_oddly_is_refused(tmp_path: Path, index: str, said: str) -> None:
    """json kept the last of two entries for 'k' (b's 7s), though 'a.safetensors' holds a 'k' too and the
    index named it first; a shard named by a list ended in "could not be parsed (TypeError: unhashable ...)"."""
    from safetensors.torch import save_file

    save_file({"k": torch.ones(2)}, tmp_path / "a.safetensors")
    save_file({"k": torch.full((2,), 7.0)}, tmp_path / "b.safetensors")
    index_path = tmp_path / "model.safetensors.index.json"
    index_path.write_text(index)
    with pytest.raises(ckptconv.MalformedCheckpointError) as caught:
        ckptconv.open(tmp_path)
    assert str(caught.value) == f"{str(index_path)!r} {said}"


def test_dcp_chunk_outside_the_folder_is_refused(tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "dcp"
    shutil.copytree(GPU / "fsdp2_dcp", folder)
    metadata = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(metadata.replace(b"__0_0.distcp", b"../_0.distcp"))  # same length
    with pytest.raises(ckptconv.MalformedCheckpointError, match="outside the checkpoint folder"):
        ckptconv.open(folder)


def _refs(sizes: list[int], tied: list[int]) -> list[tuple[str, TensorRef]]:
    from ckptconv.dtypes import dtype_by_name

    uint8 = dtype_by_name("uint8")
    assert uint8 is not None
    entries = []
    for index, size in enumerate(sizes):
        storage = Storage(size, InMemory(bytes(size)))
        entries.append((f"t{index}", TensorRef(storage, uint8, (size,), (1,))))
    for index in tied:
        if index < len(entries):
            entries.append((f"alias{index}", entries[index][1]))
    return entries


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 5000), min_size=1, max_size=40),
    st.lists(st.integers(0, 40), max_size=5),
    st.integers(1, 8000),
)
def test_shard_plans_cover_every_key_once_and_respect_the_limit(sizes: list[int], tied: list[int], limit: int) -> None:
    entries = _refs(sizes, tied)
    plan = plan_shards(entries, limit)
    keys = [key for shard in plan.shards for key, _ in shard]
    assert sorted(keys) == sorted(key for key, _ in entries)
    for shard, size in zip(plan.shards, plan.sizes):
        storages = {id(ref.storage) for _, ref in shard}
        if size > limit:
            assert len(storages) == 1  # only a single (tied) group may exceed the limit
    shard_of = {key: i for i, shard in enumerate(plan.shards) for key, _ in shard}
    for key, ref in entries:
        for other, other_ref in entries:
            if ref.storage is other_ref.storage:
                assert shard_of[key] == shard_of[other]


def test_inspect_a_sharded_folder() -> None:
    info = ckptconv.inspect(GPU / "hf_sharded_safetensors")
    assert info.format == "sharded" and len(info.tensors) == 28
    assert info.metadata["total_size"] == "122368"
    assert_same_tensor(
        ckptconv.load(GPU / "hf_sharded_safetensors")["transformer.wte.weight"],
        load_file(GPU / "hf_sharded_safetensors" / "model-00001-of-00008.safetensors")["transformer.wte.weight"],
    )


def test_safetensors_shards_have_pt_metadata(tmp_path: Path) -> None:
    out = tmp_path / "shards"
    ckptconv.convert(GPU / "hf_sharded_bin", out, max_shard_size=30_000)
    for shard in out.glob("*.safetensors"):
        with safe_open(shard, framework="pt") as handle:
            assert handle.metadata()["format"] == "pt"


def test_a_dcp_folder_cannot_be_rewritten_while_it_is_being_read(tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "dcp"
    shutil.copytree(GPU / "fsdp2_dcp", folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    # tok_emb.weight is split across both ranks' files: only its chunks name them.
    assert type(ckptconv.open(folder).select().weights["tok_emb.weight"].storage.source).__name__ == "Assembled"
    with pytest.raises(ckptconv.WriteError, match="onto its own input"):
        ckptconv.convert(folder, folder, to="dcp", overwrite=True, transforms=[ckptconv.Keep(r"^tok_emb\.weight$")])
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_dcp_tensor_split_by_columns_reads_exactly_and_is_not_kept_alive(tmp_path: Path) -> None:
    """Chunks that are not whole rows are pasted together; the pasted copy lives only while the tensor is read."""
    import gc
    import weakref

    from ckptconv.dtypes import dtype_by_name
    from ckptconv.reading.formats.dcp import Assembled

    full = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    float32 = dtype_by_name("float32")
    assert float32 is not None
    chunks = []
    for column in (0, 3):
        block = full[:, column : column + 3].contiguous()
        storage = Storage(block.numel() * 4, InMemory(block.numpy().tobytes()))
        chunks.append(((0, column), TensorRef(storage, float32, (4, 3), (3, 1))))
    source = Assembled(tuple(chunks), (4, 6), 4)
    ref = TensorRef(Storage(full.numel() * 4, source), float32, (4, 6), (6, 1))
    read = b"".join(bytes(piece) for piece in ref.iter_bytes(chunk_bytes=8))
    assert read == full.numpy().tobytes()
    assert torch.equal(to_torch({"w": ref})["w"], full)
    alive = weakref.ref(source)
    del ref, source, chunks
    gc.collect()
    assert alive() is None


def test_a_dcp_tensor_whose_chunks_hold_another_dtype_than_recorded_is_refused(tmp_path: Path) -> None:
    """The metadata says float64 where the chunk holds float32: torch's loader (dcp_to_torch_save)
    makes a float64 tensor and casts the chunk into it; ckptconv wrote the chunk's float32."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.randn(4, 3), "i": torch.arange(5)}, checkpoint_id=str(folder))
        with open(folder / ".metadata", "rb") as file:
            metadata = pickle.load(file)  # written by this test
        metadata.state_dict_metadata["w"].properties.dtype = torch.float64
        with open(folder / ".metadata", "wb") as file:
            pickle.dump(metadata, file)
        dcp_to_torch_save(folder, tmp_path / "oracle.pt")
    assert torch.load(tmp_path / "oracle.pt", weights_only=True)["w"].dtype == torch.float64
    with pytest.raises(
        ckptconv.MalformedCheckpointError,
        match="'w' is recorded as float64 but its chunks hold float32; torch's loader would cast them",
    ):
        ckptconv.open(folder)


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("./m.safetensors", "is not a plain name of a file inside its folder (it has a '.' or an empty component)"),
        ("a//m.safetensors", "is not a plain name of a file inside its folder (it has a '.' or an empty component)"),
        (None, "is not a file inside its folder (it is not a file name);"),
        ("../m.safetensors", "is not a file inside its folder (it leads outside the checkpoint folder)"),
        ("/abs/m.safetensors", "is not a file inside its folder (it leads outside the checkpoint folder)"),
        ("a\\m.safetensors", "is not a file inside its folder (its name holds a backslash or a NUL character)"),
    ],
)
def test_an_index_naming_a_shard_oddly_says_what_is_wrong_with_the_name(
    name: Any, problem: str, tmp_path: Path
) -> None:
    """Every odd shard name was said to lead outside the checkpoint folder, './m.safetensors' and None too."""
    ckptconv.save({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(ckptconv.MalformedCheckpointError) as raised:
        ckptconv.open(tmp_path)
    assert f"names the shard {name!r}, which {problem}" in str(raised.value)
