"""Model layouts ckptconv refused or misdescribed (issue 39, item 4), each checked with the framework's own loader.

- the tie flag in a written ``config.json`` follows the tensors written (``from_pretrained`` loads them with
  nothing missing or unexpected, and gives the logits of a model holding exactly those tensors);
- a Hub folder holding both ``model.safetensors`` and ``pytorch_model.bin`` (or both sharded indexes): the
  safetensors are converted, as transformers loads them, with a note naming what was left out;
- a torch.ao quantized model's state dict (``_packed_params``): named in the refusal.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

import ckptconv

from .conftest import assert_same_state, assert_same_tensor, run_cli, tiny_gpt2, tiny_llama

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _llama(tied: bool) -> Any:
    return tiny_llama(tied=tied).eval()


def _gpt2() -> Any:  # GPT-2's class ties by default
    return tiny_gpt2().eval()


MODELS = {"llama": (lambda: _llama(True), "model.embed_tokens.weight"), "gpt2": (_gpt2, "transformer.wte.weight")}
IDS = torch.arange(12).reshape(2, 6) % 96


def _bin_folder(tmp_path: Path, name: str, *, drop_tie_flag: bool = False) -> tuple[Any, Path]:
    """A tied model saved as torch.save(model.state_dict()) writes it: the head and the embedding one storage."""
    torch.manual_seed(0)
    model = MODELS[name][0]()
    folder = tmp_path / name
    model.config.save_pretrained(folder)
    if drop_tie_flag:
        config = json.loads((folder / "config.json").read_text())
        del config["tie_word_embeddings"]
        (folder / "config.json").write_text(json.dumps(config))
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state[MODELS[name][1]].data_ptr()
    torch.save(state, folder / "pytorch_model.bin")
    return model, folder


def _loads_cleanly(out: Path) -> Any:
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {key: list(value) for key, value in info.items()} == {key: [] for key in info}, info
    return loaded.eval()


def _logits_of(model: Any, state: dict[str, Any], tied: bool) -> Any:
    """The logits of ``model``'s architecture holding exactly ``state`` (upcast to float32), tied or not."""
    config = model.config.__class__.from_dict({**model.config.to_dict(), "tie_word_embeddings": tied})
    fresh = model.__class__(config).eval()
    fresh.load_state_dict({key: value.float() for key, value in state.items()}, strict=not tied)
    with torch.no_grad():
        return fresh(IDS).logits


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("drop_tie_flag", [False, True], ids=["flag", "no-flag"])
def test_a_head_kept_apart_by_keep_dtype_unties_the_config(name: str, drop_tie_flag: bool, tmp_path: Path) -> None:
    model, folder = _bin_folder(tmp_path, name, drop_tie_flag=drop_tie_flag)
    out = tmp_path / "out"
    code, _, err = run_cli(
        "convert", str(folder), f"{out}/", "--dtype", "bf16", "--keep-dtype", "lm_head", "--tied", "copy"
    )
    assert code == 0, err
    written = load_file(out / "model.safetensors")
    assert written["lm_head.weight"].dtype == torch.float32 and written[MODELS[name][1]].dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    loaded = _loads_cleanly(out)
    with torch.no_grad():
        got = loaded.float()(IDS).logits
    assert torch.equal(got, _logits_of(model, written, tied=False))
    assert not torch.equal(got, _logits_of(model, written, tied=True))  # the tie the old config claimed


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("options", [["--tied", "copy"], [], ["--dtype", "bf16"]], ids=["copy", "dedupe", "cast"])
def test_a_head_written_as_the_embedding_stays_tied(name: str, options: list[str], tmp_path: Path) -> None:
    """The negative control: the head is the embedding as written (copied, stored once, or cast alike)."""
    model, folder = _bin_folder(tmp_path, name)
    out = tmp_path / "out"
    code, _, err = run_cli("convert", str(folder), f"{out}/", *options)
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert "tie_word_embeddings" not in err
    loaded = _loads_cleanly(out)
    written = load_file(out / "model.safetensors")
    with torch.no_grad():
        got = loaded.float()(IDS).logits
    assert torch.equal(got, _logits_of(model, written, tied=True))


