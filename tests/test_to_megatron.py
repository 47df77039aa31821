"""HF -> Megatron-Core: the family tables run backwards, and the ``torch_dist`` folder megatron-core reads.

Every comparison is against an independent reader of the fixtures (Megatron-Core 0.19.2's own ``torch_dist``
saves): torch's ``dcp_to_torch_save`` then ``torch.load``, and megatron-core's ``load_plain_tensors`` where it is
installed; never ckptconv's reader on both sides.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import ckptconv
from ckptconv.architectures.mapping import to_hugging_face, to_megatron
from ckptconv.errors import TransformError

torch = pytest.importorskip("torch")
format_utils = pytest.importorskip("torch.distributed.checkpoint.format_utils")

RUNS = Path(__file__).resolve().parent.parent / "fixtures" / "runs"
FIXTURES = ["megatron_llama", "megatron_mixtral", "megatron_qwen3_moe"]
PADDED = ("embedding.word_embeddings.weight", "output_layer.weight")


def _torch_read(folder: Path, tmp_path: Path) -> dict[str, Any]:
    """The folder's tensors as torch's own DCP reader gives them (``_extra_state`` bytes left out)."""
    out = tmp_path / f"{folder.name}.pt"
    format_utils.dcp_to_torch_save(str(folder), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _bits(tensor: Any) -> Any:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _equal(got: dict[str, Any], want: dict[str, Any], vocab: int) -> None:
    """Every tensor bit for bit; the vocabulary's padding rows (which HF never holds) are zeros in ``got``."""
    assert sorted(got) == sorted(want)
    for name, expected in want.items():
        value = got[name]
        assert value.dtype == expected.dtype and value.shape == expected.shape, name
        if name in PADDED:
            assert torch.equal(_bits(value[:vocab]), _bits(expected[:vocab])), name
            assert not value[vocab:].any(), name
        else:
            assert torch.equal(_bits(value), _bits(expected)), name


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
@pytest.mark.parametrize("fixture", FIXTURES)
def test_megatron_to_hf_to_megatron_is_bit_exact(fixture: str, layout: str, tmp_path: Path) -> None:
    folder = RUNS / fixture
    config = json.loads((folder / "config.json").read_text())
    want = _torch_read(folder, tmp_path)
    hf = to_hugging_face(ckptconv.open(str(folder)).select().weights, config, experts=layout)
    padded = want["embedding.word_embeddings.weight"].shape[0]
    assert padded > config["vocab_size"]  # the fixtures are padded: the test covers the padding rows
    back = to_megatron(hf, config, padded_vocab_size=padded)
    _equal({name: ref.torch() for name, ref in back.items()}, want, config["vocab_size"])


def test_without_padding_the_vocabulary_keeps_its_rows(tmp_path: Path) -> None:
    folder = RUNS / "megatron_llama"
    config = json.loads((folder / "config.json").read_text())
    hf = to_hugging_face(ckptconv.open(str(folder)).select().weights, config)
    back = to_megatron(hf, config)
    assert back["embedding.word_embeddings.weight"].shape == (config["vocab_size"], config["hidden_size"])
    with pytest.raises(TransformError, match="padded_vocab_size 99 is below the config's vocab_size 100"):
        to_megatron(hf, config, padded_vocab_size=99)


def test_a_missing_or_unknown_tensor_is_refused_by_name() -> None:
    folder = RUNS / "megatron_mixtral"
    config = json.loads((folder / "config.json").read_text())
    hf = to_hugging_face(ckptconv.open(str(folder)).select().weights, config, experts="per_expert")
    lacking = {k: v for k, v in hf.items() if k != "model.layers.1.block_sparse_moe.experts.3.w2.weight"}
    with pytest.raises(TransformError, match=r"lack model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight"):
        to_megatron(lacking, config)
    extra = dict(hf, **{"model.layers.0.extra.weight": hf["model.norm.weight"]})
    with pytest.raises(TransformError, match=r"hold model\.layers\.0\.extra\.weight, which it has no place for"):
        to_megatron(extra, config)
