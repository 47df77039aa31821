"""Device mistakes are CkptconvErrors naming the spellings; --like takes a factory call with literal arguments,
never evaluating code; an existing output exits 2 (issue 40, item 6)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptconv

from .conftest import run_cli

SPELLINGS = (
    '"cpu" (or None), "cuda" (the current GPU), "cuda:N" (GPU N) or "auto" (the GPU with the most free '
    "memory, else the CPU)"
)
MODEL = '"model" (each tensor onto the device of the parameter or buffer it fills)'


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "m.pt"
    torch.save({"w": torch.arange(6.0).reshape(2, 3), "n": torch.tensor(3)}, path)
    return path


@pytest.mark.parametrize("device", ["best", "gpu", "meta", "cuda:x", "tpu:0"])
def test_a_device_spelling_ckptconv_does_not_take_lists_the_ones_it_does(device: str, checkpoint: Path) -> None:
    with pytest.raises(ckptconv.DeviceError) as caught:
        ckptconv.load(checkpoint, device=device)
    assert str(caught.value) == f"ckptconv cannot load onto device {device!r}; pass {SPELLINGS}"
    assert isinstance(caught.value, ckptconv.CkptconvError) and isinstance(caught.value, ValueError)
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ckptconv.DeviceError) as caught:
        ckptconv.load_into(model, checkpoint, device=device)
    assert str(caught.value) == (
        f'ckptconv cannot load onto device {device!r}; pass "cpu" (or None), "cuda" (the current GPU), '
        f'"cuda:N" (GPU N), "auto" (the GPU with the most free memory, else the CPU) or {MODEL}'
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3", torch.device("cuda")])
def test_a_gpu_without_a_gpu_is_a_ckptconv_error(device: object, checkpoint: Path) -> None:
    build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA GPU is visible"
    with pytest.raises(ckptconv.DeviceError) as caught:
        ckptconv.load(checkpoint, device=device)
    assert str(caught.value) == (
        f'device {device!r} needs a GPU, and this process has none ({build}); pass "cpu", '
        'or "auto" to use a GPU only where there is one'
    )


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu"), "cpu:0"])
def test_the_cpu_spellings_load(device: object, checkpoint: Path) -> None:
    loaded = ckptconv.load(checkpoint, device=device)
    expected = torch.load(checkpoint, weights_only=True)
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], v) for k, v in expected.items())


MYMODELS = """\
import pathlib
pathlib.Path("imported").write_text("yes")
import torch

def build(width=4, depth=1, names=("a",)):
    assert isinstance(names, tuple)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(3, width)] + [torch.nn.Linear(width, width) for _ in range(depth - 1)]
    return torch.nn.Sequential(*layers)
"""


@pytest.fixture
def factory_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "mymodels.py").write_text(MYMODELS)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 5))
    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, tmp_path / "dp.pt")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_like_a_factory_called_with_literal_arguments(factory_folder: Path) -> None:
    code, _, stderr = run_cli(
        "fit", "dp.pt", "out.safetensors", "--like", "mymodels:build(width=5, depth=2, names=('x', 'y'))"
    )
    assert code == 0, stderr
    expected = {k.removeprefix("module."): v for k, v in torch.load("dp.pt", weights_only=True).items()}
    written = load_file(factory_folder / "out.safetensors")
    assert written.keys() == expected.keys() and all(torch.equal(written[k], v) for k, v in expected.items())


@pytest.mark.parametrize(
    "spec, why",
    [
        (
            "mymodels:build(width=__import__('os').system('touch canary'))",
            "\"__import__('os').system('touch canary')\" is not a literal value (nothing was run)",
        ),
        ("mymodels:build(width=5, **{'depth': 2})", "* and ** arguments are not taken"),
        ("mymodels:build(width=5", "'build(width=5' is not a factory's name or call"),
        ("mymodels:build()()", "'build()()' is not a factory's name or call"),
    ],
)
def test_like_refuses_arguments_that_are_not_literals_before_importing_anything(
    spec: str, why: str, factory_folder: Path
) -> None:
    code, _, stderr = run_cli("fit", "dp.pt", "out.safetensors", "--like", spec)
    usage = "write 'package.module:factory' or 'package.module:factory(key=value, ...)' with literal values"
    assert (code, stderr) == (1, f"ckptconv: error: --like {spec!r}: {why}; {usage}\n")
    assert not (factory_folder / "canary").exists() and not (factory_folder / "imported").exists()
    assert not (factory_folder / "out.safetensors").exists()


def test_an_existing_output_is_a_usage_error_as_the_readme_says(checkpoint: Path, tmp_path: Path) -> None:
    output = tmp_path / "out.safetensors"
    output.write_bytes(b"precious")
    for command in ("convert", "strip-module"):
        code, stdout, stderr = run_cli(command, str(checkpoint), str(output))
        assert (code, stdout) == (2, "")
        assert stderr == f"ckptconv: error: {str(output)!r} already exists; pass --overwrite to replace it\n"
        assert output.read_bytes() == b"precious"
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert "| `2` | usage error: " in readme and "outputs that exist" in readme.split("| `2` |")[1].split("\n")[0]
