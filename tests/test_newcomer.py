"""What a new user trips over (issue 14): each case as a user meets it, through the CLI or the public API."""

from __future__ import annotations

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
        [sys.executable, *args], input=code, capture_output=True, text=True, cwd=cwd, env=env, timeout=300, check=False
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
        f"a batch worker process could not start ({broken} -m ckptconv._worker, exit status 1: "
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
    assert stderr.splitlines()[0].endswith(" convert [OPTIONS] SRC DST")
    assert stderr.splitlines()[-1] == f"Error: {message}"
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
    assert stderr.splitlines()[-1] == (
        f"Error: cannot resume: 4 items in {str(out)!r} were converted with other options "
        "(transforms: cast floating-point tensors to bfloat16 then, none now); resume with the same options, "
        "choose another output folder, or pass --overwrite to convert them again with these options"
    )
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before  # nothing touched
    # The same options carry on; --overwrite converts again with the new ones.
    code, _, stderr = run_cli("batch", str(zoo), str(out), "--dtype", "bf16", "--resume")
    assert code == 0 and "converted 0, skipped 4, failed 0 of 4 items" in stderr
    code, _, stderr = run_cli("batch", str(zoo), str(out), "--resume", "--overwrite")
    assert code == 0 and "converted 4, skipped 0, failed 0 of 4 items" in stderr
    assert_same_tensor(load_file(out / "m1.safetensors")["module.w"], torch.load(zoo / "m1.pt")["module.w"])


def test_resume_names_every_option_that_differs(tmp_path: Path) -> None:
    zoo, out = _zoo(tmp_path), tmp_path / "out"
    ckptconv.batch(zoo, out, to="pt", transforms=[ckptconv.StripPrefix("module")])
    with pytest.raises(ckptconv.DestinationError) as caught:
        ckptconv.batch(zoo, out, to="pt", resume=True, keep_meta=True)
    assert "(transforms: strip prefix 'module.' then, none now; --keep-meta: no then, yes now)" in str(caught.value)


def test_running_a_batch_again_points_to_resume(tmp_path: Path) -> None:
    zoo, out = _zoo(tmp_path, 2), tmp_path / "out"
    assert run_cli("batch", str(zoo), str(out), "-q")[0] == 0
    code, _, stderr = run_cli("batch", str(zoo), str(out))
    assert code == 3
    assert (
        "failed: m0.pt: 'm0.safetensors' already exists in the output folder; pass --resume to skip what an "
        "earlier batch converted, or --overwrite to convert it again"
    ) in stderr.splitlines()


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
