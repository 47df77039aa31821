"""What a new user trips over (issue 14): each case as a user meets it, through the CLI or the public API."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptconv

from .conftest import assert_same_tensor, run_cli

ROOT = Path(__file__).resolve().parent.parent


def _zoo(root: Path, count: int = 4) -> Path:
    zoo = root / "zoo"
    zoo.mkdir()
    for index in range(count):
        torch.manual_seed(index)
        torch.save({"module.w": torch.randn(3, 4), "module.steps": torch.arange(index + 1)}, zoo / f"m{index}.pt")
    return zoo


def _python(code: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, *args], check=False, input=code, capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


# ---------------------------------------------------------------------------------------
# 1. batch() from a plain script, without `if __name__ == "__main__":`
# ---------------------------------------------------------------------------------------

SCRIPT = """\
import ckptconv
print("the script body ran")
report = ckptconv.batch("zoo", "out", transforms=[ckptconv.Cast("bf16")], jobs=2, resume=True)
print(report.exit_code, len(report.converted), [(r.source, r.error) for r in report.failed])
"""


@pytest.mark.parametrize("how", ["script", "-c", "stdin"])
def test_batch_with_workers_from_an_unguarded_script(tmp_path: Path, how: str) -> None:
    zoo = _zoo(tmp_path)
    if how == "script":  # python convert_zoo.py
        (tmp_path / "convert_zoo.py").write_text(SCRIPT)
        result = _python("", tmp_path, "convert_zoo.py")
    elif how == "-c":  # no __main__ file at all, as in a notebook cell
        result = _python("", tmp_path, "-c", SCRIPT)
    else:
        result = _python(SCRIPT, tmp_path, "-")
    assert result.returncode == 0, result.stderr
    # The body ran once: workers never import the caller's main module.
    assert result.stdout == "the script body ran\n0 4 []\n", result.stderr
    assert "Traceback" not in result.stderr
    for index in range(4):
        written = load_file(tmp_path / "out" / f"m{index}.safetensors")
        source = torch.load(zoo / f"m{index}.pt", weights_only=True)
        assert_same_tensor(written["module.w"], source["module.w"].bfloat16(), "w")
        assert_same_tensor(written["module.steps"], source["module.steps"], "steps")


def test_batch_on_a_local_dask_cluster_from_an_unguarded_script(tmp_path: Path) -> None:
    pytest.importorskip("distributed")
    zoo = _zoo(tmp_path, 2)
    (tmp_path / "dask_zoo.py").write_text(SCRIPT.replace("jobs=2, resume=True", 'jobs=2, executor="dask"'))
    result = _python("", tmp_path, "dask_zoo.py")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "the script body ran\n0 2 []\n", result.stderr
    for index in range(2):
        written = load_file(tmp_path / "out" / f"m{index}.safetensors")
        assert_same_tensor(written["module.w"], torch.load(zoo / f"m{index}.pt")["module.w"].bfloat16(), "w")


def test_a_transform_defined_in_the_script_is_refused_with_the_way_out(tmp_path: Path) -> None:
    _zoo(tmp_path)
    script = textwrap.dedent(
        """\
        import ckptconv

        class Upper:
            def apply(self, state):
                return {key.upper(): value for key, value in state.items()}

            def describe(self):
                return "upper-case keys"

        try:
            ckptconv.batch("zoo", "out", transforms=[Upper()], jobs=2)
        except ckptconv.TransformError as error:
            print(error)
        """
    )
    (tmp_path / "up.py").write_text(script)
    result = _python("", tmp_path, "up.py")
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "Upper is defined in the script being run (__main__), which worker processes do not import; "
        "move it into a module the script imports, or convert with jobs=1\n"
    )
    assert not (tmp_path / "out").exists()


def test_a_worker_that_cannot_start_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    zoo = _zoo(tmp_path)
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named numpy' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(broken))
    with pytest.raises(ckptconv.CkptconvError) as caught:
        ckptconv.batch(zoo, tmp_path / "out", jobs=2)
    assert str(caught.value) == (
        f"a batch worker process could not start ({broken}: exit status 1: "
        "ModuleNotFoundError: No module named numpy); convert with jobs=1, or fix the environment"
    )


# ---------------------------------------------------------------------------------------
# 4. Contradictory destinations are usage errors that say what to write instead
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dst", "options", "message"),
    [
        (
            "o.safetensors",
            ["--to", "pt"],
            "'o.safetensors' is named as a safetensors file but --to pt writes a torch file; "
            "write 'o.pt' instead, or leave out --to",
        ),
        (
            "o.pth",
            ["--to", "safetensors"],
            "'o.pth' is named as a torch file but --to safetensors writes a safetensors file; "
            "write 'o.safetensors' instead, or leave out --to",
        ),
        (
            "m5.safetensors",
            ["--max-shard-size", "5GB"],
            "'m5.safetensors' is named like a file, but --max-shard-size writes a folder of shards and an index; "
            "write 'm5/' instead, or leave out --max-shard-size to write the one file 'm5.safetensors'",
        ),
        (
            "m5.pt",
            ["--to", "dcp"],
            "'m5.pt' is named like a file, but --to dcp writes a folder; "
            "write 'm5/' instead, or leave out --to dcp to write the one file 'm5.pt'",
        ),
    ],
)
def test_contradictory_destinations_are_usage_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dst: str, options: list[str], message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.ones(2)}, "model.pt")
    code, _, stderr = run_cli("convert", "model.pt", dst, *options)
    assert code == 2
    assert stderr == f"ckptconv: error: {message}; see 'cli convert --help'\n"  # (CliRunner's program: cli)
    assert sorted(os.listdir(tmp_path)) == ["model.pt"]
    with pytest.raises(ckptconv.DestinationError, match="instead"):
        ckptconv.convert(
            "model.pt",
            dst,
            to=options[1] if options[0] == "--to" else None,
            max_shard_size=(5 * 10**9 if options[0] == "--max-shard-size" else None),
        )
    assert sorted(os.listdir(tmp_path)) == ["model.pt"]


@pytest.mark.parametrize(
    ("dst", "options"), [("o.bin", ["--to", "pt"]), ("o", ["--to", "pt"]), ("m5/", ["--max-shard-size", "5GB"])]
)
def test_destinations_that_agree_with_the_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dst: str, options: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.arange(4.0)}, "model.pt")
    code, _, stderr = run_cli("convert", "model.pt", dst, *options)
    assert code == 0, stderr
    if dst.endswith("/"):  # one shard suffices: the folder holds model.safetensors
        assert_same_tensor(load_file(Path(dst) / "model.safetensors")["w"], torch.arange(4.0))
    else:
        assert_same_tensor(torch.load(dst, weights_only=True)["w"], torch.arange(4.0))


# ---------------------------------------------------------------------------------------
# 2. batch --resume with other options stops and says which differ; 9. re-running, empty batches
# ---------------------------------------------------------------------------------------


def test_resume_with_other_options_stops_and_says_which(tmp_path: Path) -> None:
    zoo, out = _zoo(tmp_path), tmp_path / "out"
    code, _, stderr = run_cli("batch", str(zoo), str(out), "--dtype", "bf16", "-q")
    assert code == 0, stderr
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    # The README's second example after its first: no --dtype.
    code, _, stderr = run_cli("batch", str(zoo), str(out), "--glob", "**/*.pt", "--resume")
    assert code == 2
    assert stderr == (
        f"ckptconv: error: cannot resume: 4 items in {str(out)!r} were converted with other options "
        "(recorded → now):\n"
        "  transforms: cast floating-point tensors to bfloat16 → none\n"
        "resume with the same options, choose another output folder, or pass --overwrite to convert them again "
        "with these options; see 'cli batch --help'\n"
    )
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before  # nothing touched
    # The same options carry on; --overwrite converts again with the new ones.
    code, _, stderr = run_cli("batch", str(zoo), str(out), "--dtype", "bf16", "--resume")
    assert code == 0 and "converted 0 of 4 items; 4 skipped" in stderr
    code, _, stderr = run_cli("batch", str(zoo), str(out), "--resume", "--overwrite")
    assert code == 0 and "converted 4 of 4 items (" in stderr
    assert_same_tensor(load_file(out / "m1.safetensors")["module.w"], torch.load(zoo / "m1.pt")["module.w"])


def test_resume_names_every_option_that_differs(tmp_path: Path) -> None:
    zoo, out = _zoo(tmp_path), tmp_path / "out"
    ckptconv.batch(zoo, out, to="pt", transforms=[ckptconv.StripPrefix("module")])
    with pytest.raises(ckptconv.DestinationError) as caught:
        ckptconv.batch(zoo, out, to="pt", resume=True, keep_meta=True)
    assert "\n  transforms: strip prefix 'module.' → none\n  --keep-meta: no → yes\n" in str(caught.value)


def test_running_a_batch_again_points_to_resume(tmp_path: Path) -> None:
    zoo, out = _zoo(tmp_path, 2), tmp_path / "out"
    assert run_cli("batch", str(zoo), str(out), "-q")[0] == 0
    manifest = (out / "ckptconv-manifest.jsonl").read_bytes()
    code, _, stderr = run_cli("batch", str(zoo), str(out))
    assert code == 2
    assert stderr == (
        f"ckptconv: error: the outputs of all 2 items exist already in {str(out)!r} (a batch ran there before); "
        "pass --resume to skip what it converted, or --overwrite to convert them again; see 'cli batch --help'\n"
    )
    assert (out / "ckptconv-manifest.jsonl").read_bytes() == manifest  # nothing recorded as failed


def test_a_batch_that_matches_nothing_creates_nothing(tmp_path: Path) -> None:
    zoo, out = _zoo(tmp_path, 1), tmp_path / "out"
    code, _, stderr = run_cli("batch", str(zoo), str(out), "--glob", "**/*.pth")
    assert code == 0
    assert stderr == f"found no checkpoints under {str(zoo)!r} matching --glob\n"
    assert not out.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    report = ckptconv.batch(empty, out)
    assert report.results == () and not out.exists()


# ---------------------------------------------------------------------------------------
# 3. Tied weights: the Hugging Face convention by default, --tied copy for plain load_state_dict
# ---------------------------------------------------------------------------------------


class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2 and most language models


def test_tied_weights_default_note_says_how_to_load_and_copy_loads_strictly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_model

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    torch.save(TiedLM().state_dict(), "tied.pt")
    source = torch.load("tied.pt", weights_only=True)

    code, _, stderr = run_cli("convert", "tied.pt", "hf.safetensors")
    assert code == 0, stderr
    path = str(tmp_path / "hf.safetensors")
    assert stderr.splitlines()[0] == (
        "note: 1 tied tensor is stored once, as Hugging Face does (head.weight = embed.weight); load with "
        f"safetensors.torch.load_model(model, {path!r}) or ckptconv.load({path!r}), which restore them; "
        "plain model.load_state_dict(safetensors.torch.load_file(...), strict=True) needs --tied copy"
    )
    assert sorted(load_file("hf.safetensors")) == ["embed.weight", "norm.bias", "norm.weight"]
    # What the note says works, strictly, and gives the source's values.
    model = TiedLM()
    assert load_model(model, "hf.safetensors", strict=True) == (set(), [])
    for key, value in model.state_dict().items():
        assert_same_tensor(value, source[key], key)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "head.weight"'):
        TiedLM().load_state_dict(load_file("hf.safetensors"), strict=True)

    code, _, stderr = run_cli("convert", "tied.pt", "plain.safetensors", "--tied", "copy")
    assert code == 0 and "note:" not in stderr, stderr
    written = load_file("plain.safetensors")
    assert sorted(written) == sorted(source)
    model = TiedLM()
    model.load_state_dict(written, strict=True)
    for key, value in model.state_dict().items():
        assert_same_tensor(value, source[key], key)
    assert model.head.weight is model.embed.weight  # the model's own tie survives the load


def test_tied_copy_in_batch_and_save(tmp_path: Path) -> None:
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    torch.manual_seed(1)
    state = TiedLM().state_dict()
    torch.save(state, zoo / "lm.pt")
    report = ckptconv.batch(zoo, tmp_path / "out", tied="copy")
    assert report.exit_code == 0
    TiedLM().load_state_dict(load_file(tmp_path / "out" / "lm.safetensors"), strict=True)
    ckptconv.save(state, tmp_path / "saved.safetensors", tied="copy")
    assert sorted(load_file(tmp_path / "saved.safetensors")) == sorted(state)
    with pytest.raises(ValueError, match="tied must be one of dedupe, copy, not 'twice'"):
        ckptconv.save(state, tmp_path / "x.safetensors", tied="twice")


# ---------------------------------------------------------------------------------------
# 5. fit --like mymodels:build_model finds ./mymodels.py, as python -m would
# ---------------------------------------------------------------------------------------

MYMODELS = """\
import torch


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
"""


def test_fit_like_a_factory_in_the_current_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mymodels.py").write_text(MYMODELS)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    torch.save({"state_dict": {f"model.module.{k}": v for k, v in model.state_dict().items()}}, tmp_path / "l.ckpt")
    # As the console script runs: sys.path[0] is the script's own folder, not the current one.
    launcher = tmp_path / "bin" / "ckptconv"
    launcher.parent.mkdir()
    launcher.write_text("import sys\nfrom ckptconv.cli import main\nsys.exit(main())\n")
    result = _python("", tmp_path, str(launcher), "fit", "l.ckpt", "m.safetensors", "--like", "mymodels:build_model")
    assert result.returncode == 0, result.stderr
    written = load_file(tmp_path / "m.safetensors")
    for key, value in model.state_dict().items():
        assert_same_tensor(written[key], value, key)

    monkeypatch.chdir(tmp_path)
    code, stdout, _ = run_cli("fit", "--help")
    assert "found as python -m would: the current folder first" in " ".join(stdout.split())
    (tmp_path / "mymodels.py").unlink()
    code, _, stderr = run_cli("fit", "l.ckpt", "n.safetensors", "--like", "nomodels:build_model")
    assert code == 1
    assert stderr == (
        "ckptconv: error: could not build the reference from 'nomodels:build_model': ModuleNotFoundError: "
        f"No module named 'nomodels' (looked in the current folder {str(tmp_path)!r} first)\n"
    )


# ---------------------------------------------------------------------------------------
# 7. --dry-run lists renames when --keep/--drop change the count; diff across dtypes
# ---------------------------------------------------------------------------------------


def test_dry_run_lists_renames_when_keep_or_drop_change_the_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save(
        {"module.enc.weight": torch.ones(2), "module.enc.bias": torch.ones(2), "module.head.weight": torch.ones(3)},
        "dp.pt",
    )
    code, stdout, stderr = run_cli(
        "convert", "dp.pt", "o.safetensors", "--strip-prefix", "module", "--drop", "bias$", "--dry-run"
    )
    assert code == 0, stderr
    assert stdout == "module.enc.weight -> enc.weight\nmodule.head.weight -> head.weight\n"
    assert stderr.splitlines()[-1] == "dry run: would write 2 tensors (20 B) as safetensors; nothing was written"
    code, stdout, _ = run_cli(
        "convert", "dp.pt", "o.safetensors", "--keep", "^net\\.head", "--rename", "^module\\.=net.", "--dry-run"
    )
    assert stdout == "module.head.weight -> net.head.weight\n"
    report = ckptconv.convert(
        "dp.pt", "o.safetensors", transforms=[ckptconv.Keep("enc"), ckptconv.StripPrefix("module")], dry_run=True
    )
    assert report.renames == (("module.enc.weight", "enc.weight"), ("module.enc.bias", "enc.bias"))
    assert not (tmp_path / "o.safetensors").exists()


def test_diff_of_fp32_and_its_bf16_cast_reports_the_real_difference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    weight = torch.randn(64, 16)
    torch.save({"w": weight, "steps": torch.arange(3)}, "fp32.pt")
    torch.save({"w": weight.bfloat16(), "steps": torch.arange(3)}, "bf16.pt")
    expected = (weight.double() - weight.bfloat16().double()).abs().max().item()
    assert expected > 0
    result = ckptconv.diff("fp32.pt", "bf16.pt")
    (difference,) = result.differences
    assert (difference.key, difference.reason, difference.a, difference.b) == ("w", "dtype", "float32", "bfloat16")
    assert difference.max_abs_diff == expected
    code, stdout, _ = run_cli("diff", "fp32.pt", "bf16.pt")
    assert code == 3
    assert stdout == (
        f"dtype differs: w: float32 vs bfloat16; max abs difference {expected:g} (compared in float64)\n"
        "different: 1 tensor identical, 1 differ, 0 only in A, 0 only in B\n"
    )
    # A cast that changes nothing (integers widened) reports 0, and still differs in dtype.
    torch.save({"w": weight, "steps": torch.arange(3, dtype=torch.int32)}, "i32.pt")
    (difference,) = ckptconv.diff("fp32.pt", "i32.pt").differences
    assert (difference.reason, difference.max_abs_diff) == ("dtype", 0.0)


@pytest.mark.parametrize(
    ("a", "b", "dtype", "expected"),
    [
        ([2**60], [2**60 + 1], torch.int64, 1),
        ([2**63 - 1, 0], [-(2**63), 0], torch.int64, 2**64 - 1),
        ([2**64 - 1], [2**64 - 2], getattr(torch, "uint64", None), 1),
        ([2**64 - 1], [0], getattr(torch, "uint64", None), 2**64 - 1),
    ],
)
def test_diff_of_64_bit_integers_is_exact(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    a: list[int],
    b: list[int],
    dtype: torch.dtype | None,
    expected: int,
) -> None:
    """float64 rounds 2**60 + 1 to 2**60: the difference must be computed on the integers themselves."""
    if dtype is None:
        pytest.skip("this torch has no uint64")
    monkeypatch.chdir(tmp_path)
    torch.save({"steps": torch.tensor(a, dtype=dtype)}, "a.pt")
    torch.save({"steps": torch.tensor(b, dtype=dtype)}, "b.pt")
    code, stdout, _ = run_cli("diff", "a.pt", "b.pt")
    assert code == 3
    assert stdout.splitlines()[0] == f"values differ: steps: max abs difference {expected}"
    (difference,) = ckptconv.diff("a.pt", "b.pt").differences
    assert difference.max_abs_diff == expected and isinstance(difference.max_abs_diff, int)
    # Across integer dtypes too (int32 against int64), exactly.
    torch.save({"steps": torch.tensor([7], dtype=torch.int32)}, "i32.pt")
    torch.save({"steps": torch.tensor([2**60 + 8], dtype=torch.int64)}, "i64.pt")
    code, stdout, _ = run_cli("diff", "i32.pt", "i64.pt")
    assert stdout.splitlines()[0] == (
        f"dtype differs: steps: int32 vs int64; max abs difference {2**60 + 1} (compared exactly)"
    )


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="torch 2.8 added float4_e2m1fn_x2")
def test_diff_does_not_compare_packed_bits_as_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float4_e2m1fn_x2 byte holds two values: read as one number it would give a made-up difference."""
    monkeypatch.chdir(tmp_path)
    raw = torch.arange(16, dtype=torch.uint8)
    torch.save({"w": raw.view(torch.float8_e8m0fnu)}, "e8m0.pt")
    torch.save({"w": raw.view(torch.float4_e2m1fn_x2)}, "fp4.pt")
    torch.save({"w": (raw + 1).view(torch.float4_e2m1fn_x2)}, "fp4_other.pt")
    (difference,) = ckptconv.diff("e8m0.pt", "fp4.pt").differences
    assert (difference.reason, difference.compared) == ("dtype", False) and math.isnan(difference.max_abs_diff)
    (difference,) = ckptconv.diff("fp4.pt", "fp4_other.pt").differences
    assert (difference.reason, difference.compared) == ("values", False) and math.isnan(difference.max_abs_diff)
    code, stdout, _ = run_cli("diff", "e8m0.pt", "fp4.pt")
    assert code == 3
    assert stdout.splitlines()[0] == (
        "dtype differs: w: float8_e8m0fnu vs float4_e2m1fn_x2; not compared as numbers "
        "(packed, opaque or quantized elements)"
    )
    code, stdout, _ = run_cli("diff", "fp4.pt", "fp4_other.pt")
    assert stdout.splitlines()[0] == "values differ: w: not compared as numbers (packed, opaque or quantized elements)"