# --- Megatron-LM's nested legacy layout --------------------------------------------------------------------------


def _legacy_model(seed: int, layers: int, gated: bool) -> dict[str, Any]:
    """A full (unsplit) model as Megatron-LM's legacy GPTModel names it: ``language_model.{embedding, encoder,
    output_layer}`` (legacy/model/language_model.py), the encoder's names flat (ParallelTransformer.state_dict)."""
    torch.manual_seed(seed)
    h, f, v = 8, 16, 24
    model: dict[str, Any] = {
        "language_model.embedding.word_embeddings.weight": torch.randn(v, h),
        "language_model.embedding.position_embeddings.weight": torch.randn(32, h),
    }
    for i in range(layers):
        p = f"language_model.encoder.layers.{i}."
        model |= {
            p + "input_layernorm.weight": torch.randn(h),
            p + "input_layernorm.bias": torch.randn(h),
            p + "self_attention.query_key_value.weight": torch.randn(3 * h, h),
            p + "self_attention.query_key_value.bias": torch.randn(3 * h),
            p + "self_attention.dense.weight": torch.randn(h, h),
            p + "self_attention.dense.bias": torch.randn(h),
            p + "post_attention_layernorm.weight": torch.randn(h),
            p + "mlp.dense_h_to_4h.weight": torch.randn((2 if gated else 1) * f, h),
            p + "mlp.dense_4h_to_h.weight": torch.randn(h, f),
            p + "mlp.dense_4h_to_h.bias": torch.randn(h),
        }
    model["language_model.encoder.final_layernorm.weight"] = torch.randn(h)
    model["language_model.output_layer.weight"] = torch.randn(v, h)
    return model


def _rank_piece(name: str, tensor: Any, rank: int, ranks: int, gated: bool) -> Any:
    """What Megatron's tensor-parallel layers hold on ``rank`` (ColumnParallelLinear: rows; RowParallelLinear:
    columns; VocabParallelEmbedding: rows; a SwiGLU fc1: [gate_r; up_r])."""
    if name.endswith(
        ("query_key_value.weight", "query_key_value.bias", "word_embeddings.weight", "output_layer.weight")
    ):
        return tensor.chunk(ranks)[rank].clone()
    if name.endswith("dense_h_to_4h.weight"):
        if gated:
            gate, up = tensor.chunk(2)
            return torch.cat([gate.chunk(ranks)[rank], up.chunk(ranks)[rank]]).clone()
        return tensor.chunk(ranks)[rank].clone()
    if name.endswith(("self_attention.dense.weight", "dense_4h_to_h.weight")):
        return tensor.chunk(ranks, dim=1)[rank].clone()
    return tensor.clone()


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """The nesting of GPTModel.state_dict_for_save_checkpoint: ``{"language_model": {"embedding":
    {"word_embeddings": {"weight": t}, ...}, "encoder": {"layers.0.…": t}, "output_layer": {"weight": t}}}``."""
    from collections import OrderedDict

    lm: dict[str, Any] = {}
    for name, tensor in flat.items():
        part, rest = name.removeprefix("language_model.").split(".", 1)
        if part == "embedding":
            table, leaf = rest.split(".")
            lm.setdefault("embedding", {}).setdefault(table, OrderedDict())[leaf] = tensor
        elif part == "encoder":
            lm.setdefault("encoder", OrderedDict())[rest] = tensor
        else:
            lm.setdefault(part, OrderedDict())[rest] = tensor
    return {"language_model": lm}


