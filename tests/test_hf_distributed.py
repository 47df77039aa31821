"""transformers' rank-local distributed checkpoints, against transformers' own consolidation, bit for bit.

The fixture (``fixtures/runs/hf_distributed_tp2``, made by ``fixtures/make_hf_distributed_fixture.py`` with
torch's ``HuggingFaceStorageWriter(save_distributed=True)`` from 2 gloo processes) has tensors split on
either dimension, unevenly, one in bfloat16, and replicated ones written by one rank.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.distributed.checkpoint import consolidate_distributed_checkpoint

import ckptconv
from ckptconv.errors import MalformedCheckpointError, UnsupportedFormatError

from .conftest import FIXTURES, assert_same_tensor, run_cli

RUN = FIXTURES / "runs" / "hf_distributed_tp2"


@pytest.fixture(scope="module")
def consolidated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("consolidated")
    consolidate_distributed_checkpoint(str(RUN), str(out))
    return load_file(str(out / "model-00001-of-00001.safetensors"))


def test_reads_as_transformers_consolidates_it(consolidated: dict[str, torch.Tensor]) -> None:
    ours = ckptconv.load(RUN)
    assert sorted(ours) == sorted(consolidated)
    for key, tensor in consolidated.items():
        assert_same_tensor(ours[key], tensor, key)  # dtype (bfloat16 stays bfloat16), shape, every byte
    assert ours["head.weight"].dtype == torch.bfloat16


def test_convert_writes_the_consolidated_weights(consolidated: dict[str, torch.Tensor], tmp_path: Path) -> None:
    code, _, stderr = run_cli("convert", str(RUN), str(tmp_path / "model.safetensors"))
    assert code == 0, stderr
    written = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(written) == sorted(consolidated)
    for key, tensor in consolidated.items():
        assert_same_tensor(written[key], tensor, key)
    code, _, stderr = run_cli("convert", str(RUN), str(tmp_path / "bf16.safetensors"), "--dtype", "bf16")
    assert code == 0, stderr
    cast = load_file(str(tmp_path / "bf16.safetensors"))
    assert_same_tensor(cast["proj.weight"], consolidated["proj.weight"].to(torch.bfloat16))


def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    shutil.copytree(RUN, folder)
    return folder


def _rewrite(path: Path, change: object) -> None:
    """Re-save one rank file with its tensors and metadata changed by ``change(tensors, info)``."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 - safe_open is no dict
        metadata = dict(file.metadata())
    info = json.loads(metadata["DCP_SHARDING_INFO"])
    change(tensors, info)  # type: ignore[operator]
    metadata["DCP_SHARDING_INFO"] = json.dumps(info)
    save_file(tensors, str(path), metadata=metadata)


def test_a_missing_rank_is_a_hole_not_a_smaller_tensor(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    # Without rank 0, embed.weight's columns 0..3 are missing: its extent still says 8, from rank 1's offset.
    (folder / "shard-00001-model-00001-of-00001.safetensors").unlink()
    with pytest.raises(MalformedCheckpointError, match=r"the chunks of 'embed.weight' do not tile a float32 tensor"):
        ckptconv.load(folder)


def test_overlapping_chunks_are_refused(tmp_path: Path) -> None:
    folder = _copy(tmp_path)

    def overlap(tensors: dict[str, torch.Tensor], info: dict[str, dict[str, list[int]]]) -> None:
        info["proj.bias"]["saved_offsets"] = [6]  # rank 1's 6 rows now start where rank 0's last one is
        tensors["proj.bias"] = torch.cat([tensors["proj.bias"], torch.zeros(1)])  # and cover 13 in all

    _rewrite(folder / "shard-00002-model-00001-of-00001.safetensors", overlap)
    with pytest.raises(MalformedCheckpointError, match="overlap"):
        ckptconv.load(folder)


def test_a_file_without_offsets_is_refused_in_one_line(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    _rewrite(folder / "shard-00002-model-00001-of-00001.safetensors", lambda tensors, info: info.pop("norm.bias"))
    code, _, stderr = run_cli("convert", str(folder), str(tmp_path / "out.safetensors"))
    assert code == 1
    assert stderr == (
        f"ckptconv: error: '{folder / 'shard-00002-model-00001-of-00001.safetensors'}' is a damaged rank-local "
        "distributed checkpoint: DCP_SHARDING_INFO gives 'norm.bias' no offsets of 1 dims\n"
    )
    assert not (tmp_path / "out.safetensors").exists()


def test_rank_files_beside_their_consolidated_index_are_ambiguous(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    consolidate_distributed_checkpoint(str(folder))  # in place, as its default does
    with pytest.raises(UnsupportedFormatError, match="give the index to read the consolidated weights"):
        ckptconv.load(folder)
    index = folder / "model.safetensors.index.json"
    assert sorted(ckptconv.load(index)) == sorted(ckptconv.load(RUN))


def test_chunks_of_different_dimensions_are_refused_by_name(tmp_path: Path) -> None:
    """Before: an IndexError from the reader when the first rank's chunk had more dimensions than another's."""
    folder = _copy(tmp_path)

    def two_dims(tensors: dict[str, torch.Tensor], info: dict[str, dict[str, list[int]]]) -> None:
        tensors["proj.bias"] = tensors["proj.bias"].unsqueeze(1)
        info["proj.bias"]["saved_offsets"] = [0, 0]

    _rewrite(folder / "shard-00001-model-00001-of-00001.safetensors", two_dims)
    with pytest.raises(MalformedCheckpointError, match=r"the chunks of 'proj\.bias' have different numbers of dim"):
        ckptconv.load(folder)