# ---------------------------------------------------------------------------------------
# 9. Smaller things
# ---------------------------------------------------------------------------------------


def test_counts_are_spelled_right(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.ones(2)}, "one.pt")
    code, _, stderr = run_cli("convert", "one.pt", "one.safetensors")
    assert code == 0 and stderr.endswith("(safetensors, 1 tensor, 8 B)\n"), stderr
    code, stdout, _ = run_cli("inspect", "one.pt")
    assert "weights: the whole file: 1 tensor, 2 elements" in stdout


def test_torch_tensor_is_not_a_class_from_missing_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    tensor = torch.arange(4.0)
    tensor.note = "a tensor with a Python attribute is saved through torch._tensor._rebuild_from_type_v2"  # type: ignore[attr-defined]
    torch.save({"state_dict": {"w": tensor}, "args": argparse.Namespace(lr=0.1)}, "attr.pt")
    info = ckptconv.inspect("attr.pt")
    assert info.foreign_globals == {"argparse.Namespace": 1}
    report = ckptconv.convert("attr.pt", "attr.safetensors")
    assert (
        "1 class from code that is not here became inert stand-ins (argparse.Namespace); none was run" in report.notes
    )
    assert_same_tensor(load_file("attr.safetensors")["w"], torch.arange(4.0))


