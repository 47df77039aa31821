"""Bad input: one line on stderr, exit code 1 (2 for usage), no traceback, no output, input untouched."""

from __future__ import annotations

import gzip
import hashlib
import os
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

import ckptconv

from .conftest import FIXTURES, tiny_state_dict
from .conftest import run_cli as _run

Maker = Callable[[Path], Path]


def _write(name: str, data: bytes) -> Maker:
    def make(folder: Path) -> Path:
        path = folder / name
        path.write_bytes(data)
        return path

    return make


def _zip_with(name: str, members: dict[str, bytes]) -> Maker:
    def make(folder: Path) -> Path:
        path = folder / name
        with zipfile.ZipFile(path, "w") as archive:
            for member, data in members.items():
                archive.writestr(member, data)
        return path

    return make


def _truncated(style: dict[str, object], keep: float) -> Maker:
    def make(folder: Path) -> Path:
        whole = folder / "whole.pt"
        torch.save(tiny_state_dict(), whole, **style)  # type: ignore[arg-type]
        data = whole.read_bytes()
        whole.unlink()
        path = folder / "truncated.pt"
        path.write_bytes(data[: int(len(data) * keep)])
        return path

    return make


def _truncated_safetensors(folder: Path) -> Path:
    from safetensors.torch import save_file

    whole = folder / "whole.safetensors"
    save_file({"w": torch.randn(100)}, whole)
    data = whole.read_bytes()
    whole.unlink()
    path = folder / "cut.safetensors"
    path.write_bytes(data[:-50])
    return path


def _malicious_zip(folder: Path) -> Path:
    """A valid torch zip whose data.pkl runs os.system when torch.load(weights_only=False) opens it."""
    source = folder / "good.pt"
    torch.save({"w": torch.zeros(2)}, source)
    canary = folder / "canary"
    command = f"touch {canary}".encode()
    payload = b"\x80\x02cos\nsystem\nX" + len(command).to_bytes(4, "little") + command + b"\x85R."
    path = folder / "evil.pt"
    with zipfile.ZipFile(source) as good, zipfile.ZipFile(path, "w") as evil:
        for info in good.infolist():
            data = payload if info.filename.endswith("data.pkl") else good.read(info)
            evil.writestr(info.filename, data)
    source.unlink()
    return path


def _malicious_legacy(folder: Path) -> Path:
    source = folder / "good.pt"
    torch.save({"w": torch.zeros(2)}, source, _use_new_zipfile_serialization=False)
    data = source.read_bytes()
    source.unlink()
    canary = folder / "canary"
    command = f"touch {canary}".encode()
    payload = b"\x80\x02cposix\nsystem\nX" + len(command).to_bytes(4, "little") + command + b"\x85R."
    # Keep the three header pickles, replace the object pickle.
    header_end = 0
    for _ in range(3):
        header_end = data.index(b".", header_end + 1)
    path = folder / "evil_legacy.pt"
    path.write_bytes(data[: header_end + 1] + payload)
    return path