def _save_legacy_run(root: Path, model: dict[str, Any], tp: int, gated: bool) -> Path:
    import argparse

    args = argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, num_layers=2)
    (root / "latest_checkpointed_iteration.txt").parent.mkdir(parents=True, exist_ok=True)
    (root / "latest_checkpointed_iteration.txt").write_text("5")
    for rank in range(tp):
        folder = root / "iter_0000005" / f"mp_rank_{rank:02d}"
        folder.mkdir(parents=True)
        pieces = {name: _rank_piece(name, tensor, rank, tp, gated) for name, tensor in model.items()}
        state = {"args": args, "checkpoint_version": 3.0, "iteration": 5, "model": _nest(pieces)}
        torch.save(state, folder / "model_optim_rng.pt")
    return root


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
def test_the_nested_legacy_layout_reads_as_its_full_state_dict(tp: int, gated: bool, tmp_path: Path) -> None:
    model = _legacy_model(0, layers=2, gated=gated)
    run = _save_legacy_run(tmp_path / "run", model, tp, gated)
    info = ckptconv.inspect(run)
    assert info.format == "megatron-legacy" and len(info.tensors) == len(model)  # was 0 entries
    loaded = ckptconv.load(run)
    assert_same_state(loaded, model)  # the same keys in order, dtypes, shapes and bytes
    ckptconv.convert(run, tmp_path / "out.safetensors")
    written = load_file(tmp_path / "out.safetensors")
    assert_same_state(written, model, ordered=False)


def test_one_nested_legacy_file_given_alone_is_refused_rather_than_cut_to_its_encoder(tmp_path: Path) -> None:
    model = _legacy_model(1, layers=1, gated=False)
    run = _save_legacy_run(tmp_path / "run", model, 1, False)
    file = run / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt"
    code, _, err = run_cli("convert", str(file), str(tmp_path / "out.safetensors"))
    assert code == 1 and not (tmp_path / "out.safetensors").exists()
    assert err.strip().splitlines() == [
        f"ckptconv: error: {str(file)!r} is a Megatron-LM file in the nested legacy layout (model.language_model."
        "embedding, .encoder, .output_layer); convert the run's folder (the iter_N folder, or the one holding "
        "latest_checkpointed_iteration.txt), which reads every tensor of it under its full name"
    ]


def test_a_nested_name_no_partition_rule_covers_is_still_refused(tmp_path: Path) -> None:
    model = _legacy_model(2, layers=1, gated=False)
    model["language_model.encoder.layers.0.self_attention.mystery.weight"] = torch.randn(4, 4)
    run = _save_legacy_run(tmp_path / "run", model, 2, False)
    with pytest.raises(ckptconv.UnsupportedFormatError, match="no partition rule says how the ranks split 1 name"):
        ckptconv.load(run)


def test_a_name_held_both_flat_and_nested_is_refused_as_damaged(tmp_path: Path) -> None:
    run = tmp_path / "run"
    folder = run / "iter_0000001" / "mp_rank_00"
    folder.mkdir(parents=True)
    (run / "latest_checkpointed_iteration.txt").write_text("1")
    t = torch.ones(2)
    tree = {"language_model.output_layer.weight": t, "language_model": {"output_layer": {"weight": t * 2}}}
    torch.save({"checkpoint_version": 3.0, "model": tree}, folder / "model_optim_rng.pt")
    with pytest.raises(ckptconv.MalformedCheckpointError, match=r"names 'language_model\.output_layer\.weight' twice"):
        ckptconv.load(run)


# --- Hub folders holding the model in both formats ----------------------------------------------------------------


