"""Exact dequantization of quantized checkpoints (ckptconv.quantization), bit for bit against the
reference libraries' own dequantization: transformers' fine-grained fp8 and mxfp4
integrations, compressed-tensors' compressors. Checkpoints are made by those libraries, saved
with safetensors, and read back through ckptconv.open."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import ckptconv
from ckptconv.dtypes import dtype_by_name
from ckptconv.errors import UnsupportedQuantizationError
from ckptconv.quantization import Scheme, dequantize, detect
from ckptconv.values.tensor import TensorRef

from .conftest import transformers_fp8_dequantization

TARGETS = [torch.bfloat16, torch.float16, torch.float32]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _saved(
    tmp_path: Path, tensors: Mapping[str, torch.Tensor], name: str = "model.safetensors"
) -> dict[str, TensorRef]:
    path = tmp_path / name
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return dict(ckptconv.open(path).tensors())


def _dequantized(
    tensors: Mapping[str, TensorRef], config: Mapping[str, Any], target: torch.dtype
) -> dict[str, torch.Tensor]:
    scheme = detect(config, None, tensors)
    assert isinstance(scheme, Scheme)
    target_dtype = dtype_by_name(_name(target))
    assert target_dtype is not None
    return {key: ref.torch() for key, ref in dequantize(tensors, scheme, target_dtype).items()}


def _same(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """Bit for bit, on the raw bytes (NaNs included)."""
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    assert torch.equal(
        ours.contiguous().reshape(-1).view(torch.uint8), reference.contiguous().reshape(-1).view(torch.uint8)
    )


# -- fp8 block-scaled (transformers finegrained_fp8) ----------------------------------------------


def _fp8_quantize(weight: torch.Tensor, block: list[int]) -> dict[str, torch.Tensor]:
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    quantizer = SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=block))
    return Fp8Quantize(quantizer).convert({"weight": weight})


def _fp8_ragged(weight: torch.Tensor, block: list[int]) -> dict[str, torch.Tensor]:
    """fp8 weights and scales for a shape of partial blocks, made by hand (Fp8Quantize skips those)."""
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale = torch.rand(*weight.shape[:-2], *grid, dtype=torch.float32) * 0.01 + 1e-3
    return {
        "weight": (torch.randn_like(weight) * 100).clamp(-448, 448).to(torch.float8_e4m3fn),
        "weight_scale_inv": scale,
    }


FP8_CONFIG = {
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
}


@pytest.mark.parametrize("target", TARGETS)
def test_fp8_block_whole_blocks_match_transformers(tmp_path: Path, target: torch.dtype) -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(0)
    q = _fp8_quantize(torch.randn(256, 384) * 3, [128, 128])
    experts = _fp8_quantize(torch.randn(2, 128, 256), [128, 128])
    state = {
        "layer.q_proj.weight": q["weight"],
        "layer.q_proj.weight_scale_inv": q["weight_scale_inv"],
        "layer.experts.gate_up_proj": experts["weight"],
        "layer.experts.gate_up_proj_scale_inv": experts["weight_scale_inv"],
        "layer.norm.weight": torch.randn(384),
        "embed.weight": torch.randn(10, 384, dtype=torch.bfloat16),
    }
    ours = _dequantized(_saved(tmp_path, state), FP8_CONFIG, target)
    assert sorted(ours) == ["embed.weight", "layer.experts.gate_up_proj", "layer.norm.weight", "layer.q_proj.weight"]
    reference = Fp8Dequantize(None)
    for name in ("layer.q_proj.weight", "layer.experts.gate_up_proj"):
        expected = reference._dequantize_one(state[name], state[name + "_scale_inv"], output_dtype=target)
        _same(ours[name], expected)
    _same(ours["layer.norm.weight"], state["layer.norm.weight"])  # untouched: the caller's --dtype cast applies
    _same(ours["embed.weight"], state["embed.weight"])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", [(200, 300), (129, 1), (1, 130), (3, 200, 300)])
@pytest.mark.parametrize("index_buffer", [None, 700])
def test_fp8_block_ragged_edges_match_transformers(
    tmp_path: Path,
    target: torch.dtype,
    shape: tuple[int, ...],
    index_buffer: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last, partial blocks take their own scale. transformers' _dequantize_fp8_weight places ragged
    blocks; in float32 it has Fp8Dequantize's order (float32 product), then .to(target) rounds once.
    ``index_buffer``: the gather's indices a few rows at a time (2 rows of 300), not a band at once."""
    _dequantize_fp8_weight = transformers_fp8_dequantization()

    from ckptconv.quantization import fp8_block

    if index_buffer is not None:
        monkeypatch.setattr(fp8_block, "_INDEX_BUFFER_ELEMENTS", index_buffer)

    torch.manual_seed(1)
    q = _fp8_ragged(torch.empty(shape), [128, 128])
    state = {"m.weight": q["weight"], "m.weight_scale_inv": q["weight_scale_inv"]}
    ours = _dequantized(_saved(tmp_path, state), FP8_CONFIG, target)
    expected = _dequantize_fp8_weight(q["weight"], q["weight_scale_inv"], [128, 128], torch.float32).to(target)
    _same(ours["m.weight"], expected)
    assert list(ours) == ["m.weight"]


