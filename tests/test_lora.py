"""merge-lora: every tensor bit for bit as PEFT's merge_and_unload(), and the logits of the merged model.

The reference is PEFT itself: the base loaded with transformers in its dtype, the adapter with
PeftModel.from_pretrained, merged with merge_and_unload(); ckptconv's output is read back with the
safetensors library and with transformers' from_pretrained (no missing or unexpected keys).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import ckptconv  # noqa: E402
from ckptconv.cli import cli as main  # noqa: E402
from ckptconv.errors import TransformError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def _llama(dtype: Any, tie: bool = False) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype)


def _gpt2(dtype: Any) -> Any:
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(dtype)


def _save(model: Any, tmp_path: Path, lora: Any, *, shard: str | None = None, name: str = "adapter") -> tuple[str, str]:
    """The base folder and the adapter folder, the adapter's LoRA weights random (B starts at zero)."""
    base, adapter = str(tmp_path / "base"), str(tmp_path / name)
    if not os.path.exists(base):
        model.save_pretrained(base, **({"max_shard_size": shard} if shard else {}))
    wrapped = peft.get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, parameter in wrapped.named_parameters():
            if "lora_" in key:
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float32) * 0.5 + 0.1)
    wrapped.save_pretrained(adapter)
    return base, adapter


def _peft_merged(base: str, adapters: list[str], model_class: Any, dtype: Any) -> Any:
    model = model_class.from_pretrained(base, dtype=dtype)
    wrapped = peft.PeftModel.from_pretrained(model, adapters[0], adapter_name="a0")
    for i, adapter in enumerate(adapters[1:], 1):
        wrapped.load_adapter(adapter, adapter_name=f"a{i}")
    wrapped.base_model.set_adapter([f"a{i}" for i in range(len(adapters))])
    return wrapped.merge_and_unload()


def _check(out: str, merged: Any, model_class: Any, dtype: Any) -> None:
    from safetensors.torch import load_file

    ours: dict[str, Any] = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            ours.update(load_file(os.path.join(out, name)))
    reference = merged.state_dict()
    # Tied weights: transformers saves one of each group; every key written is PEFT's, bit for bit.
    assert set(ours) <= set(reference)
    assert set(reference) - set(ours) <= {"lm_head.weight"}
    for key, value in ours.items():
        assert value.dtype == reference[key].dtype, key
        assert torch.equal(value, reference[key]), key
    loaded, info = model_class.from_pretrained(out, dtype=dtype, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.arange(12).reshape(2, 6) % 64
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, merged(ids).logits)


