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

from .conftest import run_cli

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
    code, out, err = run_cli("convert", str(path), str(tmp_path / "out.safetensors"), "--dtype", "bf16")
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
