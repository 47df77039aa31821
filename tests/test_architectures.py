"""Megatron-Core checkpoints mapped to Hugging Face models, checked against Megatron's own forward.

The fixtures (``fixtures/runs/megatron_{llama,mixtral,qwen3_moe}``, made by
``fixtures/make_megatron_hf_fixtures.py`` with megatron-core 0.19.2 on an H200) hold a ``torch_dist``
checkpoint, the equivalent ``config.json`` made by transformers, and ``golden_logits.pt``: Megatron's
float32 logits on fixed ids. The oracle is that forward, never the mapping: the mapped weights are
loaded into transformers' model (strictly) and its logits must match to 1e-5 (float32, CPU vs GPU
kernels; measured about 6e-7).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

import ckptconv
from ckptconv.architectures import to_hugging_face
from ckptconv.architectures.operations import Window
from ckptconv.errors import TransformError
from ckptconv.gpu.torch_tensors import from_torch

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

RUNS = Path(__file__).resolve().parent.parent / "fixtures" / "runs"
TOLERANCE = 1e-5
MODELS = ["megatron_llama", "megatron_mixtral", "megatron_qwen3_moe"]


def _fixture(name: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    folder = RUNS / name
    config = json.loads((folder / "config.json").read_text())
    weights = ckptconv.open(folder).select().weights
    golden = torch.load(folder / "golden_logits.pt", map_location="cpu", weights_only=True)
    return config, weights, golden


def _model(config: dict[str, Any]) -> Any:
    fields = {k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"}
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**fields)).eval()


def _difference(model: Any, config: dict[str, Any], golden: dict[str, Any]) -> float:
    with torch.no_grad():
        logits = model(golden["input_ids"]).logits
    megatron = golden["logits"][..., : config["vocab_size"]]  # the padded rows are Megatron's alone
    assert logits.shape == megatron.shape
    return float((logits - megatron).abs().max())


@pytest.mark.parametrize("name", MODELS)
def test_mapped_weights_load_strictly_and_give_megatrons_logits(name: str) -> None:
    config, weights, golden = _fixture(name)
    mapped = to_hugging_face(weights, config, experts="fused")
    model = _model(config)
    model.load_state_dict({k: v.torch() for k, v in mapped.items()}, strict=True)
    assert _difference(model, config, golden) < TOLERANCE


@pytest.mark.parametrize("name", MODELS)
def test_the_fused_layout_written_by_ckptconv_loads_strictly(name: str, tmp_path: Path) -> None:
    config, weights, golden = _fixture(name)
    out = tmp_path / "model.safetensors"
    ckptconv.save(to_hugging_face(weights, config, reference_names=["x.mlp.experts.gate_up_proj"]), out)
    model = _model(config)
    model.load_state_dict(load_file(out), strict=True)
    assert _difference(model, config, golden) < TOLERANCE


@pytest.mark.parametrize("name", ["megatron_mixtral", "megatron_qwen3_moe"])
def test_per_expert_layout_written_by_ckptconv_loads_with_from_pretrained(name: str, tmp_path: Path) -> None:
    config, weights, golden = _fixture(name)
    mapped = to_hugging_face(weights, config)  # no reference: the Hub's per-expert layout
    assert any(".experts.0." in key for key in mapped)
    ckptconv.save(mapped, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert {k: list(v) for k, v in info.items() if k != "error_msgs"} == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
    }
    assert not info.get("error_msgs")
    assert _difference(model.eval(), config, golden) < TOLERANCE


def test_renames_and_row_blocks_are_views_and_the_vocabulary_is_unpadded() -> None:
    config, weights, _ = _fixture("megatron_llama")
    mapped = to_hugging_face(weights, config)
    assert mapped["model.norm.weight"] is weights["decoder.final_layernorm.weight"]
    assert isinstance(mapped["model.layers.0.mlp.up_proj.weight"].storage.source, Window)
    assert mapped["model.embed_tokens.weight"].shape == (100, 64)
    assert torch.equal(mapped["lm_head.weight"].torch(), weights["output_layer.weight"].torch()[:100])
    fc1 = weights["decoder.layers.1.mlp.linear_fc1.weight"].torch()
    assert torch.equal(mapped["model.layers.1.mlp.gate_proj.weight"].torch(), fc1[:96])
    assert torch.equal(mapped["model.layers.1.mlp.up_proj.weight"].torch(), fc1[96:])


def test_the_local_spec_names_of_a_state_dict_map_the_same() -> None:
    config, weights, _ = _fixture("megatron_mixtral")
    local = {}
    for saved, ref in weights.items():  # as GPTModel.state_dict() names them with the local spec
        key = saved.replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
        key = key.replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")
        if ".mlp.experts.experts." in key:
            for e in range(ref.shape[0]):
                local[key.replace("experts.experts.", f"experts.local_experts.{e}.")] = ref.torch()[e]
            continue
        local[key] = ref
    a = to_hugging_face(weights, config, experts="fused")
    b = to_hugging_face(_as_refs(local), config, experts="fused")
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key].torch(), b[key].torch()), key


def _as_refs(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (from_torch(v.clone()) if torch.is_tensor(v) else v) for k, v in state.items()}


def test_tying_follows_the_config() -> None:
    config, weights, _ = _fixture("megatron_llama")
    with pytest.raises(TransformError, match=r"output_layer\.weight of its own"):
        to_hugging_face(weights, {**config, "tie_word_embeddings": True})
    shared = {k: v for k, v in weights.items() if k != "output_layer.weight"}  # as Megatron saves a tied model
    tied = to_hugging_face(shared, {**config, "tie_word_embeddings": True})
    assert "lm_head.weight" not in tied
    untied = to_hugging_face(shared, config)
    assert torch.equal(untied["lm_head.weight"].torch(), untied["model.embed_tokens.weight"].torch())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "no Megatron-Core table for model_type 'gpt2'"),
        ({"num_key_value_heads": 4}, "linear_qkv.weight has shape \\[128, 64\\]"),
        ({"vocab_size": 150}, "fewer than the config's vocab_size=150"),
        ({"intermediate_size": 64}, "sizes disagree with the config"),
        ({"num_hidden_layers": 3}, "lacks model.layers.2"),
        ({"num_hidden_layers": 1}, "has no place for"),
    ],
)
def test_what_it_cannot_map_is_refused_in_one_line(change: dict[str, Any], message: str) -> None:
    config, weights, _ = _fixture("megatron_llama")
    with pytest.raises(TransformError, match=message) as caught:
        to_hugging_face(weights, {**config, **change})
    assert "\n" not in str(caught.value)


def test_an_unknown_name_is_refused() -> None:
    config, weights, _ = _fixture("megatron_llama")
    extra = {**weights, "decoder.layers.0.self_attention.mystery.weight": weights["decoder.final_layernorm.weight"]}
    with pytest.raises(TransformError, match="no rule maps 1 Megatron name"):
        to_hugging_face(extra, config)


def test_a_qkv_split_is_computed_from_the_interleaved_groups() -> None:
    config, weights, _ = _fixture("megatron_llama")
    mapped = to_hugging_face(weights, config)
    qkv = weights["decoder.layers.0.self_attention.linear_qkv.weight"].torch().reshape(2, 4, 16, 64)
    q, k, v = (mapped[f"model.layers.0.self_attn.{p}_proj.weight"].torch() for p in "qkv")
    assert torch.equal(q, qkv[:, :2].reshape(64, 64))
    assert torch.equal(k, qkv[:, 2].reshape(32, 64))
    assert torch.equal(v, qkv[:, 3].reshape(32, 64))
    assert dataclasses.is_dataclass(mapped["model.layers.0.self_attn.k_proj.weight"].storage.source)


@pytest.mark.parametrize("name", MODELS)
def test_convert_like_a_base_model_folder_gives_a_model_transformers_loads(name: str, tmp_path: Path) -> None:
    """The command users type: ``ckptconv convert megatron_run/ out/ --like hf_base_model/``; the output folder loads
    with from_pretrained, nothing missing or unexpected, and gives Megatron's own logits."""
    from .conftest import run_cli

    config, _, golden = _fixture(name)
    base = tmp_path / "base"
    _model(config).save_pretrained(base)
    code, _, err = run_cli("convert", str(RUNS / name), str(tmp_path / "out") + "/", "--like", str(base))
    assert code == 0, err
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert {key: list(value) for key, value in info.items()} == {key: [] for key in info}
    assert _difference(model.eval(), config, golden) <= TOLERANCE
