"""What the help and the README say matches the code: the transform order, every option, the exit codes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click

from ckptconv.batching import report
from ckptconv.cli import cli
from ckptconv.cli.option_sets import pipeline
from ckptconv.transforms import keys as transforms

from .conftest import run_cli as run

ROOT = Path(__file__).resolve().parent.parent
# The README and the pages of docs/ it links to: together they describe every option.
README = "\n".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])

# The flag that makes each kind of step.
_FLAG_OF = {
    transforms.Canonicalize: "--canonical",
    transforms.StripPrefix: "--strip-prefix",
    transforms.Rename: "--rename",
    transforms.AddPrefix: "--add-prefix",
    transforms.Keep: "--keep",
    transforms.Drop: "--drop",
    transforms.Cast: "--dtype",
}


def _order_in_code() -> list[str]:
    """The order the CLI builds the steps in, with every transform flag given."""
    options: dict[str, Any] = {
        "canonical": True,
        "strip_prefixes": ["module"],
        "renames": [("^a", "b")],
        "add_prefixes": ["net"],
        "keeps": ["."],
        "drops": ["^x$"],
        "dtype": "bf16",
        "keep_dtypes": ["norm"],
        "allow_overflow": False,
    }
    steps = pipeline([], options).steps
    return [_FLAG_OF[type(step)] for step in steps]


def test_the_code_builds_every_transform_flag_into_one_step() -> None:
    assert sorted(_order_in_code()) == sorted(_FLAG_OF.values())


def test_convert_help_states_the_transform_order() -> None:
    code, stdout, _ = run("convert", "--help")
    assert code == 0
    sentence = re.search(r"Transforms apply in this order: (.*?);", " ".join(stdout.split()))
    assert sentence is not None
    assert re.findall(r"--[a-z-]+", sentence.group(1)) == _order_in_code()


def test_readme_states_the_transform_order() -> None:
    sentence = re.search(r"- Transforms: (.*?)\. They apply in\s+that order", README, re.S)
    assert sentence is not None
    listed = [flag for flag in re.findall(r"--[a-z-]+", sentence.group(1)) if flag != "--keep-dtype"]
    assert listed == _order_in_code()


def _cli_options() -> set[str]:
    names: set[str] = set()
    for command in cli.commands.values():
        for param in command.params:
            if isinstance(param, click.Option):
                names |= {name for name in (*param.opts, *param.secondary_opts) if name.startswith("--")}
    return names - {"--help"}


def test_every_option_is_in_the_readme() -> None:
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", README))
    assert sorted(_cli_options() - mentioned) == []


def test_the_readme_mentions_no_option_that_does_not_exist() -> None:
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", README))
    pip = {"--extra-index-url"}  # the set-up section's advice for a CPU torch elsewhere
    assert sorted(mentioned - _cli_options() - {"--version", "--help"} - pip) == []


def test_the_exit_codes_in_the_readme_and_help_are_the_ones_the_code_uses() -> None:
    codes = {value for name, value in vars(report).items() if name.startswith("EXIT_")}
    table = {int(code) for code in re.findall(r"^\|\s*`(\d+)`\s*\|", README, re.M)}
    assert table == codes
    _, stdout, _ = run("--help")
    assert {int(code) for code in re.findall(r"^\s+(\d+)\s{2}", stdout, re.M)} == codes