_LLAMA_TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
_CASES = {
    "lora-bf16-sharded-embedding-modules_to_save": (
        torch.bfloat16,
        {"target_modules": [*_LLAMA_TARGETS, "embed_tokens"], "modules_to_save": ["lm_head"]},
        "4KB",
    ),
    "rslora-fp32-patterns": (
        torch.float32,
        {
            "target_modules": _LLAMA_TARGETS,
            "use_rslora": True,
            "rank_pattern": {"layers.1.self_attn.q_proj": 2, "down_proj": 6},
            "alpha_pattern": {"o_proj": 3.5},
        },
        None,
    ),
    "dora-bf16-embedding": (
        torch.bfloat16,
        {"target_modules": [*_LLAMA_TARGETS, "embed_tokens"], "use_dora": True},
        None,
    ),
    "dora-fp32": (torch.float32, {"target_modules": _LLAMA_TARGETS, "use_dora": True, "use_rslora": True}, None),
    "lora-fp16-bias": (torch.float16, {"target_modules": ["q_proj", "o_proj"], "lora_bias": True}, None),
    "tied-embedding-bf16": (torch.bfloat16, {"target_modules": ["embed_tokens", "v_proj"]}, None),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_merge_lora_llama_is_peft_bit_for_bit(tmp_path: Path, case: str) -> None:
    dtype, settings, shard = _CASES[case]
    model = _llama(dtype, tie=case.startswith("tied"))  # tied: lm_head is the embedding PEFT merges into
    if settings.get("lora_bias"):  # Llama's projections have no bias: give o_proj and q_proj one
        model.config.attention_bias = True
        model = transformers.LlamaForCausalLM(model.config).to(dtype)
    base, adapter = _save(model, tmp_path, peft.LoraConfig(r=4, lora_alpha=8, **settings), shard=shard)
    out = str(tmp_path / "out")
    report = ckptconv.merge_lora(base, adapter, out + "/", **({"max_shard_size": 4096} if shard else {}))
    assert report.tensors > 0
    if shard:
        assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
        assert len([name for name in os.listdir(base) if name.endswith(".safetensors")]) > 1  # the base is sharded
    _check(
        out, _peft_merged(base, [adapter], transformers.LlamaForCausalLM, dtype), transformers.LlamaForCausalLM, dtype
    )


@pytest.mark.parametrize(("dtype", "dora"), [(torch.bfloat16, False), (torch.float32, True)])
def test_merge_lora_gpt2_conv1d_fan_in_fan_out(tmp_path: Path, dtype: Any, dora: bool) -> None:
    # c_attn is (32, 96): the shape says Conv1D; c_proj is (32, 32): only the architecture does.
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"], use_dora=dora, fan_in_fan_out=True
    )
    base, adapter = _save(_gpt2(dtype), tmp_path, lora)
    out = str(tmp_path / "out")
    ckptconv.merge_lora(base, adapter, out + "/")
    _check(out, _peft_merged(base, [adapter], transformers.GPT2LMHeadModel, dtype), transformers.GPT2LMHeadModel, dtype)


def test_merge_lora_cli_bin_base_and_adapter_records_provenance(tmp_path: Path) -> None:
    dtype = torch.bfloat16
    model = _llama(dtype)
    base, adapter = str(tmp_path / "base"), str(tmp_path / "adapter")
    model.save_pretrained(base)
    # The base as a .bin model folder, the adapter as adapter_model.bin (torch.save): both read without pickle code.
    from safetensors.torch import load_file

    torch.save(load_file(os.path.join(base, "model.safetensors")), os.path.join(base, "pytorch_model.bin"))
    os.remove(os.path.join(base, "model.safetensors"))
    _, adapter = _save(model, tmp_path, peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj"]))
    torch.save(
        load_file(os.path.join(adapter, "adapter_model.safetensors")), os.path.join(adapter, "adapter_model.bin")
    )
    os.remove(os.path.join(adapter, "adapter_model.safetensors"))
    out = str(tmp_path / "out")
    result = CliRunner().invoke(main, ["merge-lora", base, adapter, out + "/", "--verify"])
    assert result.exit_code == 0, result.output
    assert "merged LoRA 'adapter' into 4 weights" in result.output
    _check(
        out, _peft_merged(base, [adapter], transformers.LlamaForCausalLM, dtype), transformers.LlamaForCausalLM, dtype
    )
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), "pt") as file:
        described = json.loads(file.metadata()["ckptconv.transforms"])
    assert described[0].startswith("merge LoRA 'adapter' (sha256 ")
    assert "scaling 4.0" in described[0]


