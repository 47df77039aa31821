"""Real checkpoints saved on GPUs (fixtures/gpu, made by fixtures/make_gpu_fixtures.py on 2 x H200).

On this CPU-only machine every one must open without options, equal
torch.load(map_location="cpu") bit for bit, and convert to files that plain
torch.load(weights_only=True) and safetensors read back unchanged.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import ckptconv
from ckptconv.gpu.torch_tensors import to_torch

from .conftest import (
    FIXTURES,
    HAS_PUBLIC_DTENSOR,
    assert_same_state,
    assert_same_tensor,
    reference_load,
    torch_saves,
    torch_tensors,
)

GPU = FIXTURES / "gpu"
PROVENANCE = json.loads((GPU / "PROVENANCE.json").read_text()) if (GPU / "PROVENANCE.json").exists() else {}

CHECKPOINT_FILES = sorted(
    p.name
    for p in GPU.glob("*")
    if p.is_file()
    and p.suffix in (".pt", ".pth", ".pkl", ".ckpt", ".tar", ".safetensors")
    and p.name != "torchscript_model.pt"
)

# The keys each wrapper leaves on the weights, as saved by the real wrapper on GPUs.
EXPECTED_PREFIX = {
    "dataparallel_state_dict.pkl": "module.",
    "dataparallel_whole_model.pkl": "module.",
    "ddp_rank0.pt": "module.",
    "ddp_rank1.pt": "module.",
    "compiled_state_dict.pt": "_orig_mod.",
    "compiled_over_dataparallel.pt": "_orig_mod.module.",
    "dataparallel_over_compiled.pt": "module._orig_mod.",
    "lightning.ckpt": "model.",
}


@pytest.fixture
def importable_fixture_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make the classes whole-model fixtures reference importable, for the torch.load reference only."""
    monkeypatch.syspath_prepend(str(FIXTURES))
    generator = (FIXTURES / "make_gpu_fixtures.py").read_text()
    quote = "(?:'{3}|\"{3})"
    source = re.search(
        rf"models\.py\"\), \"w\"\) as f:\s+f\.write\(\s*textwrap\.dedent\(\s+{quote}(.*?){quote}", generator, re.S
    )
    assert source, "the generator's private_research_code source moved; update this test"
    package = tmp_path / "private" / "private_research_code"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    import textwrap

    (package / "models.py").write_text(textwrap.dedent(source.group(1)))
    monkeypatch.syspath_prepend(str(tmp_path / "private"))
    yield
    for name in [m for m in sys.modules if m.startswith(("private_research_code", "ckptconv_fixture_models"))]:
        del sys.modules[name]


def test_fixtures_are_present() -> None:
    assert len(CHECKPOINT_FILES) >= 20, "fixtures/gpu is missing; run fixtures/make_gpu_fixtures.py on a GPU machine"


@pytest.mark.parametrize("name", CHECKPOINT_FILES)
def test_every_tensor_equals_torch_load(name: str, importable_fixture_code: None) -> None:
    path = GPU / name
    if not HAS_PUBLIC_DTENSOR and b"torch.distributed.tensor\nDTensor\n" in path.read_bytes():
        pytest.skip("pickles torch.distributed.tensor.DTensor, which this torch's torch.load cannot find")
    checkpoint = ckptconv.open(path)
    ours = dict(checkpoint.tensors())
    compared = 0
    for where, tensor in torch_tensors(reference_load(path)):
        assert where in ours, f"{name}: {where} missing"
        assert_same_tensor(to_torch({where: ours[where]})[where], tensor, f"{name}:{where}")
        compared += 1
    assert compared > 0


def _location_tags(name: str) -> set[str]:
    record = PROVENANCE.get("files", {}).get(name, {}).get("file", {})
    return set(record.get("storage_location_tags") or {})


@pytest.mark.parametrize("name", [n for n in CHECKPOINT_FILES if not n.endswith(".safetensors")])
def test_saved_devices_are_reported(name: str) -> None:
    tags = _location_tags(name)
    if not tags:
        pytest.skip("the provenance records no location tags for this file")
    assert ckptconv.open(GPU / name).saved_devices == tags


@pytest.mark.parametrize("name", sorted(EXPECTED_PREFIX))
def test_wrapper_prefixes_are_as_the_wrappers_wrote_them(name: str) -> None:
    weights = ckptconv.open(GPU / name).select().weights
    assert weights and all(key.startswith(EXPECTED_PREFIX[name]) for key in weights)


