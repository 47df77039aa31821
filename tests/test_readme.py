"""Every example in the README and docs/ runs, against small real checkpoints, so they cannot drift from the code.

The fenced blocks are read from the files themselves, and every one is run: the set-up block must be the
two commands ``.ci/run`` runs; each ``ckptconv ...`` line of a block runs in a fresh folder of fixtures
named as the text names them (its destination removed first); the blocks of a walk-through (the quick
start, the batch commands) run in order in one folder; a block that starts with
``$ ckptconv ...`` is the command and exactly what it prints; the README's Python API block runs as
written in an empty folder, the other Python blocks among the fixtures.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file
from torch import nn

import ckptconv
from ckptconv.cli import cli

from .conftest import FIXTURES, run_cli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
# Every document whose blocks run: the README and each page of docs/.
DOCUMENTS = {"README.md": README} | {
    f"docs/{path.name}": path.read_text(encoding="utf-8") for path in sorted((ROOT / "docs").glob("*.md"))
}
# The headings whose blocks run in order in one folder, each after the one before.
WALK_THROUGHS = ("Quick start", "Batch conversion")

# Lines that cannot run here, and why.
NEEDS_ELSEWHERE = {"--scheduler tcp://host:8786": "needs a running Dask scheduler at that address"}


def blocks(text: str = README) -> list[tuple[str, str, str]]:
    """(section heading, language, text) of every fenced block of ``text``, in order."""
    found = []
    heading = ""
    fence: tuple[str, list[str]] | None = None
    for line in text.splitlines():
        if fence is not None:
            if line.lstrip().startswith("```"):  # a block inside a list item is indented
                found.append((heading, fence[0], textwrap.dedent("\n".join(fence[1]) + "\n")))
                fence = None
            else:
                fence[1].append(line)
        elif line.lstrip().startswith("```"):
            fence = (line.lstrip()[3:].strip(), [])
        elif line.startswith(("## ", "# ")):
            heading = line.lstrip("#").strip()
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
    _training_runs(folder)
    _incoming(folder)
    _model_folders(folder)
    return folder


def _training_runs(folder: Path) -> None:
    """docs/training-runs.md's runs: real DeepSpeed, FSDP and Megatron checkpoints (fixtures/runs/)."""
    runs = FIXTURES / "runs"
    not_golden = shutil.ignore_patterns("golden_*")
    shutil.copytree(runs / "ds_zero2_bf16", folder / "ds_run", ignore=not_golden)
    shutil.copytree(runs / "fsdp2_dtensor", folder / "verl_ckpt" / "global_step_100" / "actor", ignore=not_golden)
    shutil.copytree(runs / "fsdp1_sharded", folder / "fsdp1_run", ignore=not_golden)
    shutil.copytree(runs / "megatron_tp2", folder / "megatron_ckpt" / "iter_0001000", ignore=not_golden)


def _model_folders(folder: Path) -> None:
    """The quantized and model-folder examples: an fp8 block-scaled folder, a model folder with a training
    checkpoint of it, and a Megatron-Core run with the Hugging Face base model its names are mapped to."""
    import json

    shutil.copytree(FIXTURES / "gpu" / "hf_sharded_safetensors", folder / "hf_model")
    shutil.copytree(FIXTURES / "gpu" / "hf_sharded_safetensors", folder / "base_model")
    base = ckptconv.open(folder / "base_model").select().weights
    torch.save({"state_dict": {f"model.{key}": ref.torch() for key, ref in base.items()}}, folder / "last.ckpt")
    fp8 = folder / "fp8_model"
    fp8.mkdir()
    weight = (torch.randn(256, 200) * 100).to(torch.float8_e4m3fn)
    save_file({"l.weight": weight, "l.weight_scale_inv": torch.rand(2, 2)}, str(fp8 / "model.safetensors"))
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (fp8 / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": quantization}))
    not_golden = shutil.ignore_patterns("golden_*")
    shutil.copytree(FIXTURES / "runs" / "megatron_llama", folder / "megatron_run", ignore=not_golden)
    config = json.loads((FIXTURES / "runs" / "megatron_llama" / "config.json").read_text())
    fields = {k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"}
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**fields))
    model.save_pretrained(folder / "hf_base")
    peft = pytest.importorskip("peft")
    for name, targets in (("my_adapter", ["q_proj", "v_proj"]), ("adapter_a", ["q_proj"]), ("adapter_b", ["o_proj"])):
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=targets))
        wrapped.save_pretrained(folder / name)
        if name == "my_adapter":  # a training run's checkpoint of the wrapped model
            torch.save({"state_dict": {f"model.{k}": v for k, v in wrapped.state_dict().items()}}, folder / "lora.ckpt")
        model = wrapped.unload()


