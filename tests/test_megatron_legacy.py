"""Legacy Megatron-LM checkpoints (``iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt``): the ranks merged.

``fixtures/runs/megatron_legacy_tp2`` was written by Megatron-LM's own ``generate_state_dict`` on
2 GPUs (TP=2). Its golden is ``fixtures/runs/megatron_tp2/golden_full.pt``: the generator builds both
with the same code, seed and sizes (``legacy_model`` and ``megatron_model``), and that golden is what
Megatron's own ``dist_checkpointing.load`` gave a TP=1 model; every one of its 29 tensors must equal
the merge bit for bit (which no wrong rule could do by chance). Gated MLPs and pipeline stages have no
real fixture yet: they are checked on rank files laid out as Megatron splits a model (each rank's
``linear_fc1`` is ``[gate_r; up_r]``; each stage numbers its layers from 0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptconv
from ckptconv.errors import UnsupportedFormatError
from ckptconv.reading.formats import megatron_legacy

from .conftest import FIXTURES, assert_same_state

RUNS = FIXTURES / "runs"
LEGACY = RUNS / "megatron_legacy_tp2"


def golden() -> dict[str, torch.Tensor]:
    return torch.load(RUNS / "megatron_tp2" / "golden_full.pt", map_location="cpu", weights_only=True)


@pytest.mark.parametrize("where", [LEGACY, LEGACY / "iter_0000003"])
def test_tensor_parallel_ranks_merge_to_what_megatron_loads_into_one_gpu(where: Path) -> None:
    checkpoint = ckptconv.open(where)
    assert checkpoint.format == "megatron-legacy"
    assert checkpoint.metadata["parallel"].startswith("tensor 2, pipeline 1")
    assert len(checkpoint.files) == 2
    assert_same_state(ckptconv.load(where), golden(), ordered=False)


def test_convert_writes_the_merged_model(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    ckptconv.convert(LEGACY, out)
    assert_same_state(load_file(out), golden(), ordered=False)


def _save_ranks(root: Path, ranks: dict[tuple[int, int], dict[str, torch.Tensor]], pp: int) -> Path:
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    for (tp, stage), model in ranks.items():
        name = f"mp_rank_{tp:02d}" + (f"_{stage:03d}" if pp > 1 else "")
        folder = root / "iter_0000007" / name
        folder.mkdir(parents=True)
        state: dict[str, Any] = {"checkpoint_version": 3.0, "iteration": 7, "model": model}
        torch.save(state, folder / "model_optim_rng.pt")
    return root


def test_a_gated_mlp_puts_the_gates_together_then_the_ups(tmp_path: Path) -> None:
    torch.manual_seed(0)
    gate, up, fc2 = torch.randn(8, 4), torch.randn(8, 4), torch.randn(4, 8)
    ranks = {}
    for r in range(2):  # ColumnParallelLinear over [gate; up] with --swiglu: each rank [gate_r; up_r]
        ranks[(r, 0)] = {
            "decoder.layers.0.mlp.linear_fc1.weight": torch.cat([gate[4 * r : 4 * r + 4], up[4 * r : 4 * r + 4]]),
            "decoder.layers.0.mlp.linear_fc2.weight": fc2[:, 4 * r : 4 * r + 4].clone(),
        }
    merged = ckptconv.load(_save_ranks(tmp_path, ranks, pp=1))
    assert torch.equal(merged["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate, up]))
    assert torch.equal(merged["decoder.layers.0.mlp.linear_fc2.weight"], fc2)


def test_pipeline_stages_number_their_layers_after_the_previous_stage(tmp_path: Path) -> None:
    norm = {i: torch.full((3,), float(i)) for i in range(4)}
    ranks = {
        (0, 0): {
            "embedding.word_embeddings.weight": torch.ones(5, 3),
            **{f"decoder.layers.{i}.input_layernorm.weight": norm[i] for i in range(2)},
        },
        (0, 1): {
            **{f"decoder.layers.{i}.input_layernorm.weight": norm[2 + i] for i in range(2)},
            "decoder.final_layernorm.weight": torch.zeros(3),
        },
    }
    merged = ckptconv.load(_save_ranks(tmp_path, ranks, pp=2))
    assert list(merged) == [
        "embedding.word_embeddings.weight",
        *[f"decoder.layers.{i}.input_layernorm.weight" for i in range(4)],
        "decoder.final_layernorm.weight",
    ]
    for i in range(4):
        assert torch.equal(merged[f"decoder.layers.{i}.input_layernorm.weight"], norm[i])


def test_a_name_no_rule_covers_is_refused_and_the_table_can_be_given(tmp_path: Path) -> None:
    ranks = {(r, 0): {"decoder.layers.0.mystery.weight": torch.full((2, 2), float(r))} for r in range(2)}
    run = _save_ranks(tmp_path, ranks, pp=1)
    with pytest.raises(UnsupportedFormatError, match="no partition rule says how the ranks split 1 name"):
        ckptconv.open(run)
    result = megatron_legacy.read(str(run), partitions=((r"mystery\.weight$", "row"),))
    merged = result.tree["model"]["decoder.layers.0.mystery.weight"].torch()
    assert torch.equal(merged, torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]]))


def test_ranks_that_disagree_are_refused(tmp_path: Path) -> None:
    ranks = {(r, 0): {"decoder.final_layernorm.weight": torch.zeros(3 + r)} for r in range(2)}
    with pytest.raises(ckptconv.MalformedCheckpointError, match="replicated but the ranks hold shapes"):
        ckptconv.open(_save_ranks(tmp_path, ranks, pp=1))


def test_batch_takes_the_run_folder_as_one_item(tmp_path: Path) -> None:
    import shutil

    shutil.copytree(LEGACY, tmp_path / "runs" / "legacy")
    report = ckptconv.batch(tmp_path / "runs", tmp_path / "out")
    (item,) = report.results
    assert (item.status, item.kind, item.source_format, item.tensors) == ("converted", "run", "megatron-legacy", 29)
    assert_same_state(load_file(tmp_path / "out" / item.output), golden(), ordered=False)
