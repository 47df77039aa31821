"""`pip install ckptconv` pulls no torch: the command line works without it, and what needs torch says so in one
line naming the extra (issue 40, item 5). Each test runs ckptconv in a fresh Python where ``import torch`` fails,
as in a virtual environment without it; the outputs are read back by torch and the safetensors library here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import tiny_state_dict

ROOT = Path(__file__).resolve().parent.parent

# A meta-path finder that refuses torch, as a Python without torch installed does.
NO_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoTorch())
"""

EXTRA = "pip install 'ckptconv[torch]'"


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH + f"sys.path.insert(0, {str(ROOT)!r})\n" + code],
        capture_output=True,
        text=True,
        cwd=cwd,
        check=False,
        timeout=300,
    )


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _python(f"from ckptconv.cli import main\nsys.argv = ['ckptconv', *{list(args)!r}]\nsys.exit(main())\n", cwd)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    torch.save({f"module.{k}": v for k, v in tiny_state_dict(0).items()}, tmp_path / "dp.pt")
    torch.save({"model": tiny_state_dict(1), "optimizer": {"state": {}, "param_groups": []}}, tmp_path / "train.pt")
    (tmp_path / "zoo").mkdir()
    torch.save(tiny_state_dict(2), tmp_path / "zoo" / "a.pt")
    return tmp_path


def _assert_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_the_blocker_blocks_torch(tmp_path: Path) -> None:
    result = _python("import torch\n", tmp_path)
    assert result.returncode == 1 and "ModuleNotFoundError: No module named 'torch'" in result.stderr


def test_the_command_line_converts_strips_scans_and_inspects_without_torch(folder: Path) -> None:
    dp = torch.load(folder / "dp.pt", weights_only=True)
    stripped = {key.removeprefix("module."): value for key, value in dp.items()}

    result = _cli(folder, "convert", "dp.pt", "a.safetensors", "--verify")
    assert result.returncode == 0, result.stderr
    _assert_equal(load_file(folder / "a.safetensors"), dp)

    result = _cli(folder, "strip-module", "dp.pt", "b.safetensors")
    assert result.returncode == 0, result.stderr
    _assert_equal(load_file(folder / "b.safetensors"), stripped)

    result = _cli(folder, "convert", "dp.pt", "c.safetensors", "--dtype", "bf16", "--strip-prefix", "module")
    assert result.returncode == 0, result.stderr
    cast = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in stripped.items()}
    _assert_equal(load_file(folder / "c.safetensors"), cast)

    result = _cli(folder, "convert", "train.pt", "d.pt")  # the weights inside a training checkpoint, to .pt
    assert result.returncode == 0, result.stderr
    _assert_equal(torch.load(folder / "d.pt", weights_only=True), tiny_state_dict(1))

    result = _cli(folder, "scan", "dp.pt", "train.pt")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith("safe ")

    result = _cli(folder, "inspect", "dp.pt", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)

    result = _cli(folder, "verify", "dp.pt", "b.safetensors", "--strip-prefix", "module")
    assert result.returncode == 0, result.stderr

    result = _cli(folder, "batch", "zoo", "out", "-q")
    assert result.returncode == 0, result.stderr
    _assert_equal(load_file(folder / "out" / "a.safetensors"), tiny_state_dict(2))


def test_load_without_torch_is_one_line_naming_the_extra(folder: Path) -> None:
    result = _python(
        "import ckptconv\n"
        "try:\n"
        "    ckptconv.load('dp.pt')\n"
        "except ckptconv.MissingDependencyError as error:\n"
        "    print(type(error).__mro__[1].__name__, isinstance(error, ImportError), error.extra, error, sep='|')\n",
        folder,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"CkptconvError|True|torch|ckptconv.load() (torch tensors) needs torch: {EXTRA}\n"


@pytest.mark.parametrize(
    "args, what",
    [
        (
            ["convert", "dp.pt", "v.safetensors", "--verify=torch"],
            "--verify=torch (torch's and the safetensors library's readers)",
        ),
        (
            ["verify", "dp.pt", "dp.pt", "--reference", "torch"],
            "--verify=torch (torch's and the safetensors library's readers)",
        ),
        (
            ["fit", "dp.pt", "f.safetensors", "--like", "mymodels:build(width=3)"],
            "--like mymodels:build(width=3) (a model built by your code)",
        ),
        (["convert", "dp.pt", "t.safetensors", "--trust"], "--trust (torch.load)"),
    ],
)
def test_what_needs_torch_says_so_in_one_line(args: list[str], what: str, folder: Path) -> None:
    before = sorted(p.name for p in folder.iterdir())
    result = _cli(folder, *args)
    assert (result.returncode, result.stderr) == (1, f"ckptconv: error: {what} needs torch: {EXTRA}\n")
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing left behind


def test_pyproject_keeps_torch_out_of_the_dependencies() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [dep for dep in project["dependencies"] if dep.lower().startswith("torch")]
    assert project["optional-dependencies"]["torch"] == ["torch>=2.4"]
    assert any(dep.startswith("torch") for dep in project["optional-dependencies"]["test"])
    readme = (ROOT / "README.md").read_text()
    assert "pip install .  " in readme and "pip install '.[torch]'" in readme
