"""Quantized checkpoints through the command line: never a cast without the scales.

The guard: a checkpoint that declares a quantization scheme, or whose tensors come in weight/scale
pairs, is dequantized exactly or refused in one line naming the scheme; plain float8 with no scale
anywhere stays a plain cast, as ``Tensor.to`` does it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from .conftest import run_cli, transformers_fp8_dequantization

BLOCK = [128, 128]


def fp8_block_state(rows: int = 256, cols: int = 200) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3-layout layer: e4m3 weights, a float32 ``weight_scale_inv`` per 128x128 block (ragged edge)."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(rows, cols, generator=generator) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-rows // 128), -(-cols // 128), generator=generator) / 100
    return {
        "model.layers.0.mlp.down_proj.weight": weight,
        "model.layers.0.mlp.down_proj.weight_scale_inv": scale,
        "model.norm.weight": torch.randn(cols, generator=generator).to(torch.bfloat16),
    }


def model_folder(folder: Path, state: dict[str, torch.Tensor], config: dict[str, object]) -> Path:
    """A model folder as save_pretrained writes it: config.json, an index and one shard."""
    folder.mkdir()
    save_file(state, str(folder / "model-00001-of-00001.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(state, "model-00001-of-00001.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


FP8_CONFIG = {
    "model_type": "llama",
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": BLOCK},
}


def test_scales_beside_weights_without_a_declaration_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file(fp8_block_state(), str(path))
    code, _, err = run_cli("convert", str(path), str(tmp_path / "out.safetensors"), "--dtype", "bf16")
    assert code == 1
    assert err == (
        "ckptconv: error: tensor 'model.layers.0.mlp.down_proj.weight_scale_inv' belongs to a fp8 block-scaled "
        "quantized checkpoint, but no quantization_config declares the scheme; convert the model folder it came "
        "from (its config.json declares it), since a plain cast would drop its scales\n"
    )
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize(
    ("method", "name"),
    [("gptq", "GPTQ"), ("awq", "AWQ"), ("bitsandbytes", "bitsandbytes"), ("gguf", "GGUF")],
)
def test_a_declared_scheme_ckptconv_cannot_undo_is_refused_naming_it(tmp_path: Path, method: str, name: str) -> None:
    state = {"model.layers.0.mlp.down_proj.weight": torch.randn(4, 4, dtype=torch.float16)}
    folder = model_folder(tmp_path / "q", state, {"quantization_config": {"quant_method": method, "bits": 4}})
    code, _, err = run_cli("convert", str(folder), str(tmp_path / "out") + "/", "--dtype", "bf16")
    assert code == 1
    assert err == (
        f"ckptconv: error: the checkpoint is quantized with {name} (quant_method {method!r}), which ckptconv "
        "cannot dequantize exactly; load it with its quantization library and save it dequantized first\n"
    )
    assert not (tmp_path / "out").exists()


def test_plain_float8_without_scales_is_a_plain_cast(tmp_path: Path) -> None:
    weight = torch.randn(64, 48).to(torch.float8_e4m3fn)
    path = tmp_path / "plain.safetensors"
    save_file({"w": weight}, str(path))
    code, _, err = run_cli("convert", str(path), str(tmp_path / "out.safetensors"), "--dtype", "bf16", "-q")
    assert (code, err) == (0, "")
    assert torch.equal(load_file(str(tmp_path / "out.safetensors"))["w"], weight.to(torch.bfloat16))


def _bytes_equal(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    assert torch.equal(ours.contiguous().view(torch.uint8), reference.contiguous().view(torch.uint8))


def _written(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


@pytest.mark.parametrize(
    ("flag", "target"), [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)]
)
def test_fp8_block_folder_is_dequantized_as_transformers_does(tmp_path: Path, flag: str, target: torch.dtype) -> None:
    """DeepSeek-V3's layout, ragged edge blocks included, against transformers' own fine-grained fp8 dequantization."""
    _dequantize_fp8_weight = transformers_fp8_dequantization()

    state = fp8_block_state()
    folder = model_folder(tmp_path / "fp8", state, FP8_CONFIG)
    code, _, err = run_cli("convert", str(folder), str(tmp_path / "out") + "/", "--dtype", flag, "--verify")
    assert code == 0, err
    assert "note: dequantized the fp8 weights to" in err
    written = _written(tmp_path / "out")
    name = "model.layers.0.mlp.down_proj.weight"
    assert sorted(written) == [name, "model.norm.weight"]  # the scale is gone, the names are the model's
    expected = _dequantize_fp8_weight(state[name], state[name + "_scale_inv"], BLOCK, torch.float32).to(target)
    _bytes_equal(written[name], expected)
    _bytes_equal(written["model.norm.weight"], state["model.norm.weight"].to(target))


def test_without_dtype_a_quantized_checkpoint_is_copied_with_its_scales(tmp_path: Path) -> None:
    state = fp8_block_state()
    folder = model_folder(tmp_path / "fp8", state, FP8_CONFIG)
    code, _, err = run_cli("convert", str(folder), str(tmp_path / "out") + "/")
    assert code == 0, err
    assert (
        "note: the weights are quantized (fp8) and were kept so, with their scales; pass --dtype bf16, fp16 or "
        "fp32 to dequantize them exactly\n"
    ) in err
    written = _written(tmp_path / "out")
    assert sorted(written) == sorted(state)
    for key, value in state.items():
        _bytes_equal(written[key], value)


def test_dequantizing_to_fp64_is_refused(tmp_path: Path) -> None:
    folder = model_folder(tmp_path / "fp8", fp8_block_state(), FP8_CONFIG)
    code, _, err = run_cli("convert", str(folder), str(tmp_path / "out") + "/", "--dtype", "fp64")
    assert code == 1
    assert err == "ckptconv: error: ckptconv dequantizes to float32, float16 or bfloat16, not float64\n"


def test_verify_with_torch_dequantizes_the_reference_too(tmp_path: Path) -> None:
    folder = model_folder(tmp_path / "fp8", fp8_block_state(), FP8_CONFIG)
    code, _, err = run_cli("convert", str(folder), str(tmp_path / "o.safetensors"), "--dtype", "bf16", "--verify=torch")
    assert code == 0, err


def test_mxfp4_experts_are_dequantized_as_transformers_does(tmp_path: Path) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(3)
    experts = "model.layers.0.mlp.experts."
    blocks = torch.randint(0, 256, (2, 24, 3, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(118, 136, (2, 24, 3), dtype=torch.uint8, generator=generator)
    state = {experts + "gate_up_proj_blocks": blocks, experts + "gate_up_proj_scales": scales}
    config = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}
    folder = model_folder(tmp_path / "gpt_oss", state, config)
    code, _, err = run_cli("convert", str(folder), str(tmp_path / "out.safetensors"), "--dtype", "bf16")
    assert code == 0, err
    written = load_file(str(tmp_path / "out.safetensors"))
    assert list(written) == [experts + "gate_up_proj"]
    _bytes_equal(written[experts + "gate_up_proj"], convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))


def test_compressed_tensors_w4a16_is_dequantized_as_its_decompressor_does(tmp_path: Path) -> None:
    """A pack-quantized (int4 in int32, group scales, zero points) layer made by compressed-tensors' own compressor."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")
    weight = torch.randn(64, 96, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(5))
    groups = weight.float().unflatten(-1, (-1, 32))
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    module = dict(
        compressor.compress(
            {"weight": weight, "weight_scale": scale.to(weight.dtype), "weight_zero_point": zero_point}, scheme
        )
    )
    reference = compressor.decompress(dict(module), scheme)["weight"]
    config = QuantizationConfig(
        config_groups={"group_0": scheme}, format="pack-quantized", quant_method="compressed-tensors"
    )
    state = {f"model.layers.0.mlp.up_proj.{key}": value for key, value in module.items()}
    folder = model_folder(tmp_path / "w4a16", state, {"quantization_config": json.loads(config.model_dump_json())})
    code, _, err = run_cli("convert", str(folder), str(tmp_path / "out.safetensors"), "--dtype", "bf16")
    assert code == 0, err
    written = load_file(str(tmp_path / "out.safetensors"))
    assert list(written) == ["model.layers.0.mlp.up_proj.weight"]
    _bytes_equal(written["model.layers.0.mlp.up_proj.weight"], reference.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_fp8_block_is_transformers_quantizer_bit_for_bit(tmp_path: Path, dtype: torch.dtype) -> None:
    """--quantize fp8-block against transformers' Fp8Quantize; embeddings, lm_head and norms are left as they are,
    and the round trip through ckptconv's own dequantization gives transformers' dequantization."""
    from types import SimpleNamespace

    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    generator = torch.Generator().manual_seed(7)
    weight = (torch.randn(256, 384, generator=generator) * 0.05).to(dtype)
    weight[:128, :128] = 0  # a block of zeros keeps scale 1
    experts = (torch.randn(2, 128, 256, generator=generator)).to(dtype)
    state = {
        "model.layers.0.mlp.up_proj.weight": weight,
        "model.layers.0.mlp.experts.down_proj.weight": experts,
        "model.layers.0.self_attn.o_proj.weight": torch.randn(100, 128, generator=generator).to(dtype),  # ragged
        "model.embed_tokens.weight": torch.randn(10, 384, generator=generator).to(dtype),
        "model.norm.weight": torch.randn(384, generator=generator).to(dtype),
        "lm_head.weight": torch.randn(10, 384, generator=generator).to(dtype),
    }
    save_file(state, str(tmp_path / "model.safetensors"))
    out = tmp_path / "fp8.safetensors"
    code, _, err = run_cli("convert", str(tmp_path / "model.safetensors"), str(out), "--quantize", "fp8-block")
    assert code == 0, err
    written = load_file(str(out))
    reference = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=BLOCK)))
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.experts.down_proj.weight"):
        expected = reference.convert({name: state[name]})
        _bytes_equal(written[name], expected[name])
        scale = name.removesuffix("weight") + "weight_scale_inv"
        _bytes_equal(written[scale], expected[scale])
    for name in (
        "model.layers.0.self_attn.o_proj.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    ):
        _bytes_equal(written[name], state[name])
    declared = json.loads(safe_open_metadata(out)["quantization_config"])
    assert declared["modules_to_not_convert"] == ["lm_head", "model.embed_tokens", "model.layers.0.self_attn.o_proj"]

    back = tmp_path / "back.safetensors"
    code, _, err = run_cli("convert", str(out), str(back), "--dtype", "bf16")
    assert code == 0, err
    name = "model.layers.0.mlp.up_proj.weight"
    expected = Fp8Dequantize(None)._dequantize_one(
        written[name], written["model.layers.0.mlp.up_proj.weight_scale_inv"], output_dtype=torch.bfloat16
    )
    _bytes_equal(load_file(str(back))[name], expected)


def safe_open_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        return dict(file.metadata())


def test_quantizing_a_quantized_checkpoint_is_refused(tmp_path: Path) -> None:
    folder = model_folder(tmp_path / "fp8", fp8_block_state(), FP8_CONFIG)
    code, _, err = run_cli("convert", str(folder), str(tmp_path / "o.safetensors"), "--quantize", "fp8-block")
    assert code == 1
    assert err == (
        "ckptconv: error: the weights are quantized (fp8) already; pass --dtype bf16 to dequantize them first\n"
    )


def test_inspect_names_the_scheme_and_what_dequantizing_writes(tmp_path: Path) -> None:
    folder = model_folder(tmp_path / "fp8", fp8_block_state(), FP8_CONFIG)
    code, out, _ = run_cli("inspect", str(folder))
    assert code == 0
    assert (
        "quantized: fp8: --dtype bf16, fp16 or fp32 dequantizes 1 weight exactly and leaves out "
        "1 scale, zero point or shape tensor\n"
    ) in out
    code, out, _ = run_cli("inspect", str(folder), "--json")
    assert json.loads(out)["quantization"].startswith("fp8: ")
    save_file({"w": torch.randn(4, 4).to(torch.float8_e4m3fn)}, str(tmp_path / "plain.safetensors"))
    code, out, _ = run_cli("inspect", str(tmp_path / "plain.safetensors"))
    assert (code, "quantized" in out) == (0, False)


def _torch_ao_state() -> dict[str, torch.Tensor]:
    import warnings

    generator = torch.Generator().manual_seed(9)
    x = torch.randn(64, 30, generator=generator) * 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 2.13 deprecates torch.ao's quantized tensors
        per_tensor = torch.quantize_per_tensor(x, 0.1, 3, torch.qint8)
        state = {
            "fc.weight": per_tensor,
            "fc2.weight": torch.quantize_per_channel(
                x,
                torch.rand(64, dtype=torch.float64, generator=generator) / 10 + 1e-3,
                torch.randint(0, 5, (64,), generator=generator),
                0,
                torch.quint8,
            ),
            "fc3.weight": torch.quantize_per_channel(
                x,
                torch.rand(30, dtype=torch.float64, generator=generator) / 10 + 1e-3,
                torch.randint(-3, 3, (30,), generator=generator),
                1,
                torch.qint8,
            ),
            "acc": torch.quantize_per_tensor(x, 0.01, 7, torch.qint32),
            "view": per_tensor[::2, 1:5],
            "bias": torch.randn(64, generator=generator),
        }
    return state


@pytest.mark.parametrize(("flag", "target"), [("bf16", torch.bfloat16), (None, torch.float32)])
def test_torch_ao_quantized_tensors_are_their_dequantize(tmp_path: Path, flag: str | None, target: torch.dtype) -> None:
    """torch.ao quantized tensors (per tensor and per channel; qint8, quint8, qint32; a view) in a .pt file are
    written as torch's own ``tensor.dequantize()``, cast as ``--dtype`` says; --verify=torch agrees."""
    state = _torch_ao_state()
    torch.save(state, tmp_path / "q.pt")
    out = tmp_path / "out.safetensors"
    args = ["convert", str(tmp_path / "q.pt"), str(out), "--verify=torch", *(["--dtype", flag] if flag else [])]
    code, _, err = run_cli(*args)
    assert code == 0, err
    assert "note: read 5 torch.ao quantized tensors as float32, exactly as tensor.dequantize() gives them\n" in err
    written = load_file(str(out))
    for key, value in state.items():
        expected = value.dequantize() if value.is_quantized else value
        _bytes_equal(written[key], expected.to(target))