def test_fp8_block_dequantizes_modules_to_not_convert_by_their_scales_and_e8m0_scales(tmp_path: Path) -> None:
    """The tensors decide: a module named in modules_to_not_convert whose weight has its scale_inv beside it is
    dequantized by it (before: kept as float8 with its scale, then plain-cast by --dtype, max error 447.6)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(2)
    q = _fp8_quantize(torch.randn(128, 256), [128, 128])
    e8m0 = torch.randint(100, 140, (1, 2), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    state = {
        "a.weight": q["weight"],
        "a.weight_scale_inv": e8m0,
        "lm_head.weight": q["weight"].clone(),
        "lm_head.weight_scale_inv": q["weight_scale_inv"],
        "embed.weight": torch.randn(4, 256, dtype=torch.bfloat16),
        "a.input_scale": torch.ones(()),
    }
    kept = ["lm_head", "embed", "re:(a|a)*$"]  # the list is checked, not run: the tensors decide
    config = {"quantization_config": {**FP8_CONFIG["quantization_config"], "modules_to_not_convert": kept}}
    ours = _dequantized(_saved(tmp_path, state), config, torch.bfloat16)
    assert sorted(ours) == ["a.weight", "embed.weight", "lm_head.weight"]
    reference = Fp8Dequantize(None)
    _same(ours["a.weight"], reference._dequantize_one(q["weight"], e8m0, output_dtype=torch.bfloat16))
    expected = reference._dequantize_one(q["weight"], q["weight_scale_inv"], output_dtype=torch.bfloat16)
    _same(ours["lm_head.weight"], expected)
    _same(ours["embed.weight"], state["embed.weight"])


# -- MXFP4 (transformers mxfp4, gpt-oss experts) --------------------------------------------------

MXFP4_CONFIG = {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.0.attn"]}}


@pytest.mark.parametrize("target", TARGETS)
def test_mxfp4_matches_transformers(tmp_path: Path, target: torch.dtype) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(3)
    experts = "model.layers.0.mlp.experts."
    blocks = torch.randint(0, 256, (2, 24, 3, 16), dtype=torch.uint8)
    scales = torch.randint(118, 136, (2, 24, 3), dtype=torch.uint8)
    # every scale byte once (0 and 255 included: 2**-127 and inf, which makes 0 * inf a NaN)
    all_blocks = torch.randint(0, 256, (1, 256, 1, 16), dtype=torch.uint8)
    all_blocks[0, :, 0, 0] = 0
    all_scales = torch.arange(256, dtype=torch.uint8).reshape(1, 256, 1)
    state = {
        experts + "gate_up_proj_blocks": blocks,
        experts + "gate_up_proj_scales": scales,
        experts + "gate_up_proj_bias": torch.randn(2, 24),
        experts + "down_proj_blocks": all_blocks,
        experts + "down_proj_scales": all_scales,
        "model.layers.0.attn.q_proj.weight": torch.randn(4, 4, dtype=torch.bfloat16),
    }
    ours = _dequantized(_saved(tmp_path, state), MXFP4_CONFIG, target)
    assert sorted(ours) == [
        "model.layers.0.attn.q_proj.weight",
        experts + "down_proj",
        experts + "gate_up_proj",
        experts + "gate_up_proj_bias",
    ]
    _same(ours[experts + "gate_up_proj"], convert_moe_packed_tensors(blocks, scales, dtype=target))
    _same(ours[experts + "down_proj"], convert_moe_packed_tensors(all_blocks, all_scales, dtype=target))
    _same(ours[experts + "gate_up_proj_bias"], state[experts + "gate_up_proj_bias"])


# -- compressed-tensors (its compressors compress; their decompress is the reference) --------------


def _observed(weight: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-strategy min and max, shaped as compressed-tensors' observers give them."""
    strategy = args.strategy.value if hasattr(args.strategy, "value") else str(args.strategy)
    w = weight.float()
    if strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if strategy in ("group", "tensor_group"):
        g = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
        return g.amin(-1), g.amax(-1)
    bh, bw = args.block_structure
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w, (0, -cols % bw, 0, -rows % bh))
    blocks = padded.unflatten(0, (-1, bh)).unflatten(-1, (-1, bw))
    return blocks.amin((1, 3)), blocks.amax((1, 3))