def test_merge_lora_dtype_casts_after_the_merge(tmp_path: Path) -> None:
    # --dtype bf16 on an fp32 base: PEFT merges in fp32 (the base's dtype), then the model is cast.
    model = _llama(torch.float32)
    base, adapter = _save(model, tmp_path, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    out = str(tmp_path / "out")
    ckptconv.merge_lora(base, adapter, out + "/", transforms=[ckptconv.Cast("bf16")])
    merged = _peft_merged(base, [adapter], transformers.LlamaForCausalLM, torch.float32).to(torch.bfloat16)
    # Loaded in bf16, as from_pretrained(out) is (.to() would also cast the rotary inv_freq buffer).
    reference = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    reference.load_state_dict(merged.state_dict())
    _check(out, reference, transformers.LlamaForCausalLM, torch.bfloat16)


def test_merge_two_adapters_in_turn_is_peft_with_both_active(tmp_path: Path) -> None:
    dtype = torch.bfloat16
    model = _llama(dtype)
    base, first = _save(model, tmp_path, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    _, second = _save(
        _llama(dtype), tmp_path, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj", "o_proj"]), name="second"
    )
    out = str(tmp_path / "out")
    result = CliRunner().invoke(main, ["merge-lora", base, first, out + "/", "--adapter", second])
    assert result.exit_code == 0, result.output
    _check(
        out,
        _peft_merged(base, [first, second], transformers.LlamaForCausalLM, dtype),
        transformers.LlamaForCausalLM,
        dtype,
    )


def _config(adapter: str, **changes: Any) -> None:
    path = os.path.join(adapter, "adapter_config.json")
    config = json.loads(Path(path).read_text())
    config.update(changes)
    with open(path, "w") as file:
        json.dump(config, file)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa' changes the base weights when PEFT loads"),
        ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication (layers duplicated when PEFT loads the adapter)"),
        ({"r": -1}, "r is -1, not a positive integer"),
        ({"lora_alpha": float("nan")}, "lora_alpha is nan, not a positive number"),
        ({"rank_pattern": {"(a+)+$": 2}}, "ckptconv does not evaluate other regular expressions"),
        ({"peft_type": "IA3"}, "peft_type is 'IA3'; ckptconv merges LORA adapters only"),
        ({"use_dora": True}, "lacks a DoRA magnitude vector while the config sets use_dora"),
        ({"rank_pattern": {"q_proj": 3}}, "which is not a rank-3 LoRA"),
        ({"brand_new_variant": {"x": 1}}, "a setting ckptconv does not know"),
    ],
)
def test_merge_lora_refuses_in_one_line(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    base, adapter = _save(_llama(torch.float32), tmp_path, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    _config(adapter, **changes)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["merge-lora", base, adapter, str(out) + "/"])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert not out.exists()


def test_merge_lora_refuses_a_target_the_base_lacks(tmp_path: Path) -> None:
    # Tied embeddings: the base holds no lm_head.weight, so PEFT's merge would change the embedding too.
    model = _llama(torch.float32, tie=True)
    base, adapter = _save(model, tmp_path, peft.LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.raises(TransformError, match=r"changes 'lm_head\.weight', which the base does not hold"):
        ckptconv.merge_lora(base, adapter, str(tmp_path / "out") + "/")
    assert not (tmp_path / "out").exists()


def test_merge_lora_refuses_adapter_weights_linked_out_of_the_adapter_folder(tmp_path: Path) -> None:
    # Its adapter_config.json linked out is refused; its weights file was followed (before: merged from outside).
    base, adapter = _save(_llama(torch.float32), tmp_path, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    weights = os.path.join(adapter, "adapter_model.safetensors")
    os.replace(weights, tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", weights)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["merge-lora", base, adapter, str(out) + "/"])
    assert result.exit_code != 0, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "is a link that leads outside the checkpoint folder" in lines[0], result.output
    assert not out.exists()


def _trained(tmp_path: Path, dtype: Any, lora: Any) -> tuple[Any, str]:
    """A PEFT-wrapped model with random LoRA weights, and its base model folder."""
    base = str(tmp_path / "base")
    _llama(dtype).save_pretrained(base)
    # Loaded as PeftModel.from_pretrained's base will be (.to(dtype) would also cast the rotary inv_freq buffer).
    wrapped = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(base, dtype=dtype), lora)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for key, parameter in wrapped.named_parameters():
            if "lora_" in key or "modules_to_save" in key:
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float32))
    return wrapped, base


def _same_adapter(out: str, wrapped: Any, base: str, dtype: Any) -> None:
    from safetensors.torch import load_file

    # Every tensor as PEFT's own save_pretrained names and holds it.
    expected = peft.get_peft_model_state_dict(wrapped)
    written = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert set(written) == set(expected)
    for key, value in expected.items():
        assert torch.equal(written[key], value), key
    loaded = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base, dtype=dtype), out)
    ids = torch.arange(12).reshape(2, 6) % 64
    wrapped.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, wrapped(ids).logits)