BAD_INPUTS: dict[str, tuple[Maker, str]] = {
    "empty": (_write("empty.pt", b""), "is empty (0 bytes); the download or save did not finish"),
    "one byte": (_write("placeholder.pt", b"\n"), "is only 1 byte long: a placeholder, not a checkpoint"),
    "random bytes": (
        _write(
            "random.pt",
            bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)).replace(b"\x80", b"\x81", 1),
        ),
        "is not a checkpoint format ckptconv knows",
    ),
    "git lfs pointer": (
        _write("lfs.pt", b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n"),
        "is a Git LFS pointer, not the checkpoint itself; run `git lfs pull` to fetch it",
    ),
    "html page": (_write("page.pt", b"<!DOCTYPE html><html><body>Not found</body></html>"), "is an HTML/XML page"),
    "gzip": (_write("model.pt.gz", gzip.compress(b"x" * 100)), "is gzip-compressed; decompress it first"),
    "numpy npz": (_zip_with("arrays.npz", {"a.npy": b"\x93NUMPY"}), "is a numpy .npz archive"),
    "zip without data.pkl": (
        _zip_with("other.zip", {"hello.txt": b"hi"}),
        "is a zip archive but not a PyTorch checkpoint",
    ),
    "torchscript": (lambda folder: FIXTURES / "gpu" / "torchscript_model.pt", "is a TorchScript archive"),
    "truncated zip": (_truncated({}, 0.6), "damaged zip checkpoint"),
    "truncated legacy": (_truncated({"_use_new_zipfile_serialization": False}, 0.8), "is truncated"),
    "truncated safetensors": (_truncated_safetensors, "is truncated"),
    "malicious zip": (
        _malicious_zip,
        "calls os.system (runs processes) at pickle byte 2; refusing a checkpoint built to attack",
    ),
    "malicious legacy": (_malicious_legacy, "calls posix.system (runs processes) at pickle byte"),
    "folder": (lambda folder: folder, "is a folder but neither a sharded checkpoint (*.index.json) nor a DCP"),
    "missing": (lambda folder: folder / "missing.pt", "does not exist; check the path"),
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


@pytest.mark.parametrize("command", ["convert", "strip-module", "inspect"])
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gets_one_clear_line(case: str, command: str, tmp_path: Path) -> None:
    make, expected = BAD_INPUTS[case]
    source = make(tmp_path)
    before = _sha256(source)
    output = tmp_path / "out" / "result.pt"
    output.parent.mkdir()
    args = [command, str(source)] + ([] if command == "inspect" else [str(output)])
    code, stdout, stderr = _run(*args)
    assert code == 1, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("ckptconv: error: "), stderr
    assert expected in stderr
    assert "Traceback" not in stderr + stdout
    assert list(output.parent.iterdir()) == []
    assert _sha256(source) == before
    assert not (tmp_path / "canary").exists()


def test_the_exact_message_for_a_missing_file(tmp_path: Path) -> None:
    os.chdir(tmp_path)
    code, _, stderr = _run("convert", "missing.pt", "out.pt")
    assert (code, stderr) == (1, "ckptconv: error: 'missing.pt' does not exist; check the path\n")


@pytest.fixture
def good_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "good.pt"
    torch.save({"module.w": torch.randn(3), "module.b": torch.zeros(2)}, path)
    return path


def test_existing_output_is_refused_without_overwrite(good_checkpoint: Path, tmp_path: Path) -> None:
    output = tmp_path / "exists.pt"
    output.write_bytes(b"precious")
    code, _, stderr = _run("convert", str(good_checkpoint), str(output))
    assert code == 2  # a usage error, as the README's table says (it exited 1)
    assert stderr == f"ckptconv: error: {str(output)!r} already exists; pass --overwrite to replace it\n"
    assert output.read_bytes() == b"precious"
    assert _run("convert", str(good_checkpoint), str(output), "--overwrite", "-q") == (0, "", "")
    assert output.read_bytes() != b"precious"


def test_writing_onto_the_input_is_refused(good_checkpoint: Path) -> None:
    before = _sha256(good_checkpoint)
    code, _, stderr = _run("convert", str(good_checkpoint), str(good_checkpoint), "--overwrite")
    assert code == 1
    assert "onto its own input" in stderr
    assert _sha256(good_checkpoint) == before


def test_missing_output_folder_is_created(good_checkpoint: Path, tmp_path: Path) -> None:
    """It was "folder ... does not exist; create it first"; now made as save_pretrained makes it (issue 34)."""
    code, _, stderr = _run("convert", str(good_checkpoint), str(tmp_path / "nope" / "out.pt"), "-q")
    assert (code, stderr) == (0, "")
    written = torch.load(tmp_path / "nope" / "out.pt", weights_only=True)
    for key, tensor in torch.load(good_checkpoint, weights_only=True).items():
        assert torch.equal(written[key], tensor), key


def test_unknown_output_suffix(good_checkpoint: Path, tmp_path: Path) -> None:
    code, _, stderr = _run("convert", str(good_checkpoint), str(tmp_path / "out.weights"))
    assert code == 2  # a usage error, as the destination's other contradictions are
    assert "cannot tell the output format" in stderr and "--to" in stderr and ".pth" in stderr and "'/'" in stderr
    assert len(stderr.splitlines()) == 1
    assert _run("convert", str(good_checkpoint), str(tmp_path / "out.weights"), "--to", "pt", "-q")[0] == 0


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", "_dcp"])
def test_cast_overflow_fails_names_the_tensor_and_leaves_nothing(tmp_path: Path, suffix: str) -> None:
    source = tmp_path / "big_values.pt"
    torch.save({"ok": torch.ones(2), "w": torch.tensor([1.0, 70000.0, -1e6])}, source)
    output = tmp_path / f"out{suffix}"
    to = ["--to", "dcp"] if suffix == "_dcp" else []  # the DCP writer did not name the tensor
    code, _, stderr = _run("convert", str(source), str(output), "--dtype", "fp16", *to)
    assert code == 1
    assert stderr.splitlines() == [
        "ckptconv: error: tensor 'w': casting to float16 would turn finite values such as 70000.0 into inf; "
        "keep this tensor's dtype (--keep-dtype) or pass --allow-overflow"
    ]
    assert not output.exists() and list(tmp_path.iterdir()) == [source]
    assert _run("convert", str(source), str(output), "--dtype", "fp16", "--allow-overflow", "-q", *to)[0] == 0


def test_ambiguous_weights_list_the_candidates(tmp_path: Path) -> None:
    source = tmp_path / "gan.pt"
    torch.save({"G": tiny_state_dict(0), "D": tiny_state_dict(1)}, source)
    code, _, stderr = _run("convert", str(source), str(tmp_path / "out.pt"))
    assert code == 1
    assert stderr == (
        f"ckptconv: error: {str(source)!r} holds several sets of weights ('G', 'D'); pick one with --select\n"
    )
    assert _run("convert", str(source), str(tmp_path / "out.pt"), "--select", "D", "-q")[0] == 0


def test_select_names_something_missing(tmp_path: Path) -> None:
    source = tmp_path / "train.pt"
    torch.save({"state_dict": tiny_state_dict(), "epoch": 1}, source)
    code, _, stderr = _run("convert", str(source), str(tmp_path / "out.pt"), "--select", "ema")
    assert code == 1 and "holds no EMA weights" in stderr
    code, _, stderr = _run("convert", str(source), str(tmp_path / "out.pt"), "--select", "model")
    assert code == 1 and "has no 'model'; it has 'state_dict', 'epoch'" in stderr


@pytest.mark.parametrize(
    "option, expected",
    [
        (["--rename", "([=x"], "is not a valid regular expression"),
        (["--rename", "no-equals-sign"], "is not REGEX=REPLACEMENT"),
        (["--rename", r"^a=\2"], "refers to a group"),
        (["--drop", "(("], "is not a valid regular expression"),
        # re raises these two as OverflowError and RecursionError, not re.error: they were tracebacks.
        (["--keep", "a{99999999999}"], "the repetition number is too large"),
        (["--rename", "a{99999999999}=b"], "the repetition number is too large"),
        (["--drop", "(" * 5000 + ")" * 5000], "is nested too deeply"),
        (["--dtype", "fp16", "--keep-dtype", "a{99999999999}"], "the repetition number is too large"),
        (["--dtype", "int8"], "is not a dtype ckptconv can cast to"),
        (["--keep-dtype", "norm"], "--keep-dtype and --allow-overflow need --dtype"),
        (["--strip-prefix", "."], "a prefix must name at least one component"),
        (["--to", "onnx"], "Invalid value for '--to'"),
    ],
)
def test_usage_errors_exit_2(option: list[str], expected: str, good_checkpoint: Path, tmp_path: Path) -> None:
    output = tmp_path / "out.pt"
    code, _, stderr = _run("convert", str(good_checkpoint), str(output), *option)
    assert code == 2
    assert expected in stderr
    assert "Traceback" not in stderr
    assert not output.exists()


@pytest.mark.parametrize("pattern", ["a{99999999999}", "(" * 5000 + ")" * 5000, "(("])
def test_the_library_refuses_bad_patterns_with_a_transform_error(pattern: str, good_checkpoint: Path) -> None:
    selection = ckptconv.open(good_checkpoint).select()
    for transform in (ckptconv.Keep([pattern]), ckptconv.Drop([pattern]), ckptconv.Rename(pattern, "x")):
        with pytest.raises(ckptconv.TransformError, match="is not a valid regular expression") as error:
            transform.apply(selection.weights)
        assert len(str(error.value)) < 300


def test_key_collisions_name_both_keys(tmp_path: Path) -> None:
    source = tmp_path / "both.pt"
    torch.save({"module.w": torch.ones(1), "w": torch.zeros(1)}, source)
    code, _, stderr = _run("strip-module", str(source), str(tmp_path / "out.pt"))
    assert code == 1
    assert stderr == (
        "ckptconv: error: strip prefix 'module.' maps both 'module.w' and 'w' to 'w'; "
        "drop one of them first (--drop) or choose another rule\n"
    )


def _long_header(tmp_path: Path, header: dict[str, object]) -> Path:
    import json
    import struct

    raw = json.dumps(header).encode()
    path = tmp_path / "long.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


@pytest.mark.parametrize(
    "header",
    [
        {"k" * 2_000_000: 1},
        {"a": {"dtype": "X" * 2_000_000, "shape": [1], "data_offsets": [0, 4]}},
        {"a": {"dtype": "F32", "shape": [-1] * 500_000, "data_offsets": [0, 4]}},
        {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0] * 500_000}},
    ],
    ids=["key", "dtype", "shape", "offsets"],
)
def test_errors_show_values_from_the_file_shortened(header: dict[str, object], tmp_path: Path) -> None:
    """Tensor names, dtypes, shapes and offsets from a header were printed whole: lines of megabytes."""
    path = _long_header(tmp_path, header)
    with pytest.raises(ckptconv.MalformedCheckpointError) as error:
        ckptconv.open(path)
    assert len(str(error.value)) < 500
    code, _, stderr = _run("inspect", str(path))
    assert code == 1 and len(stderr) < 500 and len(stderr.splitlines()) == 1, stderr[:300]


