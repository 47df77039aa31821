"""The first hour (issue "firsthour"): checking a conversion, mistakes that cost data, help a newcomer can scan."""

from __future__ import annotations

from pathlib import Path

import torch

from .conftest import run_cli


def _dp_model(path: Path, count: int = 3) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = {f"module.layers.{i}.weight": torch.randn(2, 3) for i in range(count)}
    torch.save(state, path)
    return state


def test_swapped_arguments_are_refused_and_the_original_kept(tmp_path: Path) -> None:
    original = tmp_path / "dp_model.pkl"
    _dp_model(original)
    model = tmp_path / "model.pt"
    assert run_cli("strip-module", str(original), str(model), "-q")[0] == 0
    before = original.read_bytes()
    for extra in ((), ("--overwrite",)):
        code, stdout, stderr = run_cli("strip-module", str(model), str(original), *extra)
        assert (code, stdout) == (2, "")
        assert stderr == (
            f"ckptconv: error: the arguments look swapped: strip prefix 'module.' changes no key of {str(model)!r} "
            f"and 3 keys of {str(original)!r}, which exists; the source comes first: "
            f"ckptconv strip-module {original} {model}; see 'cli strip-module --help'\n"
        )
        assert "--overwrite" not in stderr
        assert original.read_bytes() == before
