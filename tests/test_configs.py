"""Hostile configs, parsed once through one schema (issue 39, item 3): every public function that reads a
config refuses a bad one with an :class:`InvalidConfigError` in one line naming the file and the field, the CLI
exits 1 with that one line and no traceback, and ``inspect`` describes the weights and names the config as
invalid. Functions that never read a config (``open``, ``load``, ``fit``, ``load_into``) give the weights as
the safetensors library reads them, whatever the config says.

Three families: a Hugging Face model folder's ``config.json`` (the folder converted, or given as ``--like``),
a Megatron-Core run's (its ``config.json``, and Megatron's own ``metadata.json``), and a ``--like`` base folder
whose config sizes the Megatron mapping (there every size is bounded by the tensors before any is used).
"""

from __future__ import annotations

import json
import shutil
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

import ckptconv
from ckptconv.architectures import to_hugging_face
from ckptconv.errors import CkptconvError, InvalidConfigError
from ckptconv.reading.model_config import MAX_DEPTH, parse_model_config

from .conftest import FIXTURES, assert_same_state, run_cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MEGATRON = FIXTURES / "runs" / "megatron_llama"
CONFIG = json.loads((MEGATRON / "config.json").read_text())


def _replace_vocab(text: str) -> Callable[[str], str]:
    return lambda config: config.replace('"vocab_size": 100', f'"vocab_size": {text}')


# (id, how the config text is changed, what the one-line error says): refused wherever a config is read.
BROKEN_FILES: list[tuple[str, Callable[[str], str | bytes], str]] = [
    ("nan", _replace_vocab("NaN"), "is not a model config: it is not JSON (NaN is not a JSON number)"),
    ("infinity", _replace_vocab("-Infinity"), "is not a model config: it is not JSON (-Infinity is not a JSON number)"),
    ("duplicate-key", _replace_vocab('100, "vocab_size": 7'), "it is not JSON (duplicate key 'vocab_size')"),
    (
        "nested",
        lambda c: c.rstrip()[:-1] + ', "x": ' + "[" * 200 + "]" * 200 + "}",
        f"it nests deeper than {MAX_DEPTH} levels",
    ),
    ("nested-past-the-stack", lambda c: '{"x": ' + "[" * 100000 + "]" * 100000 + "}", "nests deeper than"),
    ("not-an-object", lambda c: "[1, 2]", "it holds [1, 2], not a JSON object"),
    ("not-utf8", lambda c: c.encode() + b"\xff", "it is not UTF-8"),
    (
        "huge",
        lambda c: c.rstrip()[:-1] + ', "x": "' + "a" * (17 << 20) + '"}',
        "is not a model config: it is larger than 16,777,216 bytes",
    ),
]
# (id, fields changed, message): a field ckptconv reads of the wrong type or out of range.
BROKEN_FIELDS: list[tuple[str, dict[str, Any], str]] = [
    ("layers-word", {"num_hidden_layers": "eight"}, 'num_hidden_layers is "eight", not an integer'),
    ("layers-float", {"num_hidden_layers": 1e9}, "num_hidden_layers is 1000000000.0, a float"),
    ("layers-bool", {"num_hidden_layers": True}, "num_hidden_layers is true, not an integer"),
    ("heads-zero", {"num_attention_heads": 0}, "num_attention_heads is 0; it must be at least 1"),
    ("hidden-negative", {"hidden_size": -64}, "hidden_size is -64; it must be at least 1"),
    ("experts-list", {"num_local_experts": [4]}, "num_local_experts is [4], not an integer"),
    ("tie-word", {"tie_word_embeddings": "yes"}, 'tie_word_embeddings is "yes", not true or false'),
    ("model-type-number", {"model_type": 7}, "model_type is 7, not a string"),
    ("architectures-word", {"architectures": "LlamaForCausalLM"}, 'architectures is "LlamaForCausalLM", not a list'),
]
# (id, fields changed, message): refused where the config sizes the Megatron mapping (a --like base), before
# anything is sized by it.
UNBOUNDED: list[tuple[str, dict[str, Any], str]] = [
    ("intermediate-missing", {"intermediate_size": None}, "intermediate_size is missing"),
    ("heads-missing", {"num_attention_heads": None}, "num_attention_heads is missing"),
    ("intermediate-per-layer", {"intermediate_size": [96, 96]}, "intermediate_size is a list (one per layer)"),
    ("layers-billion", {"num_hidden_layers": 10**9}, "num_hidden_layers is 1000000000, more than the 1472 rows"),
    ("vocab-trillion", {"vocab_size": 10**12}, "vocab_size is 1000000000000, larger than any dimension of the"),
    (
        "experts-many",
        {"model_type": "mixtral", "num_local_experts": 1000},
        "num_local_experts is 1000: 2 layers of 1000 experts are more than the 1472 rows",
    ),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama model folder as transformers saves it (config.json beside model.safetensors), of the Megatron
    fixture's config."""
    folder = tmp_path_factory.mktemp("configs") / "base"
    fields = {k: v for k, v in CONFIG.items() if not k.startswith("_") and k != "transformers_version"}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**fields))
    model.save_pretrained(folder)
    return folder