def test_a_shard_name_of_megabytes_is_shortened(tmp_path: Path) -> None:
    import json

    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "x" * 2_000_000}}))
    code, _, stderr = _run("inspect", str(folder))
    assert code == 1 and len(stderr) < 1000 and len(stderr.splitlines()) == 1, stderr[:300]


def test_every_printed_error_is_cut_to_its_start_and_end() -> None:
    from ckptconv.cli.terminal import MAX_ERROR_CHARS, shortened

    assert shortened("short message") == "short message"
    long = "start " + "x" * 10 * MAX_ERROR_CHARS + " end"
    cut = shortened(long)
    assert len(cut) <= MAX_ERROR_CHARS and cut.startswith("start ") and cut.endswith(" end")
    assert "characters left out" in cut


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bogus"], "No such option '--bogus'; see 'cli --help'"),
        (["convrt", "a", "b"], "No such command 'convrt'. Did you mean 'convert'?; see 'cli --help'"),
        (["convert", "a.pt"], "Missing argument 'DST'; see 'cli convert --help'"),
        (["convert", "a.pt", "b.pt", "--keep", "("], "is not a valid regular expression"),
    ],
)
def test_usage_errors_are_one_line_too(args: list[str], message: str) -> None:
    """click showed the usage, a hint and a blank line before "Error: ..."; every other error is one line."""
    code, _, stderr = _run(*args)
    assert code == 2 and len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith("ckptconv: error: ") and message in stderr, stderr


def test_no_arguments_still_shows_the_help() -> None:
    """click shows the help when `ckptconv` runs with no command: that is no error to put on one line."""
    code, stdout, stderr = _run()
    assert code == 2 and "Usage:" in (stdout + stderr) and "Convert:" in (stdout + stderr)
    assert "ckptconv: error:" not in stderr
