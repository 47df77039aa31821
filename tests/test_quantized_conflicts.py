"""Issue 39: a quantized model's config and its tensors disagree, or its config is hostile.

The tensors decide and the config is checked against them: a weight with a companion of a known scheme
is dequantized by the scheme its tensors show (compared with the scheme's own library: transformers,
compressed-tensors, optimum-quanto) or refused in one line; a last check on every output refuses
orphan scales and a config.json that does not say what the tensors are. Every test here failed on the
code before (the notes in changes/quant.md give the outputs before and after), except the controls,
which stay as they were.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckptconv
from ckptconv.errors import CkptconvError, UnsupportedQuantizationError

from .conftest import run_cli
from .test_quantized import TARGETS, _ct_config, _ct_module, _fp8_quantize, _same
from .test_quantized_cli import model_folder

FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
CT_FP8 = {"num_bits": 8, "type": "float", "strategy": "channel"}


def _convert(folder: Path, out: Path, *args: str) -> tuple[int, str]:
    code, _, err = run_cli("convert", str(folder), str(out) + "/", "--dtype", "bf16", *args)
    return code, err


def _assert_refused(folder: Path, out: Path, error: str) -> None:
    """Converting ``folder`` fails with exactly ``error`` and leaves nothing at ``out``."""
    code, err = _convert(folder, out)
    assert code == 1
    assert err == error
    assert not out.exists()


def _deepseek_layer() -> dict[str, torch.Tensor]:
    torch.manual_seed(11)
    q = _fp8_quantize(torch.randn(128, 256), [128, 128])
    head = _fp8_quantize(torch.randn(128, 256) * 4, [128, 128])
    return {
        "model.layers.0.mlp.up_proj.weight": q["weight"],
        "model.layers.0.mlp.up_proj.weight_scale_inv": q["weight_scale_inv"],
        "lm_head.weight": head["weight"],
        "lm_head.weight_scale_inv": head["weight_scale_inv"],
        "model.norm.weight": torch.randn(256, dtype=torch.bfloat16),
    }


# -- a list in the config names a module that is quantized on disk -------------------------------------------


def test_fp8_modules_to_not_convert_naming_a_quantized_module_is_dequantized_by_its_scales(tmp_path: Path) -> None:
    """Before: lm_head.weight plain-cast (float8 codes as values), its scale_inv written beside it, the
    quantization_config removed: max error 447.6 against the dequantized reference."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    state = _deepseek_layer()
    config = {"model_type": "llama", "quantization_config": {**FP8, "modules_to_not_convert": ["lm_head"]}}
    folder = model_folder(tmp_path / "q", state, config)
    assert _convert(folder, tmp_path / "out")[0] == 0
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(written) == ["lm_head.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    reference = Fp8Dequantize(None)
    for name in ("lm_head.weight", "model.layers.0.mlp.up_proj.weight"):
        expected = reference._dequantize_one(state[name], state[name + "_scale_inv"], output_dtype=torch.bfloat16)
        _same(written[name], expected)
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())


def test_fp8_modules_to_not_convert_control_a_wrong_scale_grid_stays_refused(tmp_path: Path) -> None:
    state = _deepseek_layer()
    state["lm_head.weight_scale_inv"] = torch.ones(1, 1)
    config = {"quantization_config": {**FP8, "modules_to_not_convert": ["lm_head"]}}
    error = (
        "ckptconv: error: fp8 block-scaled tensor 'lm_head.weight_scale_inv' has shape [1, 1]; [1, 2] scales a "
        "[128, 256] weight in 128 x 128 blocks\n"
    )
    _assert_refused(model_folder(tmp_path / "q", state, config), tmp_path / "out", error)