SELECTIONS = {
    "train_checkpoint.pth": ("model", False),
    "timm_style_ema.pth.tar": ("state_dict", False),
    "lightning.ckpt": ("state_dict", False),
    "legacy_format_train_checkpoint.pt": ("model", False),
    "whole_model_unimportable.pt": ("", False),
    "dataparallel_whole_model.pkl": ("", False),
}


@pytest.mark.parametrize("name", sorted(SELECTIONS))
def test_weights_are_found_in_training_checkpoints(name: str, importable_fixture_code: None) -> None:
    where, is_ema = SELECTIONS[name]
    selection = ckptconv.open(GPU / name).select()
    assert selection.where == where
    assert selection.is_ema is is_ema
    reference = reference_load(GPU / name)
    expected = reference.state_dict() if isinstance(reference, torch.nn.Module) else reference[where]
    assert_same_state(to_torch(selection.weights), expected)


def test_timm_checkpoint_mentions_its_ema_copy() -> None:
    selection = ckptconv.open(GPU / "timm_style_ema.pth.tar").select()
    assert "state_dict_ema (EMA)" in selection.alternatives
    assert "state_dict_ema" in selection.note
    ema = ckptconv.open(GPU / "timm_style_ema.pth.tar").select("ema")
    assert ema.where == "state_dict_ema" and ema.is_ema


def test_whole_model_without_its_code(importable_fixture_code: None) -> None:
    path = GPU / "whole_model_unimportable.pt"
    facts = PROVENANCE["files"]["whole_model_unimportable.pt"]["facts"]
    checkpoint = ckptconv.open(path)
    for cls in facts["pickled_classes"]:
        assert cls in checkpoint.foreign_globals
    weights = checkpoint.select().weights
    assert list(weights) == facts["state_dict_keys"]
    assert "anchor_cache" not in weights


def test_torchscript_archive_is_refused() -> None:
    with pytest.raises(ckptconv.UnsupportedFormatError, match="TorchScript"):
        ckptconv.open(GPU / "torchscript_model.pt")


@pytest.mark.parametrize("name", [n for n in CHECKPOINT_FILES if n != "fsdp2_rank0_dtensor_state_dict.pt"])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_converted_files_load_with_plain_tools(name: str, suffix: str, tmp_path: Path) -> None:
    source = GPU / name
    selection = ckptconv.open(source).select()
    if suffix == ".safetensors" and any(r.dtype.safetensors is None for r in selection.weights.values()):
        pytest.skip("holds dtypes safetensors cannot store")
    if suffix == ".pt" and not all(torch_saves(r.dtype.name) for r in selection.weights.values()):
        pytest.skip("holds dtypes this torch.load(weights_only=True) cannot read (torch 2.4: uint16/32/64)")
    target = tmp_path / f"out{suffix}"
    report = ckptconv.convert(source, target, verify=True)
    assert report.verified
    expected = to_torch(selection.weights)
    if suffix == ".pt":
        loaded = torch.load(target, weights_only=True)
        assert all(t.device.type == "cpu" for t in loaded.values())
        assert_same_state(loaded, expected)
        mapped = torch.load(target, weights_only=True, mmap=True)
        assert_same_state(mapped, expected)
    else:
        with safe_open(target, framework="pt") as handle:
            assert handle.metadata()["format"] == "pt"
            names = handle.keys()
            stored = {key: handle.get_tensor(key) for key in names}
        for key, tensor in stored.items():
            assert_same_tensor(tensor, expected[key], key)
        assert set(stored) | set(report.aliases) == set(expected)
        # safetensors orders tensors by dtype size for alignment, so compare as sets.
        assert_same_state(ckptconv.load(target), expected, ordered=False)


def test_tied_weights_and_views_stay_compact(tmp_path: Path) -> None:
    source = GPU / "tied_and_view.pt"
    for suffix in (".pt", ".safetensors"):
        target = tmp_path / f"out{suffix}"
        ckptconv.convert(source, target)
        # The source drags a whole 1 MiB storage along for its small views.
        assert target.stat().st_size < source.stat().st_size / 2, suffix
        loaded = ckptconv.load(target)
        reference = reference_load(source)
        for key, tensor in reference.items():
            if isinstance(tensor, torch.Tensor):
                assert_same_tensor(loaded[key], tensor, key)
        assert loaded["encoder.weight"].data_ptr() == loaded["decoder.weight"].data_ptr()