def test_extract_lora_from_a_lightning_checkpoint(tmp_path: Path) -> None:
    lora = peft.LoraConfig(
        r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], rank_pattern={"layers.1.self_attn.v_proj": 2}
    )
    wrapped, base = _trained(tmp_path, torch.float32, lora)
    # Lightning keeps the module under "model." inside "state_dict", beside the run's other state.
    state = {f"model.{key}": value for key, value in wrapped.state_dict().items()}
    torch.save({"epoch": 3, "state_dict": state, "optimizer_states": []}, tmp_path / "last.ckpt")
    out = str(tmp_path / "adapter")
    result = CliRunner().invoke(
        main, ["extract-lora", str(tmp_path / "last.ckpt"), out, "--base", base, "--alpha", "16"]
    )
    assert result.exit_code == 0, result.output
    config = json.loads(Path(out, "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 16, ["q_proj", "v_proj"])
    assert config["rank_pattern"] == {"model\\.layers\\.1\\.self_attn\\.v_proj": 2}
    _same_adapter(out, wrapped, base, torch.float32)


def test_extract_lora_dora_modules_to_save_and_a_config_beside_the_run(tmp_path: Path) -> None:
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], use_dora=True, modules_to_save=["lm_head"]
    )
    wrapped, base = _trained(tmp_path, torch.bfloat16, lora)
    run = tmp_path / "run"
    run.mkdir()
    # DDP around torch.compile around the model, FSDP1 wrapping each decoder layer.
    state = {
        "module._orig_mod." + key.replace(".layers.0.", ".layers.0._fsdp_wrapped_module."): value
        for key, value in wrapped.state_dict().items()
    }
    torch.save(state, run / "model.pt")
    lora.save_pretrained(str(run))  # adapter_config.json beside it: lora_alpha from there
    out = str(tmp_path / "adapter")
    report = ckptconv.extract_lora(run / "model.pt", out, base=base)
    assert report.config["use_dora"] is True and report.config["modules_to_save"] == ["lm_head"]
    _same_adapter(out, wrapped, base, torch.bfloat16)


def test_extract_lora_without_alpha_is_refused(tmp_path: Path) -> None:
    wrapped, base = _trained(tmp_path, torch.float32, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    torch.save(wrapped.state_dict(), tmp_path / "run.pt")
    out = tmp_path / "adapter"
    result = CliRunner().invoke(main, ["extract-lora", str(tmp_path / "run.pt"), str(out), "--base", base])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"ckptconv: error: '{tmp_path / 'run.pt'}' does not say the adapter's lora_alpha (it is not in the tensors, "
        "and no adapter_config.json lies beside it); pass --alpha"
    ]
    assert not out.exists()