def test_mxfp4_modules_to_not_convert_naming_quantized_experts_is_dequantized_by_their_scales(tmp_path: Path) -> None:
    """Before: the experts' _blocks/_scales kept under a dropped config (a loader leaves them at random init)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(16)
    experts = "model.layers.0.mlp.experts."
    blocks = torch.randint(0, 256, (2, 24, 3, 16), dtype=torch.uint8)
    scales = torch.randint(118, 136, (2, 24, 3), dtype=torch.uint8)
    state = {experts + "gate_up_proj_blocks": blocks, experts + "gate_up_proj_scales": scales}
    config = {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.0.mlp"]}}
    assert _convert(model_folder(tmp_path / "q", state, config), tmp_path / "out")[0] == 0
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert list(written) == [experts + "gate_up_proj"]
    _same(written[experts + "gate_up_proj"], convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))


def _ct_state(ignored_head: bool = True) -> tuple[dict[str, torch.Tensor], Any, Any, dict[str, Any]]:
    torch.manual_seed(12)
    layer, scheme, compressor = _ct_module("float-quantized", CT_FP8, torch.randn(64, 96, dtype=torch.bfloat16))
    head, _, _ = _ct_module("float-quantized", CT_FP8, torch.randn(64, 96, dtype=torch.bfloat16) * 3)
    state = {f"model.layers.0.mlp.up_proj.{k}": v for k, v in layer.items()}
    state.update({f"lm_head.{k}": v for k, v in head.items()})
    config = _ct_config("float-quantized", CT_FP8, ["lm_head"] if ignored_head else [])
    return state, scheme, compressor, config


def test_compressed_tensors_ignore_naming_a_quantized_module_is_dequantized_by_its_scales(tmp_path: Path) -> None:
    """Before: lm_head.weight plain-cast, lm_head.weight_scale kept, the quantization_config removed."""
    state, scheme, compressor, config = _ct_state()
    folder = model_folder(tmp_path / "q", state, {"model_type": "llama", **config})
    assert _convert(folder, tmp_path / "out")[0] == 0
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(written) == ["lm_head.weight", "model.layers.0.mlp.up_proj.weight"]
    for module in ("lm_head", "model.layers.0.mlp.up_proj"):
        tensors = {k.rpartition(".")[2]: v for k, v in state.items() if k.startswith(module + ".")}
        _same(written[module + ".weight"], compressor.decompress(tensors, scheme)["weight"].to(torch.bfloat16))


def test_an_older_compression_config_is_removed_with_the_dequantization(tmp_path: Path) -> None:
    """Before: config.json kept its compression_config over the dequantized weights."""
    state, _, _, config = _ct_state()
    folder = model_folder(tmp_path / "q", state, {"compression_config": config["quantization_config"]})
    assert _convert(folder, tmp_path / "out")[0] == 0
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "compression_config" not in written and "quantization_config" not in written, written


def test_compressed_tensors_ignored_quantized_module_no_group_targets_is_refused(tmp_path: Path) -> None:
    state, _, _, config = _ct_state()
    config["quantization_config"]["config_groups"]["group_0"]["targets"] = ["re:model\\.layers\\..*"]
    error = (
        "ckptconv: error: compressed-tensors tensor 'lm_head.weight' is quantized on disk (its module is in ignore), "
        "but no config group targets its module, so ckptconv cannot tell its strategy\n"
    )
    _assert_refused(model_folder(tmp_path / "q", state, config), tmp_path / "out", error)


# -- the declared scheme and the tensors' scheme disagree ----------------------------------------------------


def _int4_packed() -> dict[str, torch.Tensor]:
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}
    module, _, _ = _ct_module("pack-quantized", weights, torch.randn(64, 128, dtype=torch.bfloat16))
    return {f"model.layers.0.mlp.up_proj.{k}": v for k, v in module.items()}


def _quanto_pair() -> dict[str, torch.Tensor]:
    return {
        "model.layers.0.mlp.up_proj.weight._data": (torch.randn(8, 8) * 50).to(torch.float8_e4m3fn),
        "model.layers.0.mlp.up_proj.weight._scale": torch.rand(8, 1),
    }


@pytest.mark.parametrize(
    ("tensors", "declared", "key", "what"),
    [
        (_deepseek_layer, _ct_config("float-quantized", CT_FP8, [])["quantization_config"],
         "lm_head.weight_scale_inv", "a DeepSeek fp8 block scale"),
        (_deepseek_layer, {"quant_method": "mxfp4"}, "lm_head.weight_scale_inv", "a DeepSeek fp8 block scale"),
        (_int4_packed, FP8, "model.layers.0.mlp.up_proj.weight_packed", "a compressed-tensors packed weight"),
        (_quanto_pair, FP8, "model.layers.0.mlp.up_proj.weight._data", "an optimum-quanto _data tensor"),
        (_deepseek_layer, {"quant_method": "quanto", "weights": "float8"},
         "lm_head.weight_scale_inv", "a DeepSeek fp8 block scale"),
    ],
    ids=["ct-over-deepseek", "mxfp4-over-deepseek", "fp8-over-int4", "fp8-over-quanto", "quanto-over-deepseek"],
)  # fmt: skip
def test_a_declared_scheme_the_tensors_contradict_is_refused(
    tmp_path: Path, tensors: Any, declared: dict[str, Any], key: str, what: str
) -> None:
    """Before: a plain cast (ct/mxfp4 over fp8 blocks), the packed tensors kept with the config dropped."""
    state = tensors()
    code, err = _convert(model_folder(tmp_path / "q", state, {"quantization_config": declared}), tmp_path / "out")
    method = declared["quant_method"]
    message = (
        f"tensor {key!r} is {what}, but the quantization_config declares {method}; the config and the tensors "
        "disagree, so ckptconv cannot tell how to dequantize it: fix the quantization_config"
    )
    assert (code, err) == (1, f"ckptconv: error: {message}\n")
    assert not (tmp_path / "out").exists()
    assert ckptconv.inspect(tmp_path / "q").quantization == f"refused: {message}"
    alone = tmp_path / "alone.safetensors"  # declared in the safetensors metadata instead: checked the same way
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        str(alone),
        metadata={"quantization_config": json.dumps(declared)},
    )
    code, _, err = run_cli("convert", str(alone), str(tmp_path / "alone-out.safetensors"), "--dtype", "bf16")
    assert (code, err) == (1, f"ckptconv: error: {message}\n")


def test_a_compressed_tensors_group_whose_format_is_not_the_tensors_is_refused(tmp_path: Path) -> None:
    config = _ct_config("float-quantized", CT_FP8, [])
    code, err = _convert(model_folder(tmp_path / "q", _int4_packed(), config), tmp_path / "out")
    assert code == 1
    assert err == (
        "ckptconv: error: compressed-tensors tensor 'model.layers.0.mlp.up_proj.weight_packed' is packed "
        "(weight_packed) on disk, but its config group 'group_0' declares format 'float-quantized'; the config and "
        "the tensors disagree\n"
    )


# -- a compressed-tensors fp8 weight without its scale ------------------------------------------------------------


def test_compressed_tensors_fp8_weight_without_its_scale_is_refused(tmp_path: Path) -> None:
    """Before: written as its raw float8 values (up to 448), the config saying unquantized."""
    state, _, _, config = _ct_state(ignored_head=False)
    del state["lm_head.weight_scale"]
    error = (
        "ckptconv: error: compressed-tensors tensor 'lm_head.weight_scale' is missing: 'lm_head.weight' is "
        "float8_e4m3fn, quantized by config group 'group_0', and a plain cast would write its raw values\n"
    )
    _assert_refused(model_folder(tmp_path / "q", state, config), tmp_path / "out", error)


def test_control_an_ignored_unquantized_module_is_left_as_it_is(tmp_path: Path) -> None:
    state, _, _, config = _ct_state()
    state = {k: v for k, v in state.items() if not k.startswith("lm_head.")}
    state["lm_head.weight"] = torch.randn(64, 96, dtype=torch.bfloat16)
    assert _convert(model_folder(tmp_path / "q", state, config), tmp_path / "out")[0] == 0
    _same(load_file(str(tmp_path / "out" / "model.safetensors"))["lm_head.weight"], state["lm_head.weight"])


# -- exact: compressed-tensors mxfp4-pack-quantized (MXFP4A16), optimum-quanto qfloat8 / qint8 ------------------

MXFP4 = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_compressed_tensors_mxfp4_matches_its_decompressor(tmp_path: Path, weight_dtype: torch.dtype) -> None:
    """Before: refused (format 'mxfp4-pack-quantized' ... cannot dequantize exactly). Every scale byte once."""
    torch.manual_seed(13)
    module, scheme, compressor = _ct_module("mxfp4-pack-quantized", MXFP4, torch.randn(64, 256, dtype=weight_dtype))
    every = dict(module)
    every["weight_scale"] = torch.arange(256, dtype=torch.uint8).reshape(32, 8)  # 2**-127 ... 2**127, and inf
    every["weight_packed"] = torch.randint(0, 256, (32, 128), dtype=torch.uint8)
    state = {f"model.layers.0.mlp.up_proj.{k}": v for k, v in module.items()}
    state.update({f"model.layers.1.mlp.up_proj.{k}": v for k, v in every.items()})
    folder = model_folder(tmp_path / "q", state, _ct_config("mxfp4-pack-quantized", MXFP4, []))
    for target in TARGETS:
        name = str(target).removeprefix("torch.")
        out = tmp_path / f"out-{name}"
        code, _, err = run_cli("convert", str(folder), str(out) + "/", "--dtype", name)
        assert code == 0, err
        written = load_file(str(out / "model.safetensors"))
        assert sorted(written) == ["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"]
        for index, tensors in enumerate((module, every)):
            expected = compressor.decompress(dict(tensors), scheme)["weight"].to(target)
            _same(written[f"model.layers.{index}.mlp.up_proj.weight"], expected)


def _quanto_model(qtype: str, dtype: torch.dtype) -> torch.nn.Module:
    quanto = pytest.importorskip("optimum.quanto")
    torch.manual_seed(14)
    model = torch.nn.Sequential(torch.nn.Linear(96, 40), torch.nn.ReLU(), torch.nn.Linear(40, 24)).to(dtype)
    quanto.quantize(model, weights=getattr(quanto, qtype))
    quanto.freeze(model)
    return model


@pytest.mark.parametrize("qtype", ["qfloat8", "qfloat8_e5m2", "qint8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("declared", [True, False])
def test_quanto_pairs_match_quantos_dequantize(tmp_path: Path, qtype: str, dtype: torch.dtype, declared: bool) -> None:
    """Before: refused when declared (quant_method 'quanto'), plain-cast (the _data codes as values, the _scale
    kept) when not."""
    model = _quanto_model(qtype, dtype)
    state = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    config = {"quantization_config": {"quant_method": "quanto", "weights": "float8" if "float" in qtype else "int8"}}
    folder = model_folder(tmp_path / "q", state, config if declared else {"model_type": "llama"})
    for target in TARGETS:
        name = str(target).removeprefix("torch.")
        out = tmp_path / f"out-{name}"
        code, _, err = run_cli("convert", str(folder), str(out) + "/", "--dtype", name)
        assert code == 0, err
        written = load_file(str(out / "model.safetensors"))
        assert sorted(written) == ["model.0.bias", "model.0.weight", "model.2.bias", "model.2.weight"]
        for index in (0, 2):
            _same(written[f"model.{index}.weight"], model[index].weight.dequantize().to(target))
            _same(written[f"model.{index}.bias"], model[index].bias.detach().to(target))


def test_quanto_qint4_is_refused_in_one_line(tmp_path: Path) -> None:
    state = {f"model.{k}": v.contiguous() for k, v in _quanto_model("qint4", torch.float32).state_dict().items()}
    error = (
        "ckptconv: error: optimum-quanto tensor 'model.0.weight._data._data' is a packed qint4/qint2 tensor, whose "
        "weight shape the checkpoint does not hold (quanto keeps it in the module); load it with optimum-quanto and "
        "save it dequantized first\n"
    )
    _assert_refused(model_folder(tmp_path / "q", state, {"model_type": "llama"}), tmp_path / "out", error)


# -- the last check on every output ----------------------------------------------------------------------------


def test_save_refuses_an_orphan_scale(tmp_path: Path) -> None:
    weight = torch.zeros(4, 4).to(torch.float8_e4m3fn)
    for state, orphan, missing in [
        ({"a.weight_scale_inv": torch.ones(1, 1), "b.weight": weight}, "a.weight_scale_inv", "a.weight"),
        ({"a.weight_scale": torch.ones(1)}, "a.weight_scale", "a.weight"),
        ({"a.weight_packed": torch.zeros(4, 1, dtype=torch.int32)}, "a.weight_packed", "a.weight_scale"),
        ({"a.weight._scale": torch.ones(4, 1)}, "a.weight._scale", "a.weight._data"),
        ({"e.down_scales": torch.zeros(1, 2, 1, dtype=torch.uint8)}, "e.down_scales", "e.down_blocks"),
    ]:
        with pytest.raises(UnsupportedQuantizationError) as caught:
            ckptconv.save(state, tmp_path / "out.safetensors")
        assert str(caught.value) == (
            f"the output would hold {orphan!r} without {missing!r} beside it: a quantization companion with "
            "nothing to scale (or a quantized weight without its scale); nothing was written"
        )
        assert not (tmp_path / "out.safetensors").exists()
    ckptconv.save({"a.weight": weight, "a.weight_scale_inv": torch.ones(1, 1)}, tmp_path / "kept.safetensors")


def test_the_last_check_catches_a_path_that_dropped_the_dequantization(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path that skipped the dequantization (here: the stage made a no-op) writes no float8 codes as weights."""
    from ckptconv.quantization import plan, stage

    folder = model_folder(tmp_path / "q", _deepseek_layer(), {"quantization_config": FP8})
    monkeypatch.setitem(plan._PLANNERS, "fp8", lambda tensors, scheme, target: dict(tensors))
    code, err = _convert(folder, tmp_path / "a")
    assert code == 1
    assert err == (
        "ckptconv: error: fp8 tensor 'lm_head.weight_scale_inv' (a DeepSeek fp8 block scale) would stay beside the "
        "dequantized weights\n"
    )
    monkeypatch.setattr(stage.Dequantization, "apply", lambda self, selection: selection)
    code, err = _convert(folder, tmp_path / "b")
    assert code == 1
    assert err == (
        "ckptconv: error: the output's config.json would declare no quantization_config, but "
        "'lm_head.weight_scale_inv' (a DeepSeek fp8 block scale) stays quantized; a loader would read its codes as "
        "weights: pass --dtype bf16 to dequantize them\n"
    )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_config_check_refuses_a_declaration_over_no_quantized_tensor(tmp_path: Path) -> None:
    from ckptconv.writing.model_files import rewritten_config

    save_file({"a.weight": torch.ones(2, 2)}, str(tmp_path / "plain.safetensors"))
    refs = dict(ckptconv.open(tmp_path / "plain.safetensors").tensors())
    with pytest.raises(UnsupportedQuantizationError) as caught:
        rewritten_config({"quantization_config": FP8}, refs)
    assert str(caught.value) == (
        "the output's config.json would keep its quantization_config, but no quantized tensor remains (no scale, "
        "packed weight or zero point); a loader would expect quantized layers: convert the quantized weights with "
        "--dtype to dequantize them"
    )
    assert rewritten_config({"model_type": "llama"}, refs)[0] == {"model_type": "llama"}
    kv_only = {"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8, "type": "float"}}
    kv_refs = {**refs, "a.k_scale": refs["a.weight"]}  # a config that quantizes only the kv cache: kept
    assert rewritten_config({"quantization_config": kv_only}, kv_refs)[0] == {"quantization_config": kv_only}


def test_a_kept_quantized_folder_keeps_its_config(tmp_path: Path) -> None:
    """Control: without --dtype the weights stay quantized, their config with them."""
    folder = model_folder(tmp_path / "q", _deepseek_layer(), {"quantization_config": FP8})
    code, _, err = run_cli("convert", str(folder), str(tmp_path / "out") + "/")
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"] == FP8
    assert "lm_head.weight_scale_inv" in load_file(str(tmp_path / "out" / "model.safetensors"))


# -- hostile configs: one validated schema, regexes in linear time, only CkptconvError -------------------------

_GROUP = {"targets": ["Linear"], "weights": CT_FP8}


def _ct(**changes: Any) -> dict[str, Any]:
    groups = {"g": _GROUP}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": groups, **changes}


def _weights(**changes: Any) -> dict[str, Any]:
    return _ct(config_groups={"g": {"targets": ["Linear"], "weights": {**CT_FP8, **changes}}})


HOSTILE = [
    (_weights(num_bits="eight"), "config_groups.g.weights.num_bits is 'eight', not an integer from 1 to 8"),
    (_weights(num_bits=True), "config_groups.g.weights.num_bits is True, not an integer from 1 to 8"),
    (_weights(num_bits=64), "config_groups.g.weights.num_bits is 64, not an integer from 1 to 8"),
    (
        _weights(strategy="block", block_structure=[0, 0]),
        "config_groups.g.weights.block_structure is [0, 0], not two positive integers of at most 2147483648",
    ),
    (
        _weights(strategy="block", block_structure=[2**40, 1]),
        "config_groups.g.weights.block_structure is [1099511627776, 1], not two positive integers of at most "
        "2147483648",
    ),
    (_weights(strategy="block"), "config_groups.g.weights.block_structure is None, but the strategy is 'block'"),
    (
        _weights(strategy="diagonal"),
        "config_groups.g.weights.strategy is 'diagonal', not one of block, channel, group, tensor, tensor_group",
    ),
    (_weights(strategy="group", group_size=0), "config_groups.g.weights.group_size is 0, not an integer from 1 to "
     "2147483648"),
    (_weights(symmetric="yes"), "config_groups.g.weights.symmetric is 'yes', not true or false"),
    (_weights(type="complex"), "config_groups.g.weights.type is 'complex', not 'int' or 'float'"),
    (_ct(config_groups=[1, 2]), "config_groups is [1, 2], not a mapping of groups"),
    (_ct(config_groups={"g": 5}), "config_groups.g is 5, not a mapping"),
    (_ct(ignore="lm_head"), "ignore is 'lm_head', not a list of module names"),
    (_ct(ignore=[1]), "ignore is [1], not a list of module names"),
    ({**FP8, "weight_block_size": [-1, 128]}, "weight_block_size is [-1, 128], not two positive integers of at most "
     "2147483648"),
    ({**FP8, "weight_block_size": "128"}, "weight_block_size is '128', not two positive integers"),
    ({**FP8, "modules_to_not_convert": "lm_head"}, "modules_to_not_convert is 'lm_head', not a list of module names"),
    (_weights(strategy=["group"]), "config_groups.g.weights.strategy is ['group'], not one of block, channel, group, "
     "tensor, tensor_group"),
    ({"quant_method": "quanto", "weights": {}}, "weights is {}, not one of float8, float8_e4m3fn, float8_e5m2, int2, "
     "int4, int8"),
    ({"quant_method": "quanto", "weights": "int3"}, "weights is 'int3', not one of float8, float8_e4m3fn, "
     "float8_e5m2, int2, int4, int8"),
]  # fmt: skip


def _hostile_folder(tmp_path: Path, config: dict[str, Any]) -> Path:
    state = {"model.layers.0.mlp.up_proj.weight": torch.randn(4, 4, dtype=torch.bfloat16)}
    return model_folder(tmp_path / "q", state, {"model_type": "llama", "quantization_config": config})


@pytest.mark.parametrize(("config", "problem"), HOSTILE)
def test_hostile_quantization_configs_raise_one_line_errors(
    tmp_path: Path, config: dict[str, Any], problem: str
) -> None:
    """Before: ValueError / ZeroDivisionError / MemoryError tracebacks, or a silent pass."""
    folder = _hostile_folder(tmp_path, config)
    method = config["quant_method"]
    message = f"the {method} quantization_config's {problem}"
    with pytest.raises(CkptconvError) as caught:
        ckptconv.convert(folder, tmp_path / "out.safetensors", transforms=[ckptconv.Cast("bfloat16")])
    assert type(caught.value) is UnsupportedQuantizationError
    assert str(caught.value) == message
    assert not (tmp_path / "out.safetensors").exists()
    assert ckptconv.inspect(folder).quantization == f"refused: {message}"
    assert set(ckptconv.open(folder).select().weights) == {"model.layers.0.mlp.up_proj.weight"}  # names only
    assert set(ckptconv.load(folder)) == {"model.layers.0.mlp.up_proj.weight"}
    assert ckptconv.fit(ckptconv.load(folder), folder)[1].ok  # fit reads the reference's names, not its scheme
    code, out, err = run_cli("convert", str(folder), str(tmp_path / "cli.safetensors"), "--dtype", "bf16")
    assert (code, out, err) == (1, "", f"ckptconv: error: {message}\n")
    code, out, err = run_cli("inspect", str(folder))
    assert code == 0 and f"quantized: refused: {message}\n" in out and err == ""


def test_quant_method_that_is_not_a_name_is_refused(tmp_path: Path) -> None:
    folder = _hostile_folder(tmp_path, {"quant_method": ["fp8"] * 3})
    code, _, err = run_cli("convert", str(folder), str(tmp_path / "out.safetensors"), "--dtype", "bf16")
    assert (code, err) == (
        1,
        "ckptconv: error: the quantization_config's quant_method is ['fp8', 'fp8', 'fp8'], not a name; ckptconv "
        "cannot tell how the checkpoint was quantized\n",
    )


def _redos_folder(tmp_path: Path, pattern: str, where: str = "ignore") -> Path:
    torch.manual_seed(15)
    module = "a" * 40 + "b"
    layer, _, _ = _ct_module("float-quantized", CT_FP8, torch.randn(8, 16, dtype=torch.bfloat16))
    state = {f"{module}.{k}": v for k, v in layer.items()}
    config = _ct_config("float-quantized", CT_FP8, [pattern] if where == "ignore" else [])
    if where == "targets":
        config["quantization_config"]["config_groups"]["group_0"]["targets"] = [pattern, "re:a+b"]
    return model_folder(tmp_path / "q", state, config)


@pytest.mark.parametrize("where", ["ignore", "targets"])
def test_a_backtracking_regex_does_not_hang_convert(tmp_path: Path, where: str) -> None:
    """Before: ``re:(a|a)*$`` against a module named a*40 + b ran for minutes (Python's re backtracks)."""
    pytest.importorskip("re2")
    folder = _redos_folder(tmp_path, "re:(a|a)*$", where)
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "ckptconv", "convert", str(folder), str(out) + "/", "--dtype", "bf16"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert list(load_file(str(out / "model.safetensors"))) == ["a" * 40 + "b.weight"]


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("re:(a|a)*$", "repeats a group or has many repeats (google-re2 is not installed); ckptconv runs only "
         "patterns it can match in linear time"),
        ("re:(a+)+", "repeats a group or has many repeats (google-re2 is not installed); ckptconv runs only patterns "
         "it can match in linear time"),
        ("re:a*a*a*$", "repeats a group or has many repeats (google-re2 is not installed); ckptconv runs only "
         "patterns it can match in linear time"),
        ("re:(a|a){30}", "repeats a group or has many repeats (google-re2 is not installed); ckptconv runs only "
         "patterns it can match in linear time"),
        ("re:(a)\\1", "has a back-reference or look-around (google-re2 is not installed); ckptconv runs only "
         "patterns it can match in linear time"),
        ("re:(unclosed", "does not compile (missing ), unterminated subpattern at position 0); fix the pattern"),
    ],
)  # fmt: skip
def test_without_re2_patterns_that_can_backtrack_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pattern: str, why: str
) -> None:
    from ckptconv.quantization import patterns

    monkeypatch.setattr(patterns, "_re2", None)
    patterns._compiled.cache_clear()
    folder = _redos_folder(tmp_path, pattern)
    code, _, err = run_cli("convert", str(folder), str(tmp_path / "out") + "/", "--dtype", "bf16")
    assert (code, err) == (1, f"ckptconv: error: the quantization_config's ignore pattern {pattern[3:]!r} {why}\n")
    assert patterns.engine() == "re"