def _hub_folder(tmp_path: Path, bin_layout: str, safetensors_layout: str) -> Path:
    """A folder as the Hub serves many repos: the model as safetensors and as pickled .bin. The .bin holds other
    values (another seed), so which one was converted shows."""
    torch.manual_seed(0)
    folder = tmp_path / "hub"
    model = _llama(False)
    shard = "20KB" if safetensors_layout == "sharded" else "1GB"
    model.save_pretrained(folder, max_shard_size=shard)
    torch.manual_seed(1)
    other = {key: value.clone() for key, value in _llama(False).state_dict().items()}
    if bin_layout == "single":
        torch.save(other, folder / "pytorch_model.bin")
    else:
        keys = list(other)
        halves = {"pytorch_model-00001-of-00002.bin": keys[::2], "pytorch_model-00002-of-00002.bin": keys[1::2]}
        for name, part in halves.items():
            torch.save({key: other[key] for key in part}, folder / name)
        weight_map = {key: name for name, part in halves.items() for key in part}
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.mark.parametrize(
    ("bin_layout", "safetensors_layout"),
    [("single", "single"), ("sharded", "single"), ("sharded", "sharded"), ("single", "sharded")],
)
def test_a_hub_folder_in_both_formats_converts_the_safetensors_as_transformers_loads_them(
    bin_layout: str, safetensors_layout: str, tmp_path: Path
) -> None:
    folder = _hub_folder(tmp_path, bin_layout, safetensors_layout)
    out = tmp_path / "out"
    code, _, err = run_cli("convert", str(folder), f"{out}/")
    assert code == 0, err
    bins = sorted(p.name for p in folder.iterdir() if p.name.startswith("pytorch_model"))
    assert f"note: left out weights ckptconv did not convert ({', '.join(bins)}); convert them on their own" in err
    expected = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()  # transformers' own choice
    loaded = _loads_cleanly(out)
    assert loaded.state_dict().keys() == expected.state_dict().keys()
    for key, value in expected.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    info = ckptconv.inspect(folder)
    assert info.format == ("safetensors" if safetensors_layout == "single" else "sharded")


@pytest.mark.parametrize(
    "extra",
    ["other.safetensors", "extra.pt", "model.safetensors.index.json"],
)
def test_a_folder_with_another_checkpoint_beside_them_stays_ambiguous(extra: str, tmp_path: Path) -> None:
    """The negative control: only the Hub's pickled twin of model.safetensors is left out."""
    folder = _hub_folder(tmp_path, "single", "single")
    state = {"x": torch.ones(2)}
    if extra.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(state, folder / extra)
    elif extra.endswith(".pt"):
        torch.save(state, folder / extra)
    else:
        (folder / extra).write_text(json.dumps({"metadata": {}, "weight_map": {"x": "model.safetensors"}}))
    with pytest.raises(ckptconv.LoadError):
        ckptconv.open(folder)
    code, _, err = run_cli("convert", str(folder), str(tmp_path / "out.safetensors"))
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err


# --- torch.ao quantized state dicts -------------------------------------------------------------------------------