def test_inspect_names_the_adapter(tmp_path: Path) -> None:
    lora = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj"], use_rslora=True, modules_to_save=["lm_head"])
    _, adapter = _save(_llama(torch.float32), tmp_path, lora)
    _config(adapter, base_model_name_or_path="org/tiny-llama")
    info = ckptconv.inspect(adapter)
    assert info.adapter == "rsLoRA, r=4, alpha=16; targets q_proj; modules_to_save lm_head; base model org/tiny-llama"
    result = CliRunner().invoke(main, ["inspect", adapter])
    assert f"adapter: {info.adapter}\n" in result.output
    _config(adapter, use_qalora=True)
    assert ckptconv.inspect(adapter).adapter.startswith("PEFT adapter that merge-lora refuses: ")
    assert ckptconv.inspect(os.path.join(tmp_path, "base")).adapter == ""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"peft_type": "LORA", "r": 4, "r": 8}', "is not an adapter config: it is not JSON (ValueError)"),
        ("[" * 100_000 + "]" * 100_000, "is not an adapter config: it is not JSON (RecursionError)"),
        ('{"peft_type": "LORA", "r": true}', "r is True, not a positive integer"),
        ('{"peft_type": "LORA", "modules_to_save": [1]}', "modules_to_save is [1], not a list of module names"),
        ('{"peft_type": "LORA", "lora_alpha": 1e400}', "lora_alpha is inf, not a positive number"),
        (" " * (1 << 20) + "{}", "is larger than 1,048,576 bytes, too large for a PEFT adapter config"),
    ],
    ids=["duplicate-key", "nested", "bool-rank", "names", "inf", "huge"],
)
def test_hostile_adapter_configs_are_refused_in_one_line(tmp_path: Path, text: str, message: str) -> None:
    base, adapter = _save(_llama(torch.float32), tmp_path, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    Path(adapter, "adapter_config.json").write_text(text)
    result = CliRunner().invoke(main, ["merge-lora", base, adapter, str(tmp_path / "out") + "/"])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert not (tmp_path / "out").exists()


def test_merge_lora_without_torch_says_so_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # `import torch` raises ImportError
    result = CliRunner().invoke(main, ["merge-lora", "base/", "adapter/", str(tmp_path / "out") + "/"])
    assert result.exit_code == 1
    assert result.output == (
        "ckptconv: error: merge-lora (LoRA deltas computed exactly as PEFT computes them) needs torch: "
        "pip install 'ckptconv[torch]'\n"
    )


def test_merge_lora_into_an_fp8_block_base_is_peft_on_the_dequantized_model(tmp_path: Path) -> None:
    # The reference: transformers dequantizes the fp8 blocks as it loads (FineGrainedFP8Config(dequantize=True)),
    # PEFT merges into the bf16 weights. ckptconv: --dtype bf16 dequantizes, then merges, in one stream.
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    base = str(tmp_path / "fp8")
    ckptconv.convert(tmp_path / "bf16", base + "/", quantize="fp8-block")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "down_proj"])
    _, adapter = _save(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf16"), tmp_path / "bf16", lora)
    out = str(tmp_path / "out")
    ckptconv.merge_lora(base, adapter, out + "/", transforms=[ckptconv.Cast("bf16")])
    quantization = transformers.FineGrainedFP8Config(dequantize=True)
    dequantized = transformers.LlamaForCausalLM.from_pretrained(
        base, dtype=torch.bfloat16, quantization_config=quantization
    )
    merged = peft.PeftModel.from_pretrained(dequantized, adapter).merge_and_unload()
    assert "quantization_config" not in json.loads(Path(out, "config.json").read_text())
    _check(out, merged, transformers.LlamaForCausalLM, torch.bfloat16)


def test_merge_lora_refuses_a_square_conv1d_weight_it_cannot_tell(tmp_path: Path) -> None:
    # GPT-2's c_proj is square: without config.json (a bare weights file), Conv1D and Linear look alike.
    lora = peft.LoraConfig(r=4, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    base, adapter = _save(_gpt2(torch.float32), tmp_path, lora)
    with pytest.raises(TransformError, match=r"'transformer\.h\.\d\.attn\.c_proj''s is square"):
        ckptconv.merge_lora(os.path.join(base, "model.safetensors"), adapter, str(tmp_path / "out.safetensors"))
    assert not (tmp_path / "out.safetensors").exists()


def test_inspect_of_a_file_beside_an_adapter_config_is_not_an_adapter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, adapter = _save(_llama(torch.float32), tmp_path, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    monkeypatch.chdir(adapter)
    torch.save({"w": torch.ones(2)}, "model.pt")  # a checkpoint that happens to lie in an adapter folder
    assert ckptconv.inspect("model.pt").adapter == ""
    assert ckptconv.inspect("adapter_model.safetensors").adapter.startswith("LoRA, r=4")


def test_merge_lora_on_fused_expert_parameters_is_peft_bit_for_bit(tmp_path: Path) -> None:
    # target_parameters: PEFT's ParamWrapper on gpt-oss's fused experts, stored (experts, in, out) as in the model.
    # gate_up_proj (4, 32, 64) fits by its shape; down_proj (4, 32, 32) is square: the architecture says how.
    config = transformers.GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention"] * 2,
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16
    transformers.GptOssForCausalLM(config).to(dtype).save_pretrained(tmp_path / "base")
    model = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "base", dtype=dtype)
    targets = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=targets)
    base, adapter = _save(model, tmp_path, lora)
    out = str(tmp_path / "out")
    report = ckptconv.merge_lora(base, adapter, out + "/")
    assert "merged LoRA 'adapter' into 6 weights" in report.notes
    _check(
        out, _peft_merged(base, [adapter], transformers.GptOssForCausalLM, dtype), transformers.GptOssForCausalLM, dtype
    )


def test_merge_lora_on_experts_the_base_stores_apart_is_refused(tmp_path: Path) -> None:
    # Mixtral's file holds block_sparse_moe.experts.N.w1.weight ...; transformers fuses them as it loads.
    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    lora = peft.LoraConfig(r=4, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    base, adapter = _save(transformers.MixtralForCausalLM(config), tmp_path, lora)
    with pytest.raises(TransformError, match="which the base does not hold as one tensor"):
        ckptconv.merge_lora(base, adapter, str(tmp_path / "out") + "/")
    assert not (tmp_path / "out").exists()


def test_extract_lora_on_fused_expert_parameters_with_the_runs_config(tmp_path: Path) -> None:
    config = transformers.GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention"],
    )
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(config).save_pretrained(tmp_path / "base")
    model = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    targets = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj"], target_parameters=targets)
    wrapped = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for key, parameter in wrapped.named_parameters():
            if "lora_" in key:
                parameter.normal_()
    run = tmp_path / "run"
    run.mkdir()
    torch.save({f"model.{key}": value for key, value in wrapped.state_dict().items()}, run / "last.pt")
    out = str(tmp_path / "adapter")
    with pytest.raises(TransformError, match="holds LoRAs on parameters"):
        ckptconv.extract_lora(run / "last.pt", out, base=tmp_path / "base", alpha=8)
    lora.save_pretrained(str(run))
    report = ckptconv.extract_lora(run / "last.pt", out, base=tmp_path / "base")
    assert report.config["target_parameters"] == targets
    expected = peft.get_peft_model_state_dict(wrapped)
    from safetensors.torch import load_file

    written = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert set(written) == set(expected) and all(torch.equal(written[k], v) for k, v in expected.items())
    base = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, out)
    ids = torch.arange(12).reshape(2, 6) % 64
    wrapped.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, wrapped(ids).logits)


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_merge_lora_of_a_half_precision_adapter_file(tmp_path: Path, stored: Any) -> None:
    # Adapters are often saved in bf16: PEFT copies the values into float32 parameters, then merges.
    from safetensors.torch import load_file, save_file

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj", "embed_tokens"], use_dora=False)
    base, adapter = _save(_llama(torch.bfloat16), tmp_path, lora)
    path = os.path.join(adapter, "adapter_model.safetensors")
    save_file({k: v.to(stored) for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    out = str(tmp_path / "out")
    ckptconv.merge_lora(base, adapter, out + "/")
    dtype = torch.bfloat16
    _check(
        out, _peft_merged(base, [adapter], transformers.LlamaForCausalLM, dtype), transformers.LlamaForCausalLM, dtype
    )


def test_merge_lora_of_modules_to_save_alone(tmp_path: Path) -> None:
    # An adapter file holding only a module to save. (PEFT still wraps q_proj, with B = 0 from its init: a zero
    # delta, which changes no value of these random weights; ckptconv leaves q_proj as it is.)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    base, adapter = _save(_llama(torch.bfloat16), tmp_path, lora)
    from safetensors.torch import load_file, save_file

    path = os.path.join(adapter, "adapter_model.safetensors")
    save_file({k: v for k, v in load_file(path).items() if "lora_" not in k}, path, metadata={"format": "pt"})
    out = str(tmp_path / "out")
    report = ckptconv.merge_lora(base, adapter, out + "/")
    assert "no LoRA: modules to save only" in report.steps[0].step
    dtype = torch.bfloat16
    _check(
        out, _peft_merged(base, [adapter], transformers.LlamaForCausalLM, dtype), transformers.LlamaForCausalLM, dtype
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_lora_on_convolutions_is_peft_bit_for_bit(tmp_path: Path, dtype: Any) -> None:
    # ResNet's Conv2d layers: a 7x7 stem, 3x3 and 1x1 kernels (the 1x1 ones PEFT merges as a matrix product).
    from safetensors.torch import load_file

    config = transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="bottleneck", num_labels=3
    )
    torch.manual_seed(0)
    model_class = transformers.ResNetForImageClassification
    model_class(config).to(dtype).save_pretrained(tmp_path / "base")
    model = model_class.from_pretrained(tmp_path / "base", dtype=dtype)
    base, adapter = _save(model, tmp_path, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["convolution"]))
    out = str(tmp_path / "out")
    report = ckptconv.merge_lora(base, adapter, out + "/")
    assert "merged LoRA 'adapter' into 8 weights" in report.notes
    merged = _peft_merged(base, [adapter], model_class, dtype)
    ours, reference = load_file(os.path.join(out, "model.safetensors")), merged.state_dict()
    assert set(ours) == set(reference)
    assert all(torch.equal(value, reference[key]) for key, value in ours.items())
    loaded = model_class.from_pretrained(out, dtype=dtype).eval()
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        assert torch.equal(loaded(pixels).logits, merged.eval()(pixels).logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merge_weighted_adapters_is_peft_add_weighted_adapter_cat(tmp_path: Path, dtype: Any) -> None:
    base = str(tmp_path / "base")
    _llama(dtype).save_pretrained(base)
    first = peft.LoraConfig(r=4, lora_alpha=9, target_modules=["q_proj", "v_proj", "embed_tokens"], use_rslora=True)
    _, a = _save(transformers.LlamaForCausalLM.from_pretrained(base, dtype=dtype), tmp_path, first, name="a")
    second = peft.LoraConfig(r=2, lora_alpha=5, target_modules=["v_proj", "o_proj", "embed_tokens"])
    _, b = _save(transformers.LlamaForCausalLM.from_pretrained(base, dtype=dtype), tmp_path, second, name="b")
    for adapter in (a, b):  # the embeddings' saved base layers would be loaded twice: not a weighted combination
        path = os.path.join(adapter, "adapter_model.safetensors")
        from safetensors.torch import load_file, save_file

        save_file({k: v for k, v in load_file(path).items() if "base_layer" not in k}, path, metadata={"format": "pt"})
    out = str(tmp_path / "out")
    result = CliRunner().invoke(
        main, ["merge-lora", base, a, out + "/", "--adapter", b, "--weight", "0.7", "--weight", "-1.3"]
    )
    assert result.exit_code == 0, result.output
    model = peft.PeftModel.from_pretrained(
        transformers.LlamaForCausalLM.from_pretrained(base, dtype=dtype), a, adapter_name="a"
    )
    model.load_adapter(b, adapter_name="b")
    model.add_weighted_adapter(["a", "b"], [0.7, -1.3], "ab", combination_type="cat")
    model.set_adapter("ab")
    merged = model.merge_and_unload(adapter_names=["ab"])
    _check(out, merged, transformers.LlamaForCausalLM, dtype)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (["1"], "1 weight for 2 adapters; give one each"),
        (["1", "nan"], "the weights [1.0, nan] are not all finite numbers"),
    ],
)
def test_merge_weighted_refusals(tmp_path: Path, weights: list[str], message: str) -> None:
    base, a = _save(_llama(torch.float32), tmp_path, peft.LoraConfig(r=2, target_modules=["q_proj"]), name="a")
    _, b = _save(_llama(torch.float32), tmp_path, peft.LoraConfig(r=2, target_modules=["v_proj"]), name="b")
    args = ["merge-lora", base, a, str(tmp_path / "out") + "/", "--adapter", b]
    result = CliRunner().invoke(main, [*args, *(part for w in weights for part in ("--weight", w))])
    assert result.exit_code == 1
    assert result.output == f"ckptconv: error: {message}\n"
    assert not (tmp_path / "out").exists()
