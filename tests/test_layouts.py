"""Mixture-of-experts layouts both ways, against transformers' own files; coverage of a model folder's config.

For each family, a tiny model is saved by transformers in both layouts (``save_pretrained()``: per expert, its
default; ``save_original_format=False``: fused). ckptconv converts each into the other, and the output must
hold transformers' own file tensor for tensor (names, shapes, dtypes, bytes; read with the safetensors
library), load with ``from_pretrained`` with nothing missing or unexpected, and give the same logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .conftest import run_cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_COMMON = {
    "vocab_size": 64,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 24,
    "max_position_embeddings": 64,
}
FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 3, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 3,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": 12,
    },
    "qwen3_moe": {"num_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "head_dim": 8},
    "olmoe": {"num_experts": 3, "num_experts_per_tok": 2, "eos_token_id": 1, "pad_token_id": 0},
    "deepseek_v3": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "kv_lora_rank": 8,
        "q_lora_rank": 8,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 4,
        "v_head_dim": 4,
        "n_shared_experts": 1,
        "num_key_value_heads": 2,
        "rope_scaling": None,
    },
}
IDS = torch.tensor([[1, 5, 9, 3, 7, 2]])


def _saved(tmp_path: Path, model_type: str, **extra: Any) -> tuple[Any, Path, Path]:
    config = transformers.AutoConfig.for_model(model_type, **{**_COMMON, **FAMILIES[model_type], **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    per_expert, fused = tmp_path / "per_expert", tmp_path / "fused"
    model.save_pretrained(per_expert)
    model.save_pretrained(fused, save_original_format=False)
    return model, per_expert, fused


def _tensors(folder: Path) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for file in sorted(folder.glob("*.safetensors")):
        found.update(load_file(file))
    return found


def _assert_same_tensors(ours: Path, theirs: Path) -> None:
    a, b = _tensors(ours), _tensors(theirs)
    assert sorted(a) == sorted(b)
    for name in b:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


def _loads_clean_with_the_same_logits(folder: Path, model: Any) -> None:
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert {key: list(value) for key, value in info.items()} == {key: [] for key in info}
    with torch.no_grad():
        assert torch.equal(loaded.eval()(IDS).logits, model(IDS).logits)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_layout_converts_into_the_other_as_transformers_writes_it(model_type: str, tmp_path: Path) -> None:
    model, per_expert, fused = _saved(tmp_path, model_type)
    assert _tensors(per_expert).keys() != _tensors(fused).keys()  # the two layouts differ on disk
    for source, layout, twin in ((per_expert, "fused", fused), (fused, "per-expert", per_expert)):
        out = tmp_path / f"out_{layout}"
        code, _, err = run_cli("convert", str(source), f"{out}/", "--layout", layout)
        assert code == 0, err
        _assert_same_tensors(out, twin)
        assert json.loads((out / "config.json").read_text()) == json.loads((twin / "config.json").read_text())
        _loads_clean_with_the_same_logits(out, model)


def test_like_takes_the_base_models_layout(tmp_path: Path) -> None:
    _, per_expert, fused = _saved(tmp_path, "qwen3_moe")
    out = tmp_path / "out"
    code, _, err = run_cli("convert", str(fused), f"{out}/", "--like", str(per_expert))
    assert code == 0, err
    _assert_same_tensors(out, per_expert)


def test_gpt_oss_has_only_the_fused_layout(tmp_path: Path) -> None:
    config = transformers.AutoConfig.for_model(
        "gpt_oss",
        **{**_COMMON, "num_local_experts": 3, "num_experts_per_tok": 2, "head_dim": 8},
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "src")
    code, _, err = run_cli("convert", str(tmp_path / "src"), f"{tmp_path / 'out'}/", "--layout", "per-expert")
    assert code == 1
    assert err == "ckptconv: error: gpt_oss has no per-expert layout in transformers; its experts stay fused\n"
    code, _, err = run_cli("convert", str(tmp_path / "src"), f"{tmp_path / 'out'}/", "--layout", "fused")
    assert code == 0, err
    _assert_same_tensors(tmp_path / "out", tmp_path / "src")


def _without(folder: Path, name: str) -> None:
    state = load_file(folder / "model.safetensors")
    del state[name]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("layout", ["keep", "fused", "per-expert"])
def test_a_source_missing_one_experts_tensor_is_refused_naming_it(layout: str, tmp_path: Path) -> None:
    _, per_expert, _ = _saved(tmp_path, "qwen3_moe")
    _without(per_expert, "model.layers.1.mlp.experts.2.up_proj.weight")
    code, _, err = run_cli("convert", str(per_expert), f"{tmp_path / 'out'}/", "--layout", layout)
    assert code == 1 and "\n" not in err.rstrip("\n")
    assert "model.layers.1.mlp.experts.2.up_proj.weight" in err
    assert not (tmp_path / "out").exists()


def test_allow_missing_writes_it_anyway_with_the_list_in_the_provenance(tmp_path: Path) -> None:
    _, per_expert, _ = _saved(tmp_path, "mixtral")
    _without(per_expert, "model.layers.0.block_sparse_moe.experts.1.w2.weight")
    out = tmp_path / "out"
    code, _, err = run_cli("convert", str(per_expert), f"{out}/", "--allow-missing")
    assert code == 0, err
    assert "lacks model.layers.0.mlp.experts.1.w2.weight" in err
    with safe_open(str(out / "model.safetensors"), "pt") as file:
        assert "experts.1.w2.weight" in (file.metadata() or {})["ckptconv.transforms"]


def test_a_fused_source_missing_a_layer_is_refused(tmp_path: Path) -> None:
    _, _, fused = _saved(tmp_path, "olmoe")
    _without(fused, "model.layers.1.mlp.experts.down_proj")
    code, _, err = run_cli("convert", str(fused), f"{tmp_path / 'out'}/")
    assert code == 1
    assert err == (
        "ckptconv: error: the weights do not make the config's olmoe model (transformers "
        f"{transformers.__version__}): it lacks model.layers.1.mlp.experts.down_proj; pass --allow-missing to "
        "write it anyway\n"
    )


def test_a_wrong_shape_and_an_unexpected_tensor_are_refused(tmp_path: Path) -> None:
    _, per_expert, _ = _saved(tmp_path, "qwen2_moe")
    state = load_file(per_expert / "model.safetensors")
    state["model.norm.weight"] = torch.zeros(17)
    state["model.layers.0.mlp.mystery.weight"] = torch.zeros(2)
    save_file(state, str(per_expert / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = run_cli("convert", str(per_expert), f"{tmp_path / 'out'}/")
    assert code == 1
    assert "has what the model has no place for: model.layers.0.mlp.mystery.weight" in err
    assert "has the wrong shape: model.norm.weight [17] (config: [16])" in err


def test_tied_heads_are_not_missing(tmp_path: Path) -> None:
    model, per_expert, fused = _saved(tmp_path, "qwen3_moe", tie_word_embeddings=True)
    assert "lm_head.weight" not in _tensors(per_expert)
    code, _, err = run_cli("convert", str(per_expert), f"{tmp_path / 'out'}/", "--layout", "fused")
    assert code == 0, err
    _assert_same_tensors(tmp_path / "out", fused)
    _loads_clean_with_the_same_logits(tmp_path / "out", model)


def test_an_expert_tensor_the_other_layout_has_no_place_for_is_refused_in_one_line(tmp_path: Path) -> None:
    _, per_expert, _ = _saved(tmp_path, "qwen3_moe")
    state = load_file(per_expert / "model.safetensors")
    state["model.layers.0.mlp.experts.0.gate_proj.bias"] = torch.ones(8)  # Qwen3-MoE's experts have none
    save_file(state, str(per_expert / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = run_cli("convert", str(per_expert), f"{tmp_path / 'out'}/", "--layout", "fused")
    assert (code, err) == (
        1,
        "ckptconv: error: cannot move model.layers.0.mlp.experts.0.gate_proj.bias to the fused "
        "layout (quantized experts' scales, or a tensor transformers has no place for); dequantize first "
        "(--dtype bf16) or keep the layout\n",
    )


def test_a_source_holding_both_layouts_is_refused(tmp_path: Path) -> None:
    _, per_expert, fused = _saved(tmp_path, "qwen3_moe")
    shutil.copy(fused / "model.safetensors", per_expert / "model.safetensors")
    state = load_file(per_expert / "model.safetensors")
    state["model.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(8, 16)
    save_file(state, str(per_expert / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = run_cli("convert", str(per_expert), f"{tmp_path / 'out'}/", "--layout", "per-expert")
    assert (code, err) == (
        1,
        "ckptconv: error: the source holds experts both fused and per expert; give it one layout\n",
    )


def test_inspect_says_the_layout_and_whether_the_folder_covers_its_config(tmp_path: Path) -> None:
    _, per_expert, fused = _saved(tmp_path, "qwen3_moe")
    lines = []
    for folder in (per_expert, fused):
        code, out, _ = run_cli("inspect", str(folder))
        assert code == 0
        lines += [line for line in out.splitlines() if line.startswith("  weights: ")]
    _without(per_expert, "model.layers.1.mlp.experts.2.up_proj.weight")
    code, out, _ = run_cli("inspect", str(per_expert))
    lines += [line for line in out.splitlines() if line.startswith("  weights: ")]
    assert lines == [  # in the model block inspect prints (see test_model_units)
        "  weights: experts one per expert; covers its config's model",
        "  weights: experts fused; covers its config's model",
        "  weights: experts one per expert; the weights do not make the config's qwen3_moe model (transformers "
        f"{transformers.__version__}): it lacks model.layers.1.mlp.experts.2.up_proj.weight",
    ]


def _vision_language(tmp_path: Path) -> tuple[Any, Path, Path]:
    """A tiny Qwen2-VL saved as transformers before 5 spelled it (``visual.*``, ``model.*``) and as 5 holds it
    (``model.visual.*``, ``model.language_model.*``)."""
    config = transformers.AutoConfig.for_model(
        "qwen2_vl",
        text_config={**_COMMON, "num_hidden_layers": 1, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
        vision_config={"depth": 1, "embed_dim": 16, "hidden_size": 16, "num_heads": 2, "mlp_ratio": 2,
                       "patch_size": 2, "spatial_merge_size": 1, "temporal_patch_size": 1, "in_channels": 3},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    old, new = tmp_path / "old", tmp_path / "new"
    model.save_pretrained(old)
    model.save_pretrained(new, save_original_format=False)
    return model, old, new


def test_names_spelled_two_ways_take_like_s_spelling(tmp_path: Path) -> None:
    _, old, new = _vision_language(tmp_path)
    assert any(name.startswith("visual.") for name in _tensors(old))
    assert any(name.startswith("model.visual.") for name in _tensors(new))
    for source, like in ((old, new), (new, old)):
        out = tmp_path / f"out_{like.name}"
        code, _, err = run_cli("convert", str(source), f"{out}/", "--like", str(like))
        assert code == 0, err
        _assert_same_tensors(out, like)
        _, info = transformers.Qwen2VLForConditionalGeneration.from_pretrained(out, output_loading_info=True)
        assert {key: list(value) for key, value in info.items()} == {key: [] for key in info}


def test_a_vision_tower_left_behind_is_refused(tmp_path: Path) -> None:
    _, old, _ = _vision_language(tmp_path)
    state = {k: v for k, v in load_file(old / "model.safetensors").items() if not k.startswith("visual.")}
    save_file(state, str(old / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = run_cli("convert", str(old), f"{tmp_path / 'out'}/")
    assert code == 1
    assert err.startswith(
        "ckptconv: error: the weights do not make the config's qwen2_vl model (transformers "
        f"{transformers.__version__}): it lacks model.visual.patch_embed.proj.weight, "
        "model.visual.blocks.0.norm1.weight"
    )
    assert not (tmp_path / "out").exists()


def test_fp8_block_experts_move_with_their_scales_as_transformers_holds_them(tmp_path: Path) -> None:
    """fp8 blocks (ckptconv --quantize fp8-block, as transformers' quantizer writes them) per expert, fused, and back:
    the fused folder holds exactly the parameters transformers' fp8 model has (names, shapes, dtypes: its quantizer
    on the meta device; transformers 5.25 on a CPU cannot load fused fp8 experts to compare logits), and the way
    back gives the per-expert folder bit for bit."""
    from transformers.quantizers.auto import AutoHfQuantizer

    config = transformers.AutoConfig.for_model(
        "qwen3_moe",
        **{**_COMMON, "hidden_size": 128, "head_dim": 64, "intermediate_size": 128, "num_hidden_layers": 1},
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=128,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "src")
    per_expert, fused, back = tmp_path / "fp8", tmp_path / "fused", tmp_path / "back"
    assert run_cli("convert", str(tmp_path / "src"), f"{per_expert}/", "--quantize", "fp8-block")[0] == 0
    code, _, err = run_cli("convert", str(per_expert), f"{fused}/", "--layout", "fused")
    assert code == 0, err
    quantized = transformers.AutoConfig.from_pretrained(fused)
    quantizer = AutoHfQuantizer.from_config(quantized.quantization_config, pre_quantized=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(quantized)
    quantizer.preprocess_model(model, config=quantized)
    theirs = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    ours = {name: (tuple(t.shape), t.dtype) for name, t in _tensors(fused).items()}
    assert ours == theirs
    assert ours["model.layers.0.mlp.experts.gate_up_proj_scale_inv"] == ((2, 2, 1), torch.float32)
    code, _, err = run_cli("convert", str(fused), f"{back}/", "--layout", "per-expert")
    assert code == 0, err
    _assert_same_tensors(back, per_expert)


def test_a_folder_s_own_code_is_never_run_to_check_coverage(tmp_path: Path) -> None:
    """A config naming remote code (auto_map) and a model_type transformers does not know: the code is not
    imported, the check says it could not tell, and the conversion goes on."""
    folder = tmp_path / "custom"
    folder.mkdir()
    marker = tmp_path / "ran"
    (folder / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (folder / "configuration_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = {"model_type": "evil", "hidden_size": 4, "architectures": ["EvilForCausalLM"],
              "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                           "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"w": torch.zeros(4)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = run_cli("convert", str(folder), f"{tmp_path / 'out'}/")
    assert code == 0, err
    assert "note: coverage not checked: neither transformers nor ckptconv knows model_type 'evil'" in err
    assert not marker.exists()


def test_without_transformers_ckptconv_s_own_tables_say_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    import importlib

    from ckptconv.architectures import coverage

    _, per_expert, _ = _saved(tmp_path, "qwen3_moe")
    _without(per_expert, "model.layers.1.mlp.experts.0.down_proj.weight")
    real = importlib.import_module

    def no_transformers(name: str, *args: Any) -> Any:
        if name.startswith("transformers"):
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(coverage.importlib, "import_module", no_transformers)
    coverage._expected.cache_clear()
    request.addfinalizer(coverage._expected.cache_clear)  # no later test may see what was built without it
    code, _, err = run_cli("convert", str(per_expert), f"{tmp_path / 'out'}/")
    assert (code, err) == (
        1,
        "ckptconv: error: the weights do not make the config's qwen3_moe model (ckptconv's tables): it lacks "
        "model.layers.1.mlp.experts.0.down_proj.weight; pass --allow-missing to write it anyway\n",
    )


def test_what_older_checkpoints_hold_and_transformers_leaves_alone_is_not_refused(tmp_path: Path) -> None:
    """Hub checkpoints saved by older versions: GPT-2 without the ``transformer.`` prefix and with its ``attn.bias``
    masks (transformers' ``_keys_to_ignore_on_load_unexpected``), Llama with a ``rotary_emb.inv_freq`` per layer (a
    buffer the model now keeps once, unsaved). transformers loads both; so does the check."""
    gpt2 = transformers.AutoConfig.for_model("gpt2", vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    llama = transformers.AutoConfig.for_model("llama", **_COMMON)
    for name, config, extra in (
        ("gpt2", gpt2, {"transformer.h.0.attn.bias": torch.ones(1, 1, 16, 16)}),
        ("llama", llama, {"model.layers.1.self_attn.rotary_emb.inv_freq": torch.ones(4)}),
    ):
        folder = tmp_path / name
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        state = {**load_file(folder / "model.safetensors"), **extra}
        state = {key.removeprefix("transformer."): tensor for key, tensor in state.items()}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        code, _, err = run_cli("convert", str(folder), f"{tmp_path / name}_out/")
        assert code == 0, err
        _assert_same_tensors(tmp_path / f"{name}_out", folder)


def test_dequantized_fp8_experts_are_fused_as_transformers_holds_them(tmp_path: Path) -> None:
    """``--dtype bf16 --layout fused`` on per-expert fp8 blocks: the experts are dequantized first, then fused, equal
    tensor for tensor to what transformers writes after loading the fp8 folder on a CPU (it dequantizes to bf16) and
    saving it fused."""
    config = transformers.AutoConfig.for_model(
        "qwen3_moe",
        **{**_COMMON, "hidden_size": 128, "head_dim": 64, "intermediate_size": 128, "num_hidden_layers": 1},
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=128,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "src")
    fp8 = tmp_path / "fp8"
    assert run_cli("convert", str(tmp_path / "src"), f"{fp8}/", "--quantize", "fp8-block")[0] == 0
    code, _, err = run_cli("convert", str(fp8), f"{tmp_path / 'out'}/", "--dtype", "bf16", "--layout", "fused")
    assert code == 0, err
    # transformers dequantizes an fp8 folder as it loads it on a CPU-only machine; on a GPU machine it is asked to.
    dequantize = transformers.FineGrainedFP8Config(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.bfloat16, quantization_config=dequantize)
    model.save_pretrained(tmp_path / "theirs", save_original_format=False)
    _assert_same_tensors(tmp_path / "out", tmp_path / "theirs")


def test_verify_with_torch_runs_the_layout_move_again(tmp_path: Path) -> None:
    _, per_expert, fused = _saved(tmp_path, "mixtral")
    out = tmp_path / "out"
    code, _, err = run_cli("convert", str(per_expert), f"{out}/", "--layout", "fused", "--verify=torch")
    assert code == 0, err
    _assert_same_tensors(out, fused)