def _dynamic_quantized_state(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    float_model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with warnings.catch_warnings():  # torch.ao.quantization is deprecated
        warnings.simplefilter("ignore")
        quantized = torch.ao.quantization.quantize_dynamic(float_model, {torch.nn.Linear}, dtype=torch.qint8)
    path = tmp_path / "ao.pt"
    torch.save(quantized.state_dict(), path)
    return path


def test_a_torch_ao_packed_state_dict_is_refused_naming_the_packed_params(tmp_path: Path) -> None:
    path = _dynamic_quantized_state(tmp_path)
    reloaded = torch.load(path, weights_only=True)  # what torch itself finds in the file
    packed = [key for key, value in reloaded.items() if key.endswith("_packed_params._packed_params")]
    assert packed == ["0._packed_params._packed_params", "2._packed_params._packed_params"]
    assert all(reloaded[key][0].is_quantized and isinstance(reloaded[key], tuple) for key in packed)
    expected = (
        f"{str(path)!r} holds a torch.ao quantized model's state dict: 2 packed Linears "
        "('0._packed_params._packed_params', '2._packed_params._packed_params'), each a (weight, bias) pair torch.ao "
        "packs, not tensors under their own names; load it into its quantized model with torch, save each Linear's "
        "weight().dequantize() and bias() under the float model's names, and convert that"
    )
    with pytest.raises(ckptconv.SelectionError) as raised:
        ckptconv.convert(path, tmp_path / "out.safetensors")
    assert str(raised.value) == expected
    code, _, err = run_cli("convert", str(path), str(tmp_path / "out.safetensors"))
    assert code == 1 and err.strip().splitlines() == [f"ckptconv: error: {expected}"]
    assert not (tmp_path / "out.safetensors").exists()
    assert ckptconv.inspect(path).selection_error == expected  # inspect still lists the entries


def test_torch_ao_quantized_tensors_under_their_own_names_still_convert_as_dequantize_gives_them(
    tmp_path: Path,
) -> None:
    """The negative control: quantized tensors that are not packed convert, each as its dequantize()."""
    torch.manual_seed(0)
    with warnings.catch_warnings():  # quantized tensors are deprecated
        warnings.simplefilter("ignore")
        state = {
            "conv.weight": torch.quantize_per_tensor(torch.randn(4, 3), 0.05, 3, torch.qint8),
            "conv.bias": torch.randn(4),
        }
    torch.save(state, tmp_path / "q.pt")
    ckptconv.convert(tmp_path / "q.pt", tmp_path / "q.safetensors")
    written = load_file(tmp_path / "q.safetensors")
    assert_same_tensor(written["conv.weight"], state["conv.weight"].dequantize())
    assert_same_tensor(written["conv.bias"], state["conv.bias"])


_LEGACY_NAMES = (  # Megatron-Core's name -> the legacy layout's (legacy/model/transformer.py, language_model.py)
    ("embedding.word_embeddings.weight", "language_model.embedding.word_embeddings.weight"),
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("self_attention.linear_qkv.weight", "self_attention.query_key_value.weight"),
    ("self_attention.linear_proj.weight", "self_attention.dense.weight"),
    ("mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight"),
    ("mlp.linear_fc1.weight", "mlp.dense_h_to_4h.weight"),
    ("mlp.linear_fc2.weight", "mlp.dense_4h_to_h.weight"),
    ("decoder.final_layernorm.weight", "language_model.encoder.final_layernorm.weight"),
    ("output_layer.weight", "language_model.output_layer.weight"),
)


def _as_legacy(name: str) -> str:
    for core, legacy in _LEGACY_NAMES:
        if name == core:
            return legacy
        if name.startswith("decoder.layers.") and name.endswith(core):
            layer = name.split(".")[2]
            return f"language_model.encoder.layers.{layer}.{legacy}"
    raise AssertionError(name)


def test_a_nested_legacy_llama_converts_like_a_base_folder_to_megatrons_logits(tmp_path: Path) -> None:
    """The Megatron-Core fixture (with Megatron's own logits) saved as the legacy layout saves the same model
    (checkpoint_version 3: the same fused QKV rows), tensor-parallel 2 with SwiGLU: ``convert run/ out/ --like
    base/`` loads with from_pretrained, nothing missing or unexpected, and gives Megatron's logits."""
    runs = Path(__file__).resolve().parent.parent / "fixtures" / "runs" / "megatron_llama"
    config = json.loads((runs / "config.json").read_text())
    golden = torch.load(runs / "golden_logits.pt", map_location="cpu", weights_only=True)
    core = ckptconv.load(runs)
    model = {_as_legacy(name): tensor for name, tensor in core.items()}
    run = _save_legacy_run(tmp_path / "run", model, 2, gated=True)
    fields = {k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"}
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**fields)).save_pretrained(
        tmp_path / "base"
    )
    code, _, err = run_cli("convert", str(run), f"{tmp_path / 'out'}/", "--like", str(tmp_path / "base"))
    assert code == 0, err
    loaded = _loads_cleanly(tmp_path / "out")
    with torch.no_grad():
        logits = loaded(golden["input_ids"]).logits
    assert float((logits - golden["logits"][..., : config["vocab_size"]]).abs().max()) < 1e-5


def test_a_legacy_run_before_checkpoint_version_2_is_refused(tmp_path: Path) -> None:
    """Megatron-LM reordered the fused QKV rows at checkpoint_version 2.0; older files are refused, not misread."""
    model = _legacy_model(3, layers=1, gated=False)
    run = _save_legacy_run(tmp_path / "run", model, 2, False)
    for file in run.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(file, weights_only=False)
        state["checkpoint_version"] = 1.0
        torch.save(state, file)
    with pytest.raises(ckptconv.UnsupportedFormatError, match=r"checkpoint_version 1\.0 file, whose fused"):
        ckptconv.load(run)
