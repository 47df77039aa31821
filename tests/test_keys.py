"""Keys that fit: canonical names, fitting to a reference, LitEma, metadata, verify and diff."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import sys
from collections import Counter, OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import ckptconv
from ckptconv.fitting import Reference
from ckptconv.reading.sources import InMemory
from ckptconv.transforms.keys import canonical_keys
from ckptconv.values.tensor import Storage, TensorRef

from .conftest import (
    FIXTURES,
    assert_same_state,
    assert_same_tensor,
    reference_load,
    training_checkpoint,
)
from .conftest import run_cli as run

GPU = FIXTURES / "gpu"


@pytest.fixture
def fixture_models(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.syspath_prepend(str(FIXTURES))
    import ckptconv_fixture_models

    yield ckptconv_fixture_models
    sys.modules.pop("ckptconv_fixture_models", None)


def refs(keys: list[str]) -> dict[str, TensorRef]:
    from ckptconv.dtypes import dtype_by_name

    float32 = dtype_by_name("float32")
    assert float32 is not None
    return {key: TensorRef(Storage(4, InMemory(bytes(4))), float32, (1,), (1,)) for key in keys}


# -- canonical names ------------------------------------------------------------------


@pytest.mark.parametrize(
    "keys, expected",
    [
        (["module.conv.weight", "module.fc.bias"], ["conv.weight", "fc.bias"]),
        (["_orig_mod.module.a", "_orig_mod.module.b"], ["a", "b"]),
        (["module._orig_mod.a", "module._orig_mod.b"], ["a", "b"]),
        (["_forward_module.model.x", "_forward_module.model.y"], ["model.x", "model.y"]),
        (["a._fsdp_wrapped_module.b._checkpoint_wrapped_module.c.w"], ["a.b.c.w"]),
        (["_fpw_module.layer.w"], ["layer.w"]),
        (["module.a", "b"], ["module.a", "b"]),  # not every key: a real submodule called `module`
        (["encoder.module.x", "encoder.y"], ["encoder.module.x", "encoder.y"]),
        (["modules.0.w", "module_list.1.b"], ["modules.0.w", "module_list.1.b"]),
        (["module"], ["module"]),
    ],
)
def test_canonical_names(keys: list[str], expected: list[str]) -> None:
    assert list(canonical_keys(keys)[0].values()) == expected


names = st.sampled_from(
    ["conv", "bn", "fc", "layers", "0", "1", "weight", "bias", "module_list", "modules", "norm", "attn", "embed", "mlp"]
)
plain_keys = st.lists(names, min_size=2, max_size=5).map(".".join).filter(lambda k: not k.startswith("module."))
wrappers = st.lists(st.sampled_from(["module", "_orig_mod", "_forward_module"]), max_size=4)


@settings(max_examples=300, deadline=None)
@given(st.lists(plain_keys, min_size=1, max_size=15, unique=True), wrappers)
def test_canonicalize_undoes_any_stack_of_wrappers_and_is_idempotent(keys: list[str], stack: list[str]) -> None:
    wrapped = [".".join([*stack, key]) for key in keys]
    state, _ = ckptconv.canonicalize(refs(wrapped))
    assert list(state) == keys
    again, report = ckptconv.canonicalize(state)
    assert list(again) == keys and report.changed == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(plain_keys, min_size=1, max_size=15, unique=True), wrappers, st.sampled_from(["", "model", "backbone"]))
def test_fit_recovers_the_reference_keys_from_any_wrapping(keys: list[str], stack: list[str], extra: str) -> None:
    prefix = [p for p in [*stack, extra] if p]
    wrapped = refs([".".join([*prefix, key]) for key in keys])
    fitted, report = ckptconv.fit(wrapped, keys)
    assert report.ok, report.summary()
    assert list(fitted) == keys
    # and back: a plain checkpoint fits a wrapped reference
    dp_keys = ["module." + key for key in keys]
    fitted, report = ckptconv.fit(refs(keys), dp_keys)
    assert report.ok and list(fitted) == dp_keys


def test_fit_refuses_to_half_fit() -> None:
    state = refs(["module.a", "module.b", "module.extra"])
    fitted, report = ckptconv.fit(state, ["a", "b", "c"])
    assert not report.ok
    assert report.missing == ("c",) and report.unexpected == ("extra",)
    assert list(fitted) == list(state)  # nothing applied


def test_fit_checks_shapes() -> None:
    reference = Reference(("a",), {"a": (2,)})
    _, report = ckptconv.fit(refs(["a"]), reference)
    assert not report.ok and report.shape_mismatches == (("a", (1,), (2,)),)


# -- real GPU-made fixtures load into plain models with strict=True ---------------------

PLAIN_CNN_SOURCES = [
    "dataparallel_state_dict.pkl",
    "ddp_rank0.pt",
    "compiled_state_dict.pt",
    "compiled_over_dataparallel.pt",
    "dataparallel_over_compiled.pt",
    "lightning.ckpt",
    "dataparallel_whole_model.pkl",
    "train_checkpoint.pth",
    "timm_style_ema.pth.tar",
    "cuda1_state_dict.pt",
    "legacy_format_cuda.pt",
]


@pytest.mark.parametrize("name", PLAIN_CNN_SOURCES)
def test_gpu_checkpoints_load_into_a_plain_model(name: str, fixture_models: Any) -> None:
    model = fixture_models.TinyCNN()
    report = ckptconv.load_into(model, GPU / name)
    assert report.ok
    expected = ckptconv.canonicalize(ckptconv.open(GPU / name).select().weights)[0]
    expected = {k[len("model.") :] if k.startswith("model.") else k: v for k, v in expected.items()}
    from ckptconv.gpu.torch_tensors import to_torch

    assert_same_state(model.state_dict(), to_torch(expected))


@pytest.mark.parametrize("name, vocab", [("fsdp1_full_state_dict.pt", 64), ("fsdp2_full_state_dict.pt", 65)])
def test_fsdp_full_state_dicts_load_into_a_plain_model(name: str, vocab: int, fixture_models: Any) -> None:
    model = fixture_models.TinyLM(vocab_size=vocab, tie_weights=False)
    assert ckptconv.load_into(model, GPU / name).ok
    assert_same_state(model.state_dict(), reference_load(GPU / name), ordered=False)


@pytest.mark.parametrize("name", ["fsdp1_ac_named_parameters.pt", "activation_checkpoint_named_parameters.pt"])
def test_fsdp_and_checkpointing_wrapper_names_fit(name: str, fixture_models: Any) -> None:
    model = fixture_models.TinyLM(tie_weights=False)
    with pytest.raises(ckptconv.FitError) as raised:
        ckptconv.load_into(model, GPU / name)  # parameters only: the position_ids buffer is missing
    assert raised.value.report.missing == ("position_ids",)
    report = ckptconv.load_into(model, GPU / name, strict=False)
    assert report.matched == 17 and not report.unexpected
    # Every parameter now holds the file's bytes under its canonical name.
    saved = dict(ckptconv.canonicalize(ckptconv.open(GPU / name).select().weights)[0].items())
    from ckptconv.gpu.torch_tensors import to_torch

    loaded = model.state_dict()
    for key, tensor in to_torch(saved).items():
        assert_same_tensor(loaded[key], tensor, key)


def test_plain_checkpoint_loads_into_dataparallel_and_compiled(fixture_models: Any) -> None:
    for wrap in (torch.nn.DataParallel, torch.compile, lambda m: torch.compile(torch.nn.DataParallel(m))):
        model = wrap(fixture_models.TinyCNN())
        report = ckptconv.load_into(model, GPU / "cuda0_state_dict.pt")
        assert report.ok, report.summary()
        inner = getattr(model, "_orig_mod", model)
        inner = getattr(inner, "module", inner)
        # On a CUDA machine DataParallel moves the module to cuda:0: compare its values on the CPU.
        loaded = {key: value.cpu() for key, value in inner.state_dict().items()}
        assert_same_state(loaded, reference_load(GPU / "cuda0_state_dict.pt"))


# -- LitEma ---------------------------------------------------------------------------


def test_lit_ema_weights_map_back_to_the_model(tmp_path: Path) -> None:
    weights = {
        "model.diffusion_model.out.0.weight": torch.ones(2, 2),
        "model.diffusion_model.out.0.bias": torch.ones(2),
        "model.diffusion_model.counter": torch.tensor(3),  # a buffer: no EMA copy
        "first_stage_model.decoder.w": torch.full((2,), 5.0),
        "model_ema.decay": torch.tensor(0.9999),
        "model_ema.num_updates": torch.tensor(100, dtype=torch.int32),
        "model_ema.diffusion_modelout0weight": torch.full((2, 2), 7.0),
        "model_ema.diffusion_modelout0bias": torch.full((2,), 8.0),
    }
    path = tmp_path / "sd.ckpt"
    torch.save({"state_dict": weights, "global_step": 10}, path)
    assert "--select ema" in ckptconv.open(path).select().note
    selection = ckptconv.open(path).select("ema")
    assert selection.is_ema
    from ckptconv.gpu.torch_tensors import to_torch

    loaded = to_torch(selection.weights)
    assert list(loaded) == [
        "model.diffusion_model.out.0.weight",
        "model.diffusion_model.out.0.bias",
        "model.diffusion_model.counter",
        "first_stage_model.decoder.w",
    ]
    assert_same_tensor(loaded["model.diffusion_model.out.0.weight"], torch.full((2, 2), 7.0))
    assert_same_tensor(loaded["model.diffusion_model.counter"], torch.tensor(3))


# -- metadata and provenance ------------------------------------------------------------


def test_safetensors_output_keeps_metadata_and_provenance(tmp_path: Path) -> None:
    source = GPU / "train_checkpoint.pth"
    output = tmp_path / "out.safetensors"
    ckptconv.convert(source, output, transforms=[ckptconv.Canonicalize()])
    with safe_open(output, framework="pt") as handle:
        metadata = handle.metadata()
    assert json.loads(metadata["checkpoint.epoch"]) == 3
    assert json.loads(metadata["checkpoint.global_step"]) == 120
    assert json.loads(metadata["checkpoint.args"])["arch"] == "tinycnn"
    assert json.loads(metadata["checkpoint.np_scalar"]) == 0.5
    assert "checkpoint.optimizer" not in metadata and "checkpoint.numpy_rng" not in metadata
    assert metadata["ckptconv.source"] == "train_checkpoint.pth"
    assert metadata["ckptconv.source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert metadata["ckptconv.selected"] == "model"
    assert json.loads(metadata["ckptconv.transforms"]) == ["remove wrapper prefixes (canonical names)"]
    assert metadata["ckptconv.version"] == ckptconv.__version__


def test_pt_output_records_provenance_and_keeps_meta_when_asked(tmp_path: Path) -> None:
    source = tmp_path / "train.pth"
    checkpoint = training_checkpoint()
    torch.save(checkpoint, source)
    plain = tmp_path / "plain.pt"
    ckptconv.convert(source, plain)
    assert list(torch.load(plain, weights_only=True)) == list(checkpoint["state_dict"])
    assert ckptconv.open(plain).metadata["ckptconv.source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()

    kept = tmp_path / "kept.pt"
    ckptconv.convert(source, kept, keep_meta=True)
    loaded = torch.load(kept, weights_only=True)
    assert loaded["epoch"] == 3
    assert loaded["args"] == {"lr": 1e-3, "arch": "tiny", "layers": [1, 2]}
    assert_same_state(loaded["state_dict"], checkpoint["state_dict"])
    assert ckptconv.open(kept).select().where == "state_dict"


# Plain data torch.load(weights_only=True) reads back as it was saved; JSON has no tuple, set,
# integer key or NaN, so .pt outputs must not go through it.
PLAIN_DATA = {
    "idx_to_class": {0: "cat", 1: "dog"},
    "best_loss": float("nan"),
    "worst": float("-inf"),
    "input_shape": (3, 224, 224),
    "pair_weights": {(0, 1): 0.5, (1, 2): 0.25},
    "label_ids": {3, 1, 2},
    "optional": {None: 1, True: 2, 2.5: 3},
    "epoch": 3,
}


def _load_plain(path: Path, values: Any) -> Any:
    """torch.load(weights_only=True); with weights_only=False (on files these tests made) where this
    torch's weights_only unpickler cannot read ``values``: torch 2.4's reads no set, bytes, bytearray or
    complex (it has no ``builtins.set``, ``_codecs.encode`` ... in its allowed globals)."""
    buffer = io.BytesIO()
    torch.save(values, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError:
        return torch.load(path, weights_only=False)
    return torch.load(path, weights_only=True)


def test_keep_meta_keeps_plain_data_exactly_as_torch_reads_it(tmp_path: Path) -> None:
    """`--keep-meta` wrote {0: 'cat'} as {'0': 'cat'}, NaN as the string 'nan', tuples and sets as
    lists, and dropped tuple and None keys without a word."""
    source = tmp_path / "train.pth"
    torch.save({"state_dict": {"w": torch.ones(2)}, **PLAIN_DATA}, source)
    expected = _load_plain(source, PLAIN_DATA)
    kept = tmp_path / "kept.pt"
    ckptconv.convert(source, kept, keep_meta=True)
    loaded = _load_plain(kept, PLAIN_DATA)
    assert sorted(loaded) == sorted(expected)
    for key in PLAIN_DATA:
        assert repr(loaded[key]) == repr(expected[key]), key  # repr tells tuple from list, 0 from '0'


def test_safetensors_metadata_leaves_out_what_json_cannot_key(tmp_path: Path) -> None:
    """JSON keys are strings: integer keys become their text, but a dict whose keys JSON cannot hold
    (tuples, None) or whose keys collide as text ({1: ..., '1': ...}) is left out whole, never cut."""
    source = tmp_path / "train.pth"
    torch.save({"state_dict": {"w": torch.ones(2)}, **PLAIN_DATA, "clash": {1: "a", "1": "b"}}, source)
    output = tmp_path / "out.safetensors"
    ckptconv.convert(source, output)
    with safe_open(output, framework="pt") as handle:
        metadata = handle.metadata()
    assert json.loads(metadata["checkpoint.idx_to_class"]) == {"0": "cat", "1": "dog"}
    assert json.loads(metadata["checkpoint.input_shape"]) == [3, 224, 224]
    assert json.loads(metadata["checkpoint.epoch"]) == 3
    for left_out in ("pair_weights", "optional", "clash"):
        assert f"checkpoint.{left_out}" not in metadata


def test_source_hash_can_be_skipped(tmp_path: Path) -> None:
    output = tmp_path / "out.safetensors"
    ckptconv.convert(GPU / "cuda0_state_dict.pt", output, source_hash=False)
    with safe_open(output, framework="pt") as handle:
        assert "ckptconv.source_sha256" not in handle.metadata()


# -- the commands -------------------------------------------------------------------------


def test_canonical_option_reports_what_it_removed(tmp_path: Path) -> None:
    code, _, stderr = run("convert", str(GPU / "dataparallel_over_compiled.pt"), str(tmp_path / "o.pt"), "--canonical")
    assert code == 0
    assert "note: removed wrappers: '_orig_mod.' from 9 keys, 'module.' from 9 keys" in stderr


def test_canonical_dry_run(tmp_path: Path) -> None:
    code, stdout, _ = run(
        "convert", str(GPU / "compiled_over_dataparallel.pt"), str(tmp_path / "o.pt"), "--canonical", "--dry-run"
    )
    assert code == 0 and list(tmp_path.iterdir()) == []
    assert stdout.splitlines()[0] == "_orig_mod.module.conv.weight -> conv.weight"


def test_fit_command_with_each_kind_of_reference(tmp_path: Path, fixture_models: Any) -> None:
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("# TinyCNN\n" + "\n".join(fixture_models.TinyCNN().state_dict()) + "\n")
    for reference in (str(GPU / "cuda0_state_dict.pt"), str(keys_file), "ckptconv_fixture_models:TinyCNN"):
        output = tmp_path / "fitted.pt"
        code, _, stderr = run("fit", str(GPU / "lightning.ckpt"), str(output), "--like", reference, "--overwrite")
        assert code == 0, stderr
        assert "strip prefix 'model.'" in stderr
        assert list(torch.load(output, weights_only=True)) == list(fixture_models.TinyCNN().state_dict())


def test_fit_command_exits_3_with_a_report_and_writes_nothing(tmp_path: Path) -> None:
    output = tmp_path / "fitted.pt"
    code, _, stderr = run("fit", str(GPU / "fp16_cuda.pt"), str(output), "--like", str(GPU / "cuda0_state_dict.pt"))
    assert code == 3
    assert stderr.startswith("ckptconv: error: no key transform makes the checkpoint fit")
    assert "  missing: conv.weight" in stderr and "  unexpected: tok_emb.weight" in stderr
    assert not output.exists()


def test_verify_command(tmp_path: Path) -> None:
    source = GPU / "ddp_rank0.pt"
    output = tmp_path / "out.safetensors"
    assert run("strip-module", str(source), str(output), "--dtype", "bf16", "-q")[0] == 0
    code, stdout, _ = run("verify", str(source), str(output), "--strip-prefix", "module", "--dtype", "bf16")
    assert (code, stdout) == (0, "verified: all 9 tensors match bit for bit\n")
    code, stdout, _ = run("verify", str(source), str(output), "--strip-prefix", "module")
    assert code == 3 and "differs: conv.weight: dtype bfloat16, expected float32" in stdout


def test_diff_command(tmp_path: Path) -> None:
    code, stdout, _ = run("diff", str(GPU / "ddp_rank0.pt"), str(GPU / "ddp_rank1.pt"), "--json")
    assert code == 3
    report = json.loads(stdout)
    assert {d["key"] for d in report["differences"]} == {"module.bn.running_mean", "module.bn.running_var"}
    assert all(d["reason"] == "values" and d["max_abs_diff"] > 0 for d in report["differences"])
    assert report["same"] == 7
    copy = tmp_path / "copy.safetensors"
    ckptconv.convert(GPU / "ddp_rank0.pt", copy)
    code, stdout, _ = run("diff", str(GPU / "ddp_rank0.pt"), str(copy))
    assert code == 0 and stdout.startswith("identical: 9 tensors identical")
    code, stdout, _ = run("diff", str(GPU / "cuda0_state_dict.pt"), str(GPU / "bf16_cuda.pt"))
    assert code == 3 and "dtype differs: conv.weight: float32 vs bfloat16" in stdout


def test_keep_meta_keeps_every_type_torch_reads_back_and_names_what_it_leaves_out(tmp_path: Path) -> None:
    """`--keep-meta` wrote OrderedDict and Counter as plain dicts and left out bytes and complex values
    without a word; a frozenset (torch.load(weights_only=True) cannot read one) became a list."""
    extra = {
        "vocab": OrderedDict([("b", 1), ("a", 2)]),
        "counts": Counter("abca"),
        "magic": b"\x00\xffck",
        "buffer": bytearray(b"xy"),
        "phase": complex(float("nan"), -0.0),
        "nested": {"k": [b"z", 1j]},
    }
    source = tmp_path / "train.pth"
    torch.save({"state_dict": {"w": torch.ones(2)}, **extra, "frozen": frozenset({1})}, source)
    kept = tmp_path / "kept.pt"
    report = ckptconv.convert(source, kept, keep_meta=True)
    loaded = _load_plain(kept, extra)
    assert sorted(loaded) == sorted(["state_dict", *extra])
    for key, value in extra.items():
        assert repr(loaded[key]) == repr(value), key  # repr tells OrderedDict from dict, bytes from str
    assert (
        "--keep-meta left out 'frozen' (a frozenset, which torch.load(weights_only=True) cannot read)" in report.notes
    )


def test_keep_meta_says_when_it_leaves_out_a_torch_dtype(tmp_path: Path) -> None:
    """A run's `amp_dtype: torch.bfloat16` disappeared from --keep-meta's output without a word: a .pt
    output leaves it out with a note, safetensors metadata holds its name."""
    source = tmp_path / "train.pth"
    torch.save({"state_dict": {"w": torch.ones(2)}, "amp_dtype": torch.bfloat16, "epoch": 3}, source)
    report = ckptconv.convert(source, tmp_path / "kept.pt", keep_meta=True)
    assert any(note.startswith("--keep-meta left out 'amp_dtype' (a torch.dtype") for note in report.notes)
    ckptconv.convert(source, tmp_path / "kept.safetensors", keep_meta=True)
    with safe_open(str(tmp_path / "kept.safetensors"), "pt") as file:
        metadata = file.metadata()
    assert "torch.bfloat16" in json.dumps(metadata) and "amp_dtype" in json.dumps(metadata)