def _ct_module(fmt: str, weights: dict[str, Any], weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], Any, Any]:
    """(the compressed module tensors, the scheme, the compressor), made by compressed-tensors."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format=fmt)
    low, high = _observed(weight, args)
    state = {"weight": weight}
    global_scale = None
    if fmt == "nvfp4-pack-quantized":
        global_scale = generate_gparam(weight.float().amin().reshape(1), weight.float().amax().reshape(1))
        state["weight_global_scale"] = global_scale
    scale, zero_point = calculate_qparams(low, high, args, global_scale=global_scale)
    state["weight_scale"] = scale.to(weight.dtype) if fmt != "nvfp4-pack-quantized" else scale
    state["weight_zero_point"] = zero_point
    compressor = BaseCompressor.get_value_from_registry(fmt)
    return dict(compressor.compress(state, scheme)), scheme, compressor


def _ct_config(fmt: str, weights: dict[str, Any], ignore: list[str]) -> dict[str, Any]:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights), format=fmt)
    config = QuantizationConfig(
        config_groups={"group_0": scheme}, format=fmt, quant_method="compressed-tensors", ignore=ignore
    )
    return {"quantization_config": json.loads(json.dumps(config.model_dump(mode="json")))}


CT_CASES = [
    ("float-quantized", {"num_bits": 8, "type": "float", "strategy": "tensor"}, (96, 200)),
    ("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"}, (96, 200)),
    ("float-quantized", {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 40}, (96, 200)),
    (
        "float-quantized",
        {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
        (200, 300),
    ),
    ("int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"}, (96, 200)),
    (
        "int-quantized",
        {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 50, "symmetric": False},
        (96, 200),
    ),
    ("int-quantized", {"num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": False}, (96, 200)),
    ("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}, (100, 128)),
    (
        "pack-quantized",
        {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False},
        (100, 96),
    ),
    ("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "channel", "symmetric": False}, (37, 100)),
    ("pack-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"}, (37, 100)),
    (
        "pack-quantized",
        {"num_bits": 3, "type": "int", "strategy": "group", "group_size": 20, "symmetric": False},
        (33, 60),
    ),
    ("nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}, (48, 96)),
]


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize(("fmt", "weights", "shape"), CT_CASES, ids=lambda v: str(v) if isinstance(v, str) else None)
def test_compressed_tensors_match_the_compressors(
    tmp_path: Path, fmt: str, weights: dict[str, Any], shape: tuple[int, int], scale_dtype: torch.dtype
) -> None:
    torch.manual_seed(4)
    layer = _ct_module(fmt, weights, torch.randn(shape, dtype=scale_dtype) * 0.2)
    head = _ct_module(fmt, weights, torch.randn(shape, dtype=scale_dtype))
    state = {f"model.layers.0.mlp.up_proj.{k}": v for k, v in layer[0].items()}
    state.update({f"lm_head.{k}": v for k, v in head[0].items()})  # ignored, but quantized on disk: dequantized
    state["model.layers.0.mlp.up_proj.input_scale"] = torch.ones(1, dtype=scale_dtype)
    state["model.layers.0.self_attn.k_scale"] = torch.ones((), dtype=scale_dtype)
    state["model.norm.weight"] = torch.randn(shape[1], dtype=scale_dtype)
    tensors = _saved(tmp_path, state)
    config = _ct_config(fmt, weights, ["lm_head"])
    _, scheme, compressor = layer
    reference = compressor.decompress(dict(layer[0]), scheme)["weight"]
    head_reference = compressor.decompress(dict(head[0]), scheme)["weight"]
    for target in TARGETS:
        ours = _dequantized(tensors, config, target)
        assert set(ours) == {"model.layers.0.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"}
        _same(ours["model.layers.0.mlp.up_proj.weight"], reference.to(target))
        _same(ours["lm_head.weight"], head_reference.to(target))


# -- the writers stream a dequantized weight; the guard refuses what it cannot undo ----------------


def test_dequantized_state_dict_is_written_by_ckptconv_save(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    _dequantize_fp8_weight = transformers_fp8_dequantization()

    torch.manual_seed(5)
    q = _fp8_ragged(torch.empty(200, 300), [128, 128])
    state = {"m.weight": q["weight"], "m.weight_scale_inv": q["weight_scale_inv"], "m.bias": torch.randn(200)}
    tensors = _saved(tmp_path, state)
    scheme = detect(FP8_CONFIG, None, tensors)
    assert scheme is not None
    bf16 = dtype_by_name("bfloat16")
    assert bf16 is not None
    out = dequantize(tensors, scheme, bf16)
    assert tensors["m.weight"].storage.source.paths() <= out["m.weight"].storage.source.paths()
    ckptconv.save(out, tmp_path / "out.safetensors")
    written = load_file(str(tmp_path / "out.safetensors"))  # an independent reader
    assert set(written) == {"m.weight", "m.bias"}
    expected = _dequantize_fp8_weight(q["weight"], q["weight_scale_inv"], [128, 128], torch.float32).to(torch.bfloat16)
    _same(written["m.weight"], expected)
    _same(written["m.bias"], state["m.bias"])


def test_plain_float8_without_scales_is_not_quantized(tmp_path: Path) -> None:
    tensors = _saved(tmp_path, {"w": torch.randn(4, 4).to(torch.float8_e4m3fn), "b": torch.randn(4)})
    assert detect(None, {"format": "pt"}, tensors) is None
    assert detect({"model_type": "llama"}, None, tensors) is None


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"quantization_config": {"quant_method": "gptq", "bits": 4}},
            "the checkpoint is quantized with GPTQ (quant_method 'gptq'), which ckptconv cannot dequantize exactly; "
            "load it with its quantization library and save it dequantized first",
        ),
        (
            {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
            "the checkpoint is quantized with bitsandbytes (quant_method 'bitsandbytes'), which ckptconv cannot "
            "dequantize exactly; load it with its quantization library and save it dequantized first",
        ),
        (
            {"quantization_config": {"quant_method": "awq"}},
            "the checkpoint is quantized with AWQ (quant_method 'awq'), which ckptconv cannot dequantize exactly; "
            "load it with its quantization library and save it dequantized first",
        ),
        (
            {"quantization_config": {"bits": 4}},
            "the checkpoint declares a quantization_config without a quant_method; "
            "ckptconv cannot tell how it was quantized",
        ),
    ],
)
def test_declared_schemes_without_an_exact_dequantization_are_refused(config: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedQuantizationError) as caught:
        detect(config, None, {})
    assert str(caught.value) == message
    assert "\n" not in str(caught.value)


def test_safetensors_metadata_declares_a_scheme() -> None:
    metadata = {"quantization_config": json.dumps({"quant_method": "awq"})}
    with pytest.raises(UnsupportedQuantizationError, match=r"^the checkpoint is quantized with AWQ "):
        detect(None, metadata, {})
    scheme = detect(None, {"quantization_config": json.dumps(FP8_CONFIG["quantization_config"])}, {})
    assert scheme is not None and scheme.method == "fp8"


@pytest.mark.parametrize(
    ("tensors", "key", "scheme"),
    [
        ({"l.qweight": torch.zeros(4, 4, dtype=torch.int32), "l.qzeros": torch.zeros(1, 4, dtype=torch.int32),
          "l.scales": torch.ones(1, 4, dtype=torch.float16)}, "l.qweight", "GPTQ/AWQ"),
        ({"l.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn), "l.weight_scale": torch.ones(1)},
         "l.weight_scale", "compressed-tensors"),
        ({"l.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn), "l.weight_scale_inv": torch.ones(1, 1)},
         "l.weight_scale_inv", "fp8 block-scaled"),
        ({"e.down_blocks": torch.zeros(1, 2, 1, 16, dtype=torch.uint8),
          "e.down_scales": torch.zeros(1, 2, 1, dtype=torch.uint8)}, "e.down_blocks", "mxfp4"),
        ({"l.weight": torch.zeros(8, 1, dtype=torch.uint8), "l.weight.absmax": torch.ones(1)},
         "l.weight.absmax", "bitsandbytes"),
    ],
)  # fmt: skip
def test_scale_pairs_without_a_declaration_are_refused(
    tmp_path: Path, tensors: dict[str, torch.Tensor], key: str, scheme: str
) -> None:
    refs = _saved(tmp_path, tensors)
    with pytest.raises(UnsupportedQuantizationError) as caught:
        detect(None, None, refs)
    assert str(caught.value) == (
        f"tensor {key!r} belongs to a {scheme} quantized checkpoint, but no quantization_config declares the "
        "scheme; convert the model folder it came from (its config.json declares it), since a plain cast would "
        "drop its scales"
    )
    assert caught.value.scheme == scheme and caught.value.key == key


def test_layouts_a_declared_scheme_does_not_define_are_refused(tmp_path: Path) -> None:
    bf16 = dtype_by_name("bfloat16")
    assert bf16 is not None
    fp8 = torch.zeros(200, 300).to(torch.float8_e4m3fn)
    refs = _saved(tmp_path, {"m.weight": fp8, "m.weight_scale_inv": torch.ones(1, 3)})
    scheme = detect(FP8_CONFIG, None, refs)
    assert scheme is not None
    with pytest.raises(UnsupportedQuantizationError) as caught:
        dequantize(refs, scheme, bf16)
    assert str(caught.value) == (
        "fp8 block-scaled tensor 'm.weight_scale_inv' has shape [1, 3]; [2, 3] scales a [200, 300] weight in "
        "128 x 128 blocks"
    )
    lone = _saved(tmp_path, {"m.weight": fp8}, "lone.safetensors")
    with pytest.raises(UnsupportedQuantizationError, match=r"^fp8 block-scaled tensor 'm.weight' is float8_e4m3fn "):
        dequantize(lone, scheme, bf16)
    sparse = {"quantization_config": {"quant_method": "compressed-tensors", "sparsity_config": {"format": "sparse-24"}}}
    with pytest.raises(UnsupportedQuantizationError) as caught:
        detect(sparse, None, {})  # the declaration is parsed once, where it is read
    assert str(caught.value) == (
        "the compressed-tensors quantization_config's sparsity_config is set; ckptconv dequantizes quantized "
        "weights, not sparse or transformed ones"
    )
    f64 = dtype_by_name("float64")
    assert f64 is not None
    with pytest.raises(ckptconv.TransformError):
        dequantize(refs, scheme, f64)


def test_compressed_tensors_refusals(tmp_path: Path) -> None:
    bf16 = dtype_by_name("bfloat16")
    assert bf16 is not None
    weights = {"num_bits": 8, "type": "float", "strategy": "channel"}
    module, _, _ = _ct_module("float-quantized", weights, torch.randn(8, 16, dtype=torch.bfloat16))
    state = {f"m.{k}": v for k, v in module.items()}
    state["m.weight_scale"] = state["m.weight_scale"][:4].clone()
    state["orphan.weight_scale"] = torch.ones(1)
    refs = _saved(tmp_path, state)
    scheme = detect(_ct_config("float-quantized", weights, []), None, refs)
    assert scheme is not None
    with pytest.raises(UnsupportedQuantizationError) as caught:
        dequantize(refs, scheme, bf16)
    assert str(caught.value) == "compressed-tensors tensor 'm.weight_scale' has shape [4, 1] for 8 channels"
    del state["m.weight_scale"]
    refs = _saved(tmp_path, {k: v for k, v in state.items() if k.startswith("orphan")}, "orphan.safetensors")
    with pytest.raises(UnsupportedQuantizationError) as caught:
        dequantize(refs, scheme, bf16)
    assert str(caught.value) == (
        "compressed-tensors tensor 'orphan.weight_scale' belongs to no module the config declares quantized"
    )
    mx = _ct_config("float-quantized", weights, [])
    mx["quantization_config"]["config_groups"]["group_0"]["format"] = "mxfp6-pack-quantized"
    with pytest.raises(UnsupportedQuantizationError) as caught:
        dequantize({}, Scheme("compressed-tensors", mx["quantization_config"]), bf16)
    assert str(caught.value) == (
        "the compressed-tensors quantization_config's config_groups.group_0.format is 'mxfp6-pack-quantized', "
        "a format ckptconv cannot dequantize exactly"
    )


def test_the_package_runs_on_numpy_alone() -> None:
    import subprocess
    import sys

    code = "import sys, ckptconv.quantization, ckptconv.quantization.plan; print('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "False"


def test_a_dequantized_weight_is_computed_when_read(tmp_path: Path) -> None:
    from ckptconv.reading.sources import Computed

    q = _fp8_quantize(torch.randn(128, 128), [128, 128])
    refs = _saved(tmp_path, {"m.weight": q["weight"], "m.weight_scale_inv": q["weight_scale_inv"]})
    scheme = detect(FP8_CONFIG, None, refs)
    assert scheme is not None
    fp16 = dtype_by_name("float16")
    assert fp16 is not None
    ref = dequantize(refs, scheme, fp16)["m.weight"]
    assert isinstance(ref.storage.source, Computed) and ref.verbatim_region is None
    assert ref.storage.nbytes == 128 * 128 * 2 and ref.is_whole_storage
    assert ref.storage.source.paths() == {str(tmp_path / "model.safetensors")}
    whole = ref.tobytes()
    assert ref.storage.read(100, 50) == whole[100:150]  # a byte range of the computed tensor


@pytest.mark.parametrize("target", TARGETS)
def test_fp8_per_tensor_scale_without_block_size(tmp_path: Path, target: torch.dtype) -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(6)
    weight = (torch.randn(40, 70) * 50).to(torch.float8_e4m3fn)
    scale = torch.tensor(0.0123, dtype=torch.float32)
    refs = _saved(tmp_path, {"m.weight": weight, "m.weight_scale_inv": scale})
    ours = _dequantized(refs, {"quantization_config": {"quant_method": "fp8", "weight_block_size": None}}, target)
    _same(ours["m.weight"], Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=target))
