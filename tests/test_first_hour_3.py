"""The first hour, round 3 (issue 34): the items left open, each run through the CLI as a user types it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import run_cli


class _Bars:
    """The progress bars a command showed: each one's total and where it stopped."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import click.testing
        import tqdm.auto

        self.finished: list[tuple[float, float]] = []
        bars = self

        class Recorded(tqdm.auto.tqdm):  # type: ignore[misc,name-defined]
            def close(self) -> None:
                if not self.disable:
                    bars.finished.append((self.n, self.total))
                super().close()

        monkeypatch.setattr(tqdm.auto, "tqdm", Recorded)
        # stderr is a terminal, as when a user types the command: ckptconv shows a bar only then.
        monkeypatch.setattr(click.testing._NamedTextIOWrapper, "isatty", lambda self: True)


def _gpt2_like(path: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    wte = torch.nn.Parameter(torch.randn(64, 16))
    state = {
        "transformer.wte.weight": wte,
        "transformer.h.0.mlp.weight": torch.randn(16, 16),
        "transformer.ln_f.weight": torch.ones(16),
        "lm_head.weight": wte,  # tied, as GPT-2's lm_head is
    }
    torch.save(state, path)
    return state


@pytest.mark.parametrize(
    "output, extra",
    [
        ("out.safetensors", ()),
        ("out.pt", ()),
        ("out.safetensors", ("--tied", "copy")),
        ("out/", ("--max-shard-size", "3KB")),
        ("out/", ("--to", "pt", "--max-shard-size", "3KB")),
        ("out/", ("--to", "dcp")),
    ],
)
def test_the_progress_bar_ends_at_its_total_with_tied_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, output: str, extra: tuple[str, ...]
) -> None:
    bars = _Bars(monkeypatch)
    t = torch.randn(40, 40)
    sources = {"shared.pt": {"a": t, "b": t}, "gpt2.pt": None}
    for name, state in sources.items():
        if state is None:
            _gpt2_like(tmp_path / name)
        else:
            torch.save(state, tmp_path / name)
        (tmp_path / name.replace(".pt", "")).mkdir()
        target = str(tmp_path / name.replace(".pt", "") / output)
        code, _, stderr = run_cli("convert", str(tmp_path / name), target, *extra)
        assert code == 0, stderr
    assert len(bars.finished) == 2
    for count, total in bars.finished:
        assert count == total > 0


def test_no_provenance_value_is_empty(tmp_path: Path) -> None:
    import json
    import zipfile

    from safetensors import safe_open

    torch.save({"a": torch.ones(300, 300), "b": torch.ones(300, 300)}, tmp_path / "model.pt")
    for output, extra in (("sharded/", ("--max-shard-size", "400KB")), ("one.safetensors", ()), ("one.pt", ())):
        code, _, stderr = run_cli("convert", str(tmp_path / "model.pt"), str(tmp_path / output), *extra, "-q")
        assert code == 0, stderr
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["metadata"]
    with safe_open(str(tmp_path / "one.safetensors"), "pt") as file:
        header = file.metadata()
    with zipfile.ZipFile(tmp_path / "one.pt") as archive:
        (record,) = [name for name in archive.namelist() if name.endswith("/ckptconv.json")]
        pt_record = json.loads(archive.read(record))
    for metadata in (index, header, pt_record):
        provenance = {key: value for key, value in metadata.items() if key.startswith("ckptconv.")}
        assert "ckptconv.source" in provenance and "ckptconv.version" in provenance, metadata
        assert "ckptconv.selected" not in provenance  # the whole file: nothing to say
        assert all(value != "" for value in provenance.values()), provenance
