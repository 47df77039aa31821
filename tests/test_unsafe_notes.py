"""What ckptconv says about a file it will not convert: an unsafe file beside a model is named as unsafe and
never offered as weights to convert; scan's foreign verdict says what torch would import and that ckptconv
reads the file without it (issue 40, item 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from .conftest import assert_same_state, run_cli
from .test_errors import _malicious_zip

UNSAFE_NOTE = (
    "note: left out optimizer.pt, which is unsafe: it names code-running callables (ckptconv scan says which); "
    "not converted, and never to be opened with torch.load(weights_only=False)"
)


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"embed.weight": torch.randn(8, 4), "head.weight": torch.randn(3, 4), "head.bias": torch.zeros(3)}


def _model_folder(folder: Path, *, sharded: bool) -> dict[str, torch.Tensor]:
    folder.mkdir()
    weights = _weights()
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny", "architectures": ["Tiny"]}))
    if sharded:
        first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
        save_file({"embed.weight": weights["embed.weight"]}, folder / first, metadata={"format": "pt"})
        save_file({k: v for k, v in weights.items() if k != "embed.weight"}, folder / second, metadata={"format": "pt"})
        weight_map = {key: first if key == "embed.weight" else second for key in weights}
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    _malicious_zip(folder).rename(folder / "optimizer.pt")
    return weights


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "one-file"])
def test_an_unsafe_file_beside_a_model_is_named_unsafe_never_weights_to_convert(sharded: bool, tmp_path: Path) -> None:
    weights = _model_folder(tmp_path / "model", sharded=sharded)
    out = tmp_path / "out"
    code, stdout, stderr = run_cli("convert", str(tmp_path / "model"), f"{out}/")
    assert (code, stdout) == (0, ""), stderr
    lines = stderr.splitlines()
    assert UNSAFE_NOTE in lines, lines
    assert not any("did not convert" in line or "convert them" in line for line in lines), lines
    written = load_file(out / "model.safetensors")
    assert_same_state(written, weights, ordered=False)  # the same keys, dtypes, shapes and bytes
    assert not (out / "optimizer.pt").exists() and not (tmp_path / "model" / "canary").exists()


def test_scan_foreign_says_what_torch_would_import_and_that_ckptconv_reads_it_without(tmp_path: Path) -> None:
    import argparse

    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "hparams": argparse.Namespace(lr=0.1)}, path)
    code, stdout, _ = run_cli("scan", str(path))
    assert code == 3
    assert stdout.splitlines() == [
        f"foreign           {path}: names code that is not here (argparse.Namespace); "
        "torch.load(weights_only=False) would import argparse and call it; ckptconv reads the file without "
        "importing it (convert it, or ckptconv.load() it)"
    ]