def test_without_re2_a_plain_pattern_still_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptconv.quantization import patterns

    monkeypatch.setattr(patterns, "_re2", None)
    patterns._compiled.cache_clear()
    folder = _redos_folder(tmp_path, "re:a+b$", "targets")
    assert _convert(folder, tmp_path / "out")[0] == 0


def test_without_re2_the_work_of_all_matches_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptconv.quantization import patterns

    monkeypatch.setattr(patterns, "_re2", None)
    monkeypatch.setattr(patterns, "MAX_WORK", 1_000)  # 41 characters: 42 ** 2 + 42 ** 1 steps for the two targets
    folder = _redos_folder(tmp_path, "re:a*a*b$", "targets")
    code, err = _convert(folder, tmp_path / "out")
    assert (code, err) == (
        1,
        "ckptconv: error: the quantization_config's patterns take too long to match without google-re2 (over 1,000 "
        "steps); install google-re2, which matches them in linear time\n",
    )
    monkeypatch.setattr(patterns, "MAX_NAME", 40)
    code, err = _convert(folder, tmp_path / "out")
    assert (code, err) == (
        1,
        f"ckptconv: error: module name {'a' * 40 + 'b'!r} is longer than 40 characters; install google-re2 to "
        "match it against the quantization_config's patterns\n",
    )


def test_with_re2_a_pattern_re2_cannot_run_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("re2")
    folder = _redos_folder(tmp_path, "re:(a)\\1")
    code, err = _convert(folder, tmp_path / "out")
    assert code == 1
    assert err.startswith("ckptconv: error: the quantization_config's ignore pattern '(a)\\\\1' does not compile (")
    assert err.endswith("); fix the pattern\n") and err.count("\n") == 1
