"""The tree is ruff-clean and ruff-formatted (rules in pyproject.toml), as tests/test_typing.py holds mypy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff(command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_layers() -> None:
    """The import graph runs one way: the contracts in pyproject.toml (ARCHITECTURE.md explains them)."""
    command = str(Path(sys.executable).with_name("lint-imports"))  # the console script of this environment
    result = subprocess.run([command], cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_module_is_over_600_lines_but_the_pickle_machine() -> None:
    """A module does one job a reader can name; the pickle machine's opcode loop stays whole (its docstring
    says why)."""
    long = {
        str(path.relative_to(ROOT)): lines
        for path in (ROOT / "ckptconv").rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > 600
    }
    assert set(long) <= {"ckptconv/reading/unpickling/unpickler.py"}, long


def test_at_most_twelve_modules_at_the_top_of_the_package() -> None:
    """Everything else lives in the folder of its stage (ARCHITECTURE.md)."""
    top = sorted(path.name for path in (ROOT / "ckptconv").glob("*.py"))
    assert len(top) <= 12, top


def test_no_import_cycle() -> None:
    """No two modules import each other, directly or through others (function-level imports count)."""
    import grimp

    graph = grimp.build_graph("ckptconv")
    cycles = [
        (module, other)
        for module in sorted(graph.modules)
        for other in sorted(graph.find_modules_directly_imported_by(module))
        if graph.chain_exists(importer=other, imported=module)
    ]
    assert cycles == []
