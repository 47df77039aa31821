"""One options object: the CLI, convert() and batch() agree on every option because they read one definition."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from pathlib import Path
from typing import Any

import click
import pytest
import torch

import ckptconv
from ckptconv.cli import cli
from ckptconv.options import ConversionOptions, flags

from .conftest import assert_same_state, tiny_state_dict
from .conftest import run_cli as run


def _listed(command: str) -> set[str]:
    params = cli.commands[command].params
    return {name for param in params if isinstance(param, click.Option) for name in param.opts}


@pytest.mark.parametrize("command", ["convert", "strip-module", "add-module", "fit", "batch", "inspect", "verify"])
def test_each_command_lists_exactly_the_option_flags_it_accepts(command: str) -> None:
    listed = _listed(command)
    for _, flag in flags():
        assert (flag.name in listed) == (command in flag.commands), (command, flag.name)


def test_batch_lists_no_option_it_rejects() -> None:
    """Every option `batch --help` shows is accepted: none ends in a usage error (exit 2)."""
    assert "--max-shard-size" not in _listed("batch")
    assert (
        "dcp"
        not in cli.commands["batch"].params[[p.name for p in cli.commands["batch"].params].index("to")].type.choices
    )


def _sample_arguments(param: click.Option) -> list[list[str]]:
    flag = param.opts[-1]
    if param.is_flag:
        return [[flag]]
    if isinstance(param.type, click.Choice):
        return [[flag, choice] for choice in param.type.choices]
    samples = {
        "--select": "state_dict",
        "--strip-prefix": "module",
        "--add-prefix": "net",
        "--rename": "^a=b",
        "--keep": ".",
        "--drop": "^never$",
        "--dtype": "bf16",
        "--keep-dtype": "norm",
        "--glob": "**/*.pt",
        "--jobs": "1",
        "--max-shard-size": "1GB",
        "--like": "unused",
        "--scheduler": "tcp://127.0.0.1:1",
        "--scheduler-timeout": "5",
        "--shard": "0/2",
        "--part": "0/2",
        "--padded-vocab-size": "128",
    }
    return [[flag, samples[flag]]]


@pytest.mark.parametrize("command", ["convert", "batch"])
def test_every_listed_option_is_accepted(command: str, tmp_path: Path) -> None:
    """Not one option a command lists is refused as bad usage (exit 2) when it is given."""
    source = tmp_path / "src"
    source.mkdir()
    torch.save(tiny_state_dict(), source / "model.pt")
    for param in cli.commands[command].params:
        if not isinstance(param, click.Option) or param.name in ("help", "dry_run"):
            continue
        # Options that need another to make sense get it.
        needs = {
            "keep_dtypes": ["--dtype", "bf16"],
            "allow_overflow": ["--dtype", "bf16"],
            "scheduler": ["--executor", "dask"],
            "part": ["--max-shard-size", "1GB"],
        }
        for sample in _sample_arguments(param):
            arguments = [*sample, *needs.get(param.name or "", [])]
            if command == "convert":  # a folder DST suits every --to and --max-shard-size
                where = [str(source / "model.pt"), str(tmp_path / "out") + "/"]
            else:
                where = [str(source), str(tmp_path / "out")] if param.name != "report" else [str(source)]
            code, _, stderr = run(command, *where, "--dry-run", *arguments)
            assert code != 2, (command, arguments, stderr)


def test_the_cli_builds_the_options_convert_receives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[ConversionOptions] = []

    def fake_convert(source: str, destination: str, *, options: ConversionOptions, **_: Any) -> Any:
        seen.append(options)
        raise ckptconv.CkptconvError("stop here")

    monkeypatch.setattr("ckptconv.conversion.convert", fake_convert)
    code, _, _ = run(
        "strip-module", "in.pt", "out.pt", "--select", "ema", "--no-fsync", "--no-source-hash", "--dtype", "fp16"
    )
    assert code == 1
    (options,) = seen
    assert (options.select, options.fsync, options.source_hash, options.overwrite) == ("ema", False, False, False)
    assert options.transforms.describe() == ["strip prefix 'module.'", "cast floating-point tensors to float16"]


def test_options_object_and_keywords_give_the_same_output(tmp_path: Path) -> None:
    state = tiny_state_dict()
    ckptconv.save({f"module.{k}": v for k, v in state.items()}, tmp_path / "in.safetensors")
    options = ConversionOptions(transforms=[ckptconv.StripPrefix("module")], to="pt", fsync=False)
    assert isinstance(options.transforms, ckptconv.Pipeline)
    a = ckptconv.convert(tmp_path / "in.safetensors", tmp_path / "a.bin", options=options)
    b = ckptconv.convert(
        tmp_path / "in.safetensors", tmp_path / "b.bin", transforms=[ckptconv.StripPrefix("module")], to="pt"
    )
    assert (a.format, b.format) == ("pt", "pt")
    assert_same_state(torch.load(tmp_path / "a.bin", weights_only=True), state, ordered=False)
    assert_same_state(torch.load(tmp_path / "b.bin", weights_only=True), state, ordered=False)
    # Keywords change a copy of the object; the object itself is frozen.
    with pytest.raises(ckptconv.OutputExistsError):
        ckptconv.convert(tmp_path / "in.safetensors", tmp_path / "a.bin", options=options)
    ckptconv.convert(tmp_path / "in.safetensors", tmp_path / "a.bin", options=options, overwrite=True)
    assert options.overwrite is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.overwrite = True  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"^convert\(\) got an unexpected keyword argument 'overwite'$"):
        ckptconv.convert(tmp_path / "in.safetensors", tmp_path / "c.pt", overwite=True)


def test_options_travel_to_workers_whole() -> None:
    options = ConversionOptions(select="ema", transforms=[ckptconv.Cast("bf16", keep=("norm",))], verify=True)
    assert pickle.loads(pickle.dumps(options)) == options


def test_the_resume_fingerprint_is_unchanged_for_existing_manifests() -> None:
    """Manifests written before the options object must still resume: same fields, same names."""
    from ckptconv.batching.flow import _fingerprint

    options = ConversionOptions(to="safetensors")
    assert options.fingerprint() == {
        "select": None,
        "transforms": [],
        "format": "safetensors",
        "trust": False,
        "keep_meta": False,
        "source_hash": True,
    }
    # The value recorded before the options object, for a plain `ckptconv batch SRC DST`.
    assert _fingerprint(options) == "95a9dc7a12bce13c"


def test_every_field_is_documented() -> None:
    doc = inspect.getdoc(ConversionOptions) or ""  # indentation as written: Python 3.13 dedents __doc__
    for option in dataclasses.fields(ConversionOptions):
        assert f"\n    {option.name}: " in doc, option.name


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_no_provenance_records_nothing_about_the_source(suffix: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    state = tiny_state_dict()
    for name in ("run-a.pt", "other-name.pt"):
        torch.save(state, tmp_path / name)
    outputs = []
    for name, folder in (("run-a.pt", "a"), ("other-name.pt", "b"), ("run-a.pt", "c")):
        (tmp_path / folder).mkdir()
        flag = ["--no-provenance"] if folder != "c" else []
        code, _, stderr = run("convert", str(tmp_path / name), str(tmp_path / folder / f"model{suffix}"), "-q", *flag)
        assert code == 0, stderr
        outputs.append((tmp_path / folder / f"model{suffix}").read_bytes())
    written = tmp_path / "a" / f"model{suffix}"
    if suffix == ".safetensors":
        assert outputs[0] == outputs[1]
        assert outputs[0] != outputs[2]  # by default the source's name and sha256 are recorded
        assert_same_state(load_file(written), state, ordered=False)
        assert b"ckptconv.source" not in outputs[0] and b"ckptconv.source" in outputs[2]
    else:  # .pt files carry torch's random serialization id: no provenance record, same weights
        assert_same_state(torch.load(written, weights_only=True), state, ordered=False)
        assert ckptconv.open(written).metadata == {}
        assert "ckptconv.source" in ckptconv.open(tmp_path / "c" / "model.pt").metadata


def test_a_new_option_at_its_default_leaves_the_resume_fingerprint_alone() -> None:
    from ckptconv.batching.flow import _fingerprint

    assert _fingerprint(ConversionOptions(to="safetensors", provenance=True)) == "95a9dc7a12bce13c"
    assert ConversionOptions(to="safetensors", provenance=False).fingerprint()["provenance"] is False
