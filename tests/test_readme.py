"""Every example in the README runs, against small real checkpoints, so the README cannot drift from the code.

The fenced blocks are read from README.md itself: the set-up block must be the two commands
``.ci/run`` runs; each ``ckptconv ...`` line of the command-line block runs in a fresh folder of
fixtures named as the README names them (its destination removed first); the batch block runs
in order in one folder; the Python blocks run as scripts, with ``model`` a module whose keys match.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import ckptconv

from .conftest import FIXTURES, run_cli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")

# Lines that cannot run here, and why.
NEEDS_ELSEWHERE = {"--scheduler tcp://host:8786": "needs a running Dask scheduler at that address"}


def blocks() -> list[tuple[str, str, str]]:
    """(section heading, language, text) of every fenced block, in order."""
    found = []
    heading = ""
    fence: tuple[str, list[str]] | None = None
    for line in README.splitlines():
        if fence is not None:
            if line.startswith("```"):
                found.append((heading, fence[0], "\n".join(fence[1]) + "\n"))
                fence = None
            else:
                fence[1].append(line)
        elif line.startswith("```"):
            fence = (line[3:].strip(), [])
        elif line.startswith("## "):
            heading = line[3:].strip()
    return found


class Net(nn.Module):
    """The model the README's Python examples call ``model``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.norm = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)


def _state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return Net().state_dict()


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every file the README's examples read, named as they name it."""
    folder = tmp_path_factory.mktemp("readme_fixtures")
    state = _state(0)
    torch.save(state, folder / "model.pt")
    torch.save(state, folder / "big.pt")
    torch.save(state, folder / "a.pt")
    save_file(state, str(folder / "model.safetensors"))
    save_file(state, str(folder / "big.safetensors"))
    dp = {f"module.{key}": value for key, value in state.items()}
    torch.save(dp, folder / "dp_model.pkl")
    torch.save(dp, folder / "dp_ckpt.pkl")
    torch.save({f"module._orig_mod.{key}": value for key, value in state.items()}, folder / "compiled_ddp.pt")
    torch.save(
        {
            "epoch": 3,
            "state_dict": state,
            "state_dict_ema": _state(1),
            "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
            "args": argparse.Namespace(lr=0.1, arch="net"),
        },
        folder / "train_ckpt.pth",
    )
    shutil.copy(folder / "train_ckpt.pth", folder / "a.ckpt")
    shutil.copy(folder / "train_ckpt.pth", folder / "b.ckpt")
    torch.save({"state_dict": {f"model.{key}": value for key, value in state.items()}}, folder / "lightning.ckpt")
    torch.save(state, folder / "epoch10.pt")
    torch.save(_state(2), folder / "epoch11.pt")
    shutil.copytree(FIXTURES / "gpu" / "hf_sharded_safetensors", folder / "llama_dir")
    shutil.copytree(FIXTURES / "gpu" / "fsdp2_dcp", folder / "fsdp_step_1000")
    (folder / "mypkg").mkdir()
    (folder / "mypkg" / "__init__.py").write_text("")
    (folder / "mypkg" / "models.py").write_text(
        "from torch import nn\n\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.conv1 = nn.Conv2d(3, 4, 3)\n"
        "        self.norm = nn.BatchNorm2d(4)\n"
        "        self.fc = nn.Linear(4, 2)\n\n\n"
        "def build_model():\n"
        "    return Net()\n"
    )
    (folder / "downloads").mkdir()
    torch.save(state, folder / "downloads" / "model.pt")
    save_file(state, str(folder / "downloads" / "model.safetensors"))
    for index, name in enumerate(["a/m1.pth", "a/b/m2.pth", "c/m3.pt"]):
        (folder / "zoo" / name).parent.mkdir(parents=True, exist_ok=True)
        torch.save(_state(10 + index), folder / "zoo" / name)
    return folder


def _fresh(fixtures: Path, tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    shutil.copytree(fixtures, folder)
    return folder


def _run_line(line: str, folder: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    args = shlex.split(line, comments=True)
    assert args[0] == "ckptconv", line
    monkeypatch.chdir(folder)
    code, _, stderr = run_cli(*args[1:])
    return code, stderr


def test_the_set_up_block_is_what_ci_runs() -> None:
    (heading, _, text), *_ = blocks()
    assert heading == "Set up"
    commands = [line for line in text.splitlines() if line.strip()]
    assert commands == ['pip install -e ".[test]" torch==2.13.0', "python -m pytest"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "/^## Set up/" in ci and 'eval "$command"' in ci and "rm -rf" in ci


def test_every_command_line_example_runs(fixtures: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = [
        line
        for heading, language, text in blocks()
        if heading == "Command line" and not language
        for line in text.splitlines()
        if line.startswith("ckptconv ")
    ]
    assert len(lines) >= 15
    for index, line in enumerate(lines):
        folder = _fresh(fixtures, tmp_path, f"line{index}")
        args = shlex.split(line, comments=True)
        if args[1] in ("convert", "strip-module", "add-module", "fit"):
            destination = folder / args[3]  # the README shows what a conversion makes: start without it
            if destination.is_dir():
                shutil.rmtree(destination)
            elif destination.exists():
                destination.unlink()
        code, stderr = _run_line(line, folder, monkeypatch)
        expected = 3 if args[1] == "diff" else 0  # epoch10 and epoch11 differ
        assert code == expected, f"{line}\n{stderr}"


def test_the_batch_examples_run_in_order(fixtures: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _fresh(fixtures, tmp_path, "batch")
    (text,) = [text for heading, language, text in blocks() if heading == "Batch conversion" and not language]
    ran = 0
    for line in text.splitlines():
        if not line.startswith("ckptconv ") or any(marker in line for marker in NEEDS_ELSEWHERE):
            continue
        code, stderr = _run_line(line, folder, monkeypatch)
        assert code == 0, f"{line}\n{stderr}"
        ran += 1
    assert ran == 3
    assert sorted(p.relative_to(folder / "out").as_posix() for p in (folder / "out").rglob("*.safetensors")) == [
        "a/b/m2.safetensors",
        "a/m1.safetensors",
        "c/m3.safetensors",
    ]
    assert sorted(p.name for p in (folder / "pth_only").rglob("*.safetensors")) == ["m1.safetensors", "m2.safetensors"]


def test_the_python_examples_run(fixtures: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = [(heading, text) for heading, language, text in blocks() if language == "python"]
    assert [heading for heading, _ in python] == ["Batch conversion", "Python API"]
    for index, (heading, text) in enumerate(python):
        folder = _fresh(fixtures, tmp_path, f"python{index}")
        (folder / "model.safetensors").unlink()  # the example converts into it
        monkeypatch.chdir(folder)
        model = Net()
        namespace: dict[str, Any] = {"model": model}
        exec(compile(text, f"README.md ({heading})", "exec"), namespace)  # our own README
        assert namespace["ckptconv"] is ckptconv
    # The last one left the model holding the fitted weights, bit for bit.
    for key, value in model.state_dict().items():
        assert torch.equal(value, _state(0)[key]), key