def _copy(source: Path, destination: Path, change: Callable[[str], str | bytes] | dict[str, Any]) -> Path:
    shutil.copytree(source, destination)
    path = destination / "config.json"
    if callable(change):
        text = change(path.read_text())
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    else:
        config = json.loads(path.read_text())
        config.update(change)
        path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return destination


def _one_line(error: BaseException, config: Path, fragment: str) -> None:
    assert isinstance(error, InvalidConfigError), repr(error)
    text = str(error)
    assert "\n" not in text
    assert text.startswith(f"{str(config / 'config.json')!r} is not "), text
    assert fragment in text, text


def _cli_refuses(config: Path, fragment: str, *args: str) -> None:
    code, _, err = run_cli(*args)
    assert code == 1, (code, err)
    assert "Traceback" not in err
    [line] = err.strip().splitlines()
    assert line.startswith(f"ckptconv: error: {str(config / 'config.json')!r} is not "), line
    assert fragment in line, line


HOSTILE = [pytest.param(change, message, id=name) for name, change, message in BROKEN_FILES + BROKEN_FIELDS]


@pytest.mark.parametrize(("change", "message"), HOSTILE)
def test_a_model_folder_with_a_hostile_config_is_refused_in_one_line(
    change: Any, message: str, base: Path, tmp_path: Path
) -> None:
    folder = _copy(base, tmp_path / "model", change)
    with pytest.raises(CkptconvError) as raised:
        ckptconv.convert(folder, tmp_path / "out" / "")
    _one_line(raised.value, folder, message)
    assert not (tmp_path / "out").exists()
    _cli_refuses(folder, message, "convert", str(folder), str(tmp_path / "cli") + "/")
    assert not (tmp_path / "cli").exists()
    # the same folder as --like: the same refusal
    with pytest.raises(CkptconvError) as raised:
        ckptconv.convert(base, tmp_path / "like" / "", fit_to=folder)
    _one_line(raised.value, folder, message)
    _cli_refuses(folder, message, "convert", str(base), str(tmp_path / "like") + "/", "--like", str(folder))
    _cli_refuses(folder, message, "fit", str(base), str(tmp_path / "fit") + "/", "--like", str(folder))
    assert not (tmp_path / "like").exists() and not (tmp_path / "fit").exists()


@pytest.mark.parametrize(("change", "message"), HOSTILE)
def test_inspect_describes_the_weights_and_names_the_config_invalid(
    change: Any, message: str, base: Path, tmp_path: Path
) -> None:
    folder = _copy(base, tmp_path / "model", change)
    info = ckptconv.inspect(folder)
    assert info.tensors and len(info.tensors) == len(load_file(base / "model.safetensors"))
    assert info.quantization.startswith(f"unknown, the config is invalid: {str(folder / 'config.json')!r} is not ")
    assert message in info.quantization
    code, out, err = run_cli("inspect", str(folder))
    assert code == 0 and "Traceback" not in err, err
    assert f"quantized: {info.quantization}" in out
    code, out, err = run_cli("inspect", str(folder), "--json")
    assert code == 0 and json.loads(out)["quantization"] == info.quantization


def test_functions_that_never_read_the_config_give_the_weights_whatever_it_says(base: Path, tmp_path: Path) -> None:
    folder = _copy(base, tmp_path / "model", {"num_hidden_layers": "eight", "num_attention_heads": 0})
    truth = load_file(base / "model.safetensors")
    assert_same_state(ckptconv.load(folder), truth, ordered=False)
    assert_same_state({k: v.torch() for k, v in ckptconv.open(folder).select().weights.items()}, truth, ordered=False)
    fitted, report = ckptconv.fit(truth, folder)
    assert report.ok and set(fitted) == set(truth)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(base))
    assert ckptconv.load_into(model, folder).ok
    assert_same_state(model.state_dict(), truth, ordered=False)


def test_batch_reports_a_hostile_model_folder_and_converts_the_others(base: Path, tmp_path: Path) -> None:
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    _copy(base, zoo / "bad", {"num_hidden_layers": "eight"})
    shutil.copytree(base, zoo / "good")
    code, _, err = run_cli("batch", str(zoo), str(tmp_path / "out"))
    assert "Traceback" not in err
    lines = (tmp_path / "out" / "ckptconv-manifest.jsonl").read_text().splitlines()
    items = [record for record in map(json.loads, lines) if record["record"] == "item"]
    good = [r for r in items if r["source"] == "good" or r["source"].startswith("good/")]
    bad = [r for r in items if r["source"] == "bad" or r["source"].startswith("bad/")]
    assert good and bad and all(r["status"] == "converted" for r in good), items
    # The model folder is one item, refused in one line (its weights are never converted past their config).
    assert [record["status"] for record in bad] == ["failed"], bad
    assert "\n" not in bad[0]["error"] and "num_hidden_layers" in bad[0]["error"], bad
    assert bad[0]["error_type"] == "InvalidConfigError", bad
    assert code in (0, 3)


