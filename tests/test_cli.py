"""The command line: every command works end to end, help and README cover every command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import ckptconv
from ckptconv.cli import cli

from .conftest import FIXTURES, assert_same_state, tiny_state_dict, training_checkpoint
from .conftest import run_cli as run

README = Path(__file__).resolve().parent.parent / "README.md"


def test_strip_module_then_add_module_round_trips(tmp_path: Path) -> None:
    source = FIXTURES / "gpu" / "dataparallel_state_dict.pkl"
    stripped = tmp_path / "model.pt"
    code, stdout, stderr = run("strip-module", str(source), str(stripped))
    assert code == 0 and stdout == ""
    assert "note: tensors were saved on cuda:0; the output is loadable on the CPU" in stderr
    assert "strip prefix 'module.': 9 changed, 0 unchanged" in stderr
    assert f"wrote {stripped}" in stderr
    plain = torch.load(stripped, weights_only=True)
    assert not any(key.startswith("module.") for key in plain)

    wrapped = tmp_path / "dp_model.pt"
    assert run("add-module", str(stripped), str(wrapped), "-q") == (0, "", "")
    reference = torch.load(source, map_location="cpu", weights_only=False)
    assert_same_state(torch.load(wrapped, weights_only=True), reference)


def test_convert_training_checkpoint_to_safetensors(tmp_path: Path) -> None:
    source = tmp_path / "train_ckpt.pth"
    checkpoint = training_checkpoint()
    torch.save(checkpoint, source)
    output = tmp_path / "weights.safetensors"
    code, _, stderr = run("convert", str(source), str(output), "--verify")
    assert code == 0
    assert "note: using the weights under 'state_dict'; also found 'state_dict_ema (EMA)'" in stderr
    assert "verified bit for bit" in stderr
    assert_same_state(ckptconv.load(output), checkpoint["state_dict"], ordered=False)


def test_convert_safetensors_back_to_pt(tmp_path: Path) -> None:
    state = tiny_state_dict()
    ckptconv.save(state, tmp_path / "model.safetensors")
    code, _, _ = run("convert", str(tmp_path / "model.safetensors"), str(tmp_path / "model.pt"), "-q")
    assert code == 0
    assert_same_state(torch.load(tmp_path / "model.pt", weights_only=True), state, ordered=False)


def test_strip_module_strips_module_under_torch_compile_and_points_to_canonical(tmp_path: Path) -> None:
    # torch.compile over DataParallel: '_orig_mod.module.' keys. Before (issue 40): an unchanged copy, exit 0.
    source = FIXTURES / "gpu" / "compiled_over_dataparallel.pt"
    code, _, stderr = run("strip-module", str(source), str(tmp_path / "out.pt"))
    assert code == 0
    assert stderr.splitlines()[0] == (
        "note: every key still starts with '_orig_mod.' (torch.compile); pass --canonical to remove every wrapper "
        "prefix"
    )
    keys = set(torch.load(tmp_path / "out.pt", weights_only=True))
    before = torch.load(source, weights_only=True, map_location="cpu")
    assert keys == {key.replace("_orig_mod.module.", "_orig_mod.") for key in before}


def test_strip_module_reports_keys_without_the_prefix(tmp_path: Path) -> None:
    torch.save({"_orig_mod.conv.weight": torch.ones(2)}, tmp_path / "compiled.pt")
    code, _, stderr = run("strip-module", str(tmp_path / "compiled.pt"), str(tmp_path / "out.pt"))
    assert code == 0
    assert "note: no key starts with 'module.', so none was renamed; keys start with '_orig_mod.'" in stderr
    assert (
        "note: every key starts with '_orig_mod.' (torch.compile); pass --strip-prefix _orig_mod or --canonical to "
        "remove it\n"
    ) in stderr


def test_dry_run_prints_renames_and_writes_nothing(tmp_path: Path) -> None:
    source = FIXTURES / "gpu" / "ddp_rank0.pt"
    code, stdout, stderr = run("strip-module", str(source), str(tmp_path / "out.pt"), "--dry-run")
    assert code == 0
    assert stdout.splitlines()[0] == "module.conv.weight -> conv.weight"
    assert "nothing was written" in stderr
    assert list(tmp_path.iterdir()) == []


def test_transform_options_apply_in_the_documented_order(tmp_path: Path) -> None:
    source = FIXTURES / "gpu" / "lightning.ckpt"
    output = tmp_path / "out.safetensors"
    code, _, stderr = run(
        "convert",
        str(source),
        str(output),
        "--strip-prefix",
        "model",
        "--rename",
        r"^bn\.=norm.",
        "--add-prefix",
        "backbone",
        "--drop",
        "num_batches_tracked",
        "--dtype",
        "bf16",
        "--keep-dtype",
        "norm",
    )
    assert code == 0, stderr
    weights = ckptconv.open(output).select().weights
    assert "backbone.norm.running_mean" in weights
    assert not any("num_batches_tracked" in key for key in weights)
    assert weights["backbone.conv.weight"].dtype.name == "bfloat16"
    assert weights["backbone.norm.weight"].dtype.name == "float32"


def test_inspect_human_and_json(tmp_path: Path) -> None:
    source = FIXTURES / "gpu" / "train_checkpoint.pth"
    code, stdout, _ = run("inspect", str(source))
    assert code == 0
    assert "torch-zip" in stdout and "saved on cpu, cuda:0" in stdout
    assert "argparse.Namespace (1 object)" in stdout
    assert "weights: 'model': 9 tensors" in stdout
    assert re.search(r"conv\.weight\s+float32\s+\[8, 3, 3, 3\]", stdout)

    code, stdout, _ = run("inspect", str(source), "--json")
    info = json.loads(stdout)
    assert info["selected"] == "model"
    assert info["saved_devices"] == ["cpu", "cuda:0"]
    assert "argparse.Namespace" in info["foreign_globals"]
    assert {t["key"] for t in info["tensors"]} == set(ckptconv.open(source).select().weights)
    assert info["total_tensors"] > len(info["tensors"])  # optimizer state is counted too


def test_inspect_reports_ambiguity_without_failing(tmp_path: Path) -> None:
    source = tmp_path / "gan.pt"
    torch.save({"G": tiny_state_dict(0), "D": tiny_state_dict(1)}, source)
    code, stdout, _ = run("inspect", str(source))
    assert code == 0
    assert "weights: not selected:" in stdout and "pick one with --select" in stdout


def test_version_and_module_entry_point() -> None:
    assert run("--version")[1].strip() == f"ckptconv, version {ckptconv.__version__}"
    result = subprocess.run([sys.executable, "-m", "ckptconv", "--help"], capture_output=True, text=True, check=True)
    assert "Open any PyTorch checkpoint safely" in result.stdout


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys; from ckptconv.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env={**os.environ})


def test_a_run_switches_the_gil_more_often_and_gives_the_interval_back() -> None:
    """The cast threads wait less for the GIL (ckptconv.cli.main); a caller of main() gets its own
    interval back afterwards, after a failure too."""
    code = (
        "import sys, ckptconv.cli as c, ckptconv.runtime.cores as cores\n"
        "seen = []\n"
        "c.cli.main = lambda **kwargs: seen.append(sys.getswitchinterval()) or sys.exit(3)\n"
        "sys.setswitchinterval(0.002)\n"
        "try:\n    c.main(['inspect', 'x'])\nexcept SystemExit as exit:\n    assert exit.code == 3\n"
        "assert len(seen) == 1 and abs(seen[0] - cores.SWITCH_INTERVAL_S) < 1e-9, seen\n"
        "assert abs(sys.getswitchinterval() - 0.002) < 1e-9, sys.getswitchinterval()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


COMMANDS = sorted(cli.commands)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example(command: str) -> None:
    code, stdout, _ = run(command, "--help")
    assert code == 0
    assert cli.commands[command].get_short_help_str()
    assert "Example:" in stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_is_in_the_readme(command: str) -> None:
    assert f"ckptconv {command}" in README.read_text()


def test_readme_lists_the_exit_codes() -> None:
    text = README.read_text()
    for code in ("0", "1", "2", "3"):
        assert re.search(rf"^\|\s*`?{code}`?\s*\|", text, re.M), code


def test_filters_that_leave_no_tensor_are_refused_and_counts_are_true(tmp_path: Path) -> None:
    """`convert --keep nomatch` wrote a file of 0 tensors, exited 0 and reported '3 changed'."""
    source = tmp_path / "m.pt"
    torch.save({"enc.w": torch.ones(2), "dec.w": torch.zeros(3), "head.b": torch.arange(4)}, source)
    for args, step, given in (
        (["--keep", "nomatch"], "keep keys matching 'nomatch'", "the 3 it was given (e.g. 'enc.w', 'dec.w', 'head.b')"),
        (["--keep", "^enc", "--drop", "w$"], "drop keys matching 'w$'", "the 1 it was given (e.g. 'enc.w')"),
        (["--drop", "."], "drop keys matching '.'", "the 3 it was given (e.g. 'enc.w', 'dec.w', 'head.b')"),
    ):
        code, stdout, stderr = run("convert", str(source), str(tmp_path / "out.safetensors"), *args)
        assert (code, stdout) == (1, "")
        assert stderr == (
            f"ckptconv: error: {step} leaves no tensor of {given}; nothing was written: check the pattern, "
            "which is searched in the key names after any renaming\n"
        )
        assert sorted(path.name for path in tmp_path.iterdir()) == ["m.pt"]

    output = tmp_path / "two.safetensors"
    code, _, stderr = run("convert", str(source), str(output), "--keep", "^enc", "--keep", "^head")
    assert code == 0
    assert "keep keys matching '^enc' or '^head': 1 dropped, 2 unchanged" in stderr
    assert "wrote " in stderr and "(safetensors, 2 tensors" in stderr
    with safe_open(output, framework="pt") as handle:
        assert sorted(handle.keys()) == ["enc.w", "head.b"]
        assert handle.get_tensor("head.b").numpy().tobytes() == torch.arange(4).numpy().tobytes()