def test_inspect_of_training_args_does_not_suggest_inspect(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save(argparse.Namespace(learning_rate=5e-5, output_dir="out"), "training_args.bin")
    code, stdout, _ = run_cli("inspect", "training_args.bin")
    assert code == 0
    assert stdout.splitlines()[-1] == "weights: not selected: 'training_args.bin' holds no state dict or model"
    code, _, stderr = run_cli("convert", "training_args.bin", "x.safetensors")
    assert code == 1
    assert stderr == (
        "ckptconv: error: 'training_args.bin' holds no state dict or model; "
        "run `ckptconv inspect` to see what it contains\n"
    )


# ---------------------------------------------------------------------------------------
# 6. API results that compose, one vocabulary
# ---------------------------------------------------------------------------------------


def _dp_checkpoint(path: Path) -> torch.nn.Module:
    torch.manual_seed(5)
    model = TiedLM()
    torch.save({"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}, "epoch": 3}, path)
    return model


def test_fit_of_lazy_weights_feeds_load_state_dict(tmp_path: Path) -> None:
    source = _dp_checkpoint(tmp_path / "dp.pth")
    ckpt = ckptconv.open(tmp_path / "dp.pth")
    fitted, report = ckptconv.fit(ckpt.select().weights, TiedLM())
    assert report.ok
    model = TiedLM()
    model.load_state_dict(fitted, strict=True)  # lazy references are read as torch copies them
    for key, value in model.state_dict().items():
        assert_same_tensor(value, source.state_dict()[key], key)
    # A lazy tensor is accepted wherever torch takes a tensor.
    assert torch.equal(ckpt.select().weights["module.norm.weight"], source.norm.weight.detach())


def test_canonicalize_and_save_speak_as_the_readme_does(tmp_path: Path) -> None:
    source = _dp_checkpoint(tmp_path / "dp.pth")
    state, report = ckptconv.canonicalize(ckptconv.open(tmp_path / "dp.pth").select().weights)
    assert list(state) == list(source.state_dict()) and report.changed == len(state)
    ckptconv.save(state, tmp_path / "plain.bin", to="pt")
    assert sorted(torch.load(tmp_path / "plain.bin", weights_only=True)) == sorted(source.state_dict())
    with pytest.warns(DeprecationWarning, match=r"save\(format=\.\.\.\) is deprecated; use to=\.\.\."):
        ckptconv.save(state, tmp_path / "old.bin", format="pt")
    assert (tmp_path / "old.bin").read_bytes()[:2] == b"PK"


def test_device_auto_means_the_same_in_load_and_load_into(tmp_path: Path) -> None:
    from ckptconv.gpu.devices import DeviceFallbackWarning

    source = _dp_checkpoint(tmp_path / "dp.pth")
    if torch.cuda.is_available():
        pytest.skip("checks the CPU fallback of device='auto'")
    with pytest.warns(DeviceFallbackWarning):
        loaded = ckptconv.load(tmp_path / "dp.pth", device="auto")
    assert {value.device.type for value in loaded.values()} == {"cpu"}
    model = TiedLM()
    with pytest.warns(DeviceFallbackWarning):  # the same choice, the same warning
        assert ckptconv.load_into(model, tmp_path / "dp.pth", device="auto").ok
    model = TiedLM()
    assert ckptconv.load_into(model, tmp_path / "dp.pth", device="model").ok  # each parameter's own device
    for key, value in model.state_dict().items():
        assert_same_tensor(value, source.state_dict()[key], key)


def test_resume_tells_tied_copy_from_the_default(tmp_path: Path) -> None:
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    torch.save(TiedLM().state_dict(), zoo / "lm.pt")
    out = tmp_path / "out"
    assert ckptconv.batch(zoo, out).exit_code == 0  # the default, as manifests before --tied recorded it
    with pytest.raises(ckptconv.DestinationError, match=r"\n  --tied: dedupe → copy\n"):
        ckptconv.batch(zoo, out, resume=True, tied="copy")
    assert [r.status for r in ckptconv.batch(zoo, out, resume=True).results] == ["skipped"]