# --- Megatron ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "message"), HOSTILE)
def test_a_megatron_run_with_a_hostile_config_is_refused_in_one_line(change: Any, message: str, tmp_path: Path) -> None:
    run = _copy(MEGATRON, tmp_path / "run", change)
    with pytest.raises(CkptconvError) as raised:
        ckptconv.convert(run, tmp_path / "out.safetensors")
    _one_line(raised.value, run, message)
    _cli_refuses(run, message, "convert", str(run), str(tmp_path / "cli.safetensors"))
    assert not list(tmp_path.glob("*.safetensors"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"sharded_backend": "torch_dist", "sharded_backend": "zarr"}', "duplicate key 'sharded_backend'"),
        ("[" * 30000 + "]" * 30000, f"nests deeper than {MAX_DEPTH} levels"),
        ('{"sharded_backend": NaN}', "NaN is not a JSON number"),
        ("[]", "it holds [], not a JSON object"),
    ],
    ids=["duplicate-key", "nested-past-the-stack", "nan", "not-an-object"],
)
def test_megatrons_own_metadata_json_is_parsed_by_the_same_rules(text: str, message: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(MEGATRON, run)
    (run / "metadata.json").write_text(text)
    expected = f"{str(run / 'metadata.json')!r} is not Megatron's checkpoint metadata: "
    for call in (ckptconv.open, ckptconv.inspect, lambda path: ckptconv.convert(path, tmp_path / "o.safetensors")):
        with pytest.raises(InvalidConfigError) as raised:
            call(run)
        assert str(raised.value).startswith(expected) and message in str(raised.value)
        assert "\n" not in str(raised.value)
    code, _, err = run_cli("inspect", str(run))
    assert code == 1 and err.strip().splitlines() == [f"ckptconv: error: {raised.value}"]


# --- --like bases: the config sizes the Megatron mapping ---------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [pytest.param(change, message, id=name) for name, change, message in BROKEN_FIELDS + UNBOUNDED],
)
def test_a_like_base_with_a_hostile_config_is_refused_before_the_mapping_is_sized(
    change: dict[str, Any], message: str, base: Path, tmp_path: Path
) -> None:
    like = _copy(base, tmp_path / "like", change)
    with pytest.raises(CkptconvError) as raised:
        ckptconv.convert(MEGATRON, tmp_path / "out" / "", fit_to=like)
    _one_line(raised.value, like, message)
    _cli_refuses(like, message, "convert", str(MEGATRON), str(tmp_path / "cli") + "/", "--like", str(like))
    assert not (tmp_path / "out").exists() and not (tmp_path / "cli").exists()


@pytest.mark.parametrize(("change", "message"), [pytest.param(c, m, id=n) for n, c, m in BROKEN_FIELDS + UNBOUNDED])
def test_to_hugging_face_refuses_a_hostile_config_dict_with_bounded_memory(
    change: dict[str, Any], message: str
) -> None:
    weights = ckptconv.open(MEGATRON).select().weights
    config = {k: v for k, v in {**CONFIG, **change}.items() if v is not None}
    tracemalloc.start()
    try:
        with pytest.raises(InvalidConfigError, match="is not a valid model config") as raised:
            to_hugging_face(weights, config)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert message in str(raised.value)
    assert peak < 16 << 20  # a billion layers were never listed (3.9 GB before)


def test_the_schema_keeps_what_real_configs_hold() -> None:
    """The negative control: transformers' own configs, nulls and all, pass and read back their values."""
    for config in (
        transformers.LlamaConfig(head_dim=None).to_dict(),
        transformers.MixtralConfig().to_dict(),
        transformers.Qwen3MoeConfig().to_dict(),
        transformers.GPT2Config().to_dict(),
        transformers.BertConfig().to_dict(),
        transformers.Gemma3nTextConfig().to_dict(),  # intermediate_size per layer
        CONFIG,
    ):
        parsed = parse_model_config(json.loads(json.dumps(config)))
        assert parsed.num_hidden_layers == config.get("num_hidden_layers")
        assert parsed.tie_word_embeddings == config.get("tie_word_embeddings")
        assert dict(parsed) == json.loads(json.dumps(config))


@pytest.mark.parametrize(
    "change",
    [{"num_hidden_layers": 10**9}, {"text_config": {"model_type": "llama", "num_hidden_layers": 10**9}}],
    ids=["top", "nested"],
)
def test_a_count_the_tensors_cannot_hold_is_refused_before_the_model_is_built(
    change: dict[str, Any], base: Path, tmp_path: Path
) -> None:
    """The coverage check builds the config's model on the meta device: a billion layers (an integer of the right
    type, at the top or in a sub-config) would take hours; it is refused first, in one line."""
    source = _copy(base, tmp_path / "src", change)
    with pytest.raises(InvalidConfigError) as raised:
        ckptconv.convert(str(source), str(tmp_path / "out") + "/")
    assert "num_hidden_layers is 1000000000, more than the" in str(raised.value) and "\n" not in str(raised.value)
    assert not (tmp_path / "out").exists()