class _RunsAProcess:
    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, ("echo pwned",))


def _incoming(folder: Path) -> None:
    """What the scan example finds: one file of each verdict but not-a-checkpoint."""
    import pickle

    incoming = folder / "incoming"
    (incoming / "run3").mkdir(parents=True)
    state = {"w": torch.ones(2, 2)}
    save_file(state, str(incoming / "model.safetensors"))
    torch.save({"state_dict": state, "args": argparse.Namespace(lr=0.1)}, incoming / "run3" / "last.ckpt")
    (incoming / "lora.pt").write_bytes(pickle.dumps({"w": _RunsAProcess()}, protocol=2))
    torch.save(state, folder / "whole.pt")
    whole = (folder / "whole.pt").read_bytes()
    (incoming / "half.pt").write_bytes(whole[: len(whole) // 2])


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
    (text,) = [text for heading, _, text in blocks() if heading == "Set up"]
    commands = [line for line in text.splitlines() if line.strip()]
    assert commands == ['pip install -e ".[test]" torch==2.13.0', "python -m pytest"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "/^## Set up/" in ci and 'eval "$command"' in ci and "rm -rf" in ci


def test_the_install_block_installs_this_checkout_with_its_command() -> None:
    (text,) = [text for heading, _, text in blocks() if heading == "Install"]
    assert [shlex.split(line, comments=True) for line in text.splitlines() if line.strip()] == [
        ["pip", "install", "."],
        ["pip", "install", ".[torch]"],  # the extra the test below checks pyproject for
    ]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'ckptconv = "ckptconv.cli:main"' in pyproject and '\ntorch = ["torch>=2.4"]' in pyproject


def _kind(document: str, heading: str, language: str, text: str) -> str:
    """How a block runs; every block of every document has one."""
    if heading in ("Set up", "Install") and document == "README.md":
        return heading.lower()
    if heading in WALK_THROUGHS:
        return "walk-through"
    if language == "python":
        return "python as written" if (document, heading) == ("README.md", "Python API") else "python"
    lines = [line for line in text.splitlines() if line.strip()]
    if lines and lines[0].startswith("$ ckptconv "):
        return "output"
    if lines and all(line.startswith("ckptconv ") for line in lines):
        return "lines"
    return "unknown"


ALL_BLOCKS = [
    (document, heading, language, text)
    for document, content in DOCUMENTS.items()
    for heading, language, text in blocks(content)
]


def test_every_block_of_every_document_is_run() -> None:
    unknown = [
        (document, heading, text[:60])
        for document, heading, language, text in ALL_BLOCKS
        if _kind(document, heading, language, text) == "unknown"
    ]
    assert unknown == []
    assert len(ALL_BLOCKS) >= 12


def _remove_destination(folder: Path, args: list[str]) -> None:
    if args[1] in ("convert", "strip-module", "add-module", "fit"):
        destination = folder / args[3]  # the text shows what a conversion makes: start without it
        if destination.is_dir():
            shutil.rmtree(destination)
        elif destination.exists():
            destination.unlink()


def test_every_command_line_example_runs(fixtures: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = [
        (document, line)
        for document, heading, language, text in ALL_BLOCKS
        if _kind(document, heading, language, text) == "lines"
        for line in text.splitlines()
        if line.startswith("ckptconv ")
    ]
    assert len(lines) >= 20
    for index, (document, line) in enumerate(lines):
        folder = _fresh(fixtures, tmp_path, f"line{index}")
        args = shlex.split(line, comments=True)
        _remove_destination(folder, args)
        code, stderr = _run_line(line, folder, monkeypatch)
        expected = 3 if args[1] == "diff" else 0  # epoch10 and epoch11 differ
        assert code == expected, f"{document}: {line}\n{stderr}"


def test_every_example_output_is_what_the_command_prints(
    fixtures: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outputs = [(d, t) for d, h, language, t in ALL_BLOCKS if _kind(d, h, language, t) == "output"]
    assert len(outputs) >= 5
    folder = _fresh(fixtures, tmp_path, "outputs")
    monkeypatch.chdir(folder)
    for document, text in outputs:
        command, printed = text.split("\n", 1)
        args = shlex.split(command.strip().removeprefix("$ ckptconv "))
        result = CliRunner().invoke(cli, args, prog_name="ckptconv", catch_exceptions=False)
        assert result.stdout + result.stderr == printed, f"{document}: {command}"


def test_the_walk_throughs_run_in_order(fixtures: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    walked: dict[str, Path] = {}
    for document, heading, language, text in ALL_BLOCKS:
        if _kind(document, heading, language, text) != "walk-through":
            continue
        if heading not in walked:
            walked[heading] = _fresh(fixtures, tmp_path, f"walk{len(walked)}")
            shutil.rmtree(walked[heading] / "out", ignore_errors=True)
            (walked[heading] / "model.pt").unlink()  # the quick start and the checks make it
        folder = walked[heading]
        if language == "python":
            monkeypatch.chdir(folder)
            monkeypatch.syspath_prepend(str(folder))
            exec(compile(text, f"{document} ({heading})", "exec"), {})  # our own documents
            continue
        for line in text.splitlines():
            if not line.startswith("ckptconv ") or any(marker in line for marker in NEEDS_ELSEWHERE):
                continue
            code, stderr = _run_line(line, folder, monkeypatch)
            assert code == 0, f"{document}: {line}\n{stderr}"
    assert sorted(walked) == sorted(WALK_THROUGHS)
    out = walked["Batch conversion"] / "out"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.safetensors")) == [
        "a/b/m2.safetensors",
        "a/m1.safetensors",
        "c/m3.safetensors",
    ]
    pth_only = walked["Batch conversion"] / "pth_only"
    assert sorted(p.name for p in pth_only.rglob("*.safetensors")) == ["m1.safetensors", "m2.safetensors"]


def test_the_python_api_block_runs_as_written_in_an_empty_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (text,) = [t for d, h, language, t in ALL_BLOCKS if _kind(d, h, language, t) == "python as written"]
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(compile(text, "README.md (Python API)", "exec"), namespace)  # our own README
    assert namespace["ckptconv"] is ckptconv
    # It left the model holding the fitted weights of the file it saved, bit for bit.
    saved = torch.load(tmp_path / "dp_model.pkl", weights_only=True)
    for key, value in namespace["model"].state_dict().items():
        assert torch.equal(value, saved[f"module.{key}"]), key


def test_the_other_python_examples_run(fixtures: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = [(d, h, t) for d, h, language, t in ALL_BLOCKS if _kind(d, h, language, t) == "python"]
    assert python
    for index, (document, heading, text) in enumerate(python):
        monkeypatch.chdir(_fresh(fixtures, tmp_path, f"python{index}"))
        exec(compile(text, f"{document} ({heading})", "exec"), {"model": Net()})  # our own documents
