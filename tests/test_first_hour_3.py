"""The first hour, round 3 (issue 34): the items left open, each run through the CLI as a user types it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import run_cli


class _Bars:
    """The progress bars a command showed: each one's total and where it stopped."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import click.testing
        import tqdm.auto

        self.finished: list[tuple[float, float]] = []
        bars = self

        class Recorded(tqdm.auto.tqdm):  # type: ignore[misc,name-defined]
            def close(self) -> None:
                if not self.disable:
                    bars.finished.append((self.n, self.total))
                super().close()

        monkeypatch.setattr(tqdm.auto, "tqdm", Recorded)
        # stderr is a terminal, as when a user types the command: ckptconv shows a bar only then.
        monkeypatch.setattr(click.testing._NamedTextIOWrapper, "isatty", lambda self: True)


def _gpt2_like(path: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    wte = torch.nn.Parameter(torch.randn(64, 16))
    state = {
        "transformer.wte.weight": wte,
        "transformer.h.0.mlp.weight": torch.randn(16, 16),
        "transformer.ln_f.weight": torch.ones(16),
        "lm_head.weight": wte,  # tied, as GPT-2's lm_head is
    }
    torch.save(state, path)
    return state


@pytest.mark.parametrize(
    "output, extra",
    [
        ("out.safetensors", ()),
        ("out.pt", ()),
        ("out.safetensors", ("--tied", "copy")),
        ("out/", ("--max-shard-size", "3KB")),
        ("out/", ("--to", "pt", "--max-shard-size", "3KB")),
        ("out/", ("--to", "dcp")),
    ],
)
def test_the_progress_bar_ends_at_its_total_with_tied_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, output: str, extra: tuple[str, ...]
) -> None:
    bars = _Bars(monkeypatch)
    t = torch.randn(40, 40)
    sources = {"shared.pt": {"a": t, "b": t}, "gpt2.pt": None}
    for name, state in sources.items():
        if state is None:
            _gpt2_like(tmp_path / name)
        else:
            torch.save(state, tmp_path / name)
        (tmp_path / name.replace(".pt", "")).mkdir()
        target = str(tmp_path / name.replace(".pt", "") / output)
        code, _, stderr = run_cli("convert", str(tmp_path / name), target, *extra)
        assert code == 0, stderr
    assert len(bars.finished) == 2
    for count, total in bars.finished:
        assert count == total > 0


def test_no_provenance_value_is_empty(tmp_path: Path) -> None:
    import json
    import zipfile

    from safetensors import safe_open

    torch.save({"a": torch.ones(300, 300), "b": torch.ones(300, 300)}, tmp_path / "model.pt")
    for output, extra in (("sharded/", ("--max-shard-size", "400KB")), ("one.safetensors", ()), ("one.pt", ())):
        code, _, stderr = run_cli("convert", str(tmp_path / "model.pt"), str(tmp_path / output), *extra, "-q")
        assert code == 0, stderr
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["metadata"]
    with safe_open(str(tmp_path / "one.safetensors"), "pt") as file:
        header = file.metadata()
    with zipfile.ZipFile(tmp_path / "one.pt") as archive:
        (record,) = [name for name in archive.namelist() if name.endswith("/ckptconv.json")]
        pt_record = json.loads(archive.read(record))
    for metadata in (index, header, pt_record):
        provenance = {key: value for key, value in metadata.items() if key.startswith("ckptconv.")}
        assert "ckptconv.source" in provenance and "ckptconv.version" in provenance, metadata
        assert "ckptconv.selected" not in provenance  # the whole file: nothing to say
        assert all(value != "" for value in provenance.values()), provenance


_LEFT_BEHIND = (
    "every key still starts with '_orig_mod.' (torch.compile); pass --canonical to remove every wrapper prefix"
)
_SET_ASIDE = "set aside 'n_averaged', the counter AveragedModel (SWA/EMA) keeps beside the weights; no model has it"


def _wrapped_zoo(folder: Path) -> None:
    from torch.optim.swa_utils import AveragedModel

    folder.mkdir()
    torch.save({f"module._orig_mod.layers.{i}.weight": torch.ones(2) for i in range(3)}, folder / "compiled.pt")
    torch.save(AveragedModel(torch.nn.Linear(3, 2)).state_dict(), folder / "swa.pt")


def test_step_notes_reach_the_library_report_and_batch_manifest(tmp_path: Path) -> None:
    import json

    import ckptconv

    zoo = tmp_path / "zoo"
    _wrapped_zoo(zoo)
    compiled = ckptconv.convert(zoo / "compiled.pt", tmp_path / "a.pt", transforms=[ckptconv.StripPrefix("module")])
    assert _LEFT_BEHIND in compiled.notes
    swa = ckptconv.convert(zoo / "swa.pt", tmp_path / "b.pt", transforms=[ckptconv.Canonicalize()])
    assert _SET_ASIDE in swa.notes
    for flag, name, note in (("--strip-prefix", "compiled.pt", _LEFT_BEHIND), ("--canonical", "swa.pt", _SET_ASIDE)):
        out = tmp_path / f"out{flag}"
        args = (flag, "module") if flag == "--strip-prefix" else (flag,)
        code, _, stderr = run_cli("batch", str(zoo), str(out), *args, "--glob", name, "-q")
        assert code == 0, stderr
        lines = (out / "ckptconv-manifest.jsonl").read_text().splitlines()
        (item,) = [record for record in map(json.loads, lines) if record["record"] == "item"]
        assert note in item["notes"]
        assert not any(n.startswith("no wrapper prefixes found") for n in item["notes"])


def test_canonical_on_some_module_keys_says_it_once_in_the_report(tmp_path: Path) -> None:
    import ckptconv

    torch.save({"module.a": torch.ones(1), "module.b": torch.ones(1), "head.c": torch.ones(1)}, tmp_path / "m.pt")
    report = ckptconv.convert(tmp_path / "m.pt", tmp_path / "out.pt", transforms=[ckptconv.Canonicalize()])
    assert report.notes == (
        "'module.' starts 2 of 3 keys, so --canonical kept it (it removes 'module.' only when every key "
        "has it); pass --strip-prefix module to remove it from those 2",
    )
    code, _, stderr = run_cli("convert", str(tmp_path / "m.pt"), str(tmp_path / "cli.pt"), "--canonical")
    assert code == 0
    assert [line for line in stderr.splitlines() if line.startswith("note: ")] == [f"note: {report.notes[0]}"]


_GIVE_A_CHECKPOINT = "give a checkpoint file (torch.save, pickle or safetensors) or the folder that holds one"


@pytest.mark.parametrize(
    "name, content, said",
    [
        (
            "README.md",
            "# My model\n\nTrained for 3 epochs.\n",
            f"is a text file (Markdown), not a checkpoint; {_GIVE_A_CHECKPOINT}",
        ),
        (
            "train.yaml",
            "model:\n  name: gpt2\n  lr: 0.1\n",
            f"is a text file (YAML), not a checkpoint; {_GIVE_A_CHECKPOINT}",
        ),
        # 'N' is an old-protocol pickle opcode: the pickle reader is tried first, and says the same
        ("data.csv", "Name,value\na,1\nb,2\n", f"is a text file (CSV), not a checkpoint; {_GIVE_A_CHECKPOINT}"),
        ("notes", "Checkpoint of run 7, the best one.\n", f"is a text file, not a checkpoint; {_GIVE_A_CHECKPOINT}"),
        (
            "weights.pt",
            '{"a": [1, 2, 3], "b": "c"}\n',
            f"is a text file (JSON), not a checkpoint; {_GIVE_A_CHECKPOINT}",
        ),
    ],
)
def test_a_text_file_given_as_src_is_said_to_be_text(tmp_path: Path, name: str, content: str, said: str) -> None:
    import os

    (tmp_path / name).write_text(content)
    os.chdir(tmp_path)
    try:
        for command in (("inspect", name), ("convert", name, "out.safetensors")):
            assert run_cli(*command) == (1, "", f"ckptconv: error: {name!r} {said}\n")
        assert not (tmp_path / "out.safetensors").exists()
    finally:
        os.chdir(Path(__file__).parent)


def test_a_models_config_json_points_at_its_folder(tmp_path: Path) -> None:
    import json

    (tmp_path / "gpt2").mkdir()
    config = tmp_path / "gpt2" / "config.json"
    config.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768}))
    assert run_cli("convert", str(config), str(tmp_path / "out.safetensors")) == (
        1,
        "",
        f"ckptconv: error: {str(config)!r} is a text file (JSON), a model's config, not its weights; give the "
        f"model folder that holds it ({str(tmp_path / 'gpt2') + '/'!r}) to read the weights beside it\n",
    )


@pytest.mark.parametrize(
    "content",
    [
        bytes(range(256)) * 4,  # binary garbage
        b"weights\x00\x00\x00 text with NUL bytes, which no text file holds" * 4,
        ("\x1b\x07\x02\x03" * 60).encode(),  # valid UTF-8, but control characters
        "caf\xe9 latin-1 text, which is not UTF-8\n".encode("latin-1") * 4,
    ],
)
def test_other_bytes_are_still_shown_in_hex(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "blob.bin").write_bytes(content)
    code, _, stderr = run_cli("inspect", str(tmp_path / "blob.bin"))
    assert code == 1
    assert stderr == (
        f"ckptconv: error: {str(tmp_path / 'blob.bin')!r} is not a checkpoint format ckptconv knows (it starts "
        f"with bytes {content[:8].hex(' ')}); expected a torch.save file, a pickle or safetensors\n"
    )


def _small(path: Path, value: float = 1.0) -> dict[str, torch.Tensor]:
    state = {"w": torch.full((4, 4), value), "b": torch.arange(4.0)}
    torch.save(state, path)
    return state


@pytest.mark.parametrize("output", ["new/sub/out.safetensors", "new/sub/out.pt", "new/sub/", "new/sub/dcp/"])
def test_a_missing_parent_folder_of_dst_is_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, output: str
) -> None:
    from safetensors.torch import load_file

    from .conftest import assert_same_state

    state = _small(tmp_path / "a.pt")
    monkeypatch.chdir(tmp_path)
    extra = ("--to", "dcp") if output.endswith("dcp/") else ()
    code, _, stderr = run_cli("convert", "a.pt", output, *extra, "-q")
    assert (code, stderr) == (0, "")
    if output.endswith(".safetensors"):
        assert_same_state(load_file(output), state, ordered=False)
    elif output.endswith(".pt"):
        assert_same_state(torch.load(output, weights_only=True), state)
    elif extra:
        assert (tmp_path / output / ".metadata").is_file()
    else:
        assert_same_state(load_file(f"{output}model.safetensors"), state, ordered=False)


@pytest.mark.parametrize("output", ["new/sub/out.safetensors", "new/sub/"])
def test_a_failed_write_removes_the_folders_it_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, output: str
) -> None:
    _small(tmp_path / "a.pt", value=1e6)  # too large for fp16: the cast refuses, once writing started
    (tmp_path / "kept").mkdir()
    monkeypatch.chdir(tmp_path)
    code, _, stderr = run_cli("convert", "a.pt", f"kept/{output}", "--dtype", "fp16")
    assert code == 1 and stderr.startswith("ckptconv: error: tensor 'w': "), stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.pt", "kept"]
    assert list((tmp_path / "kept").iterdir()) == []


def test_folders_are_created_only_below_what_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _small(tmp_path / "a.pt")
    (tmp_path / "dangling").symlink_to(tmp_path / "elsewhere" / "target")
    monkeypatch.chdir(tmp_path)
    assert run_cli("convert", "a.pt", "new/../x/out.pt") == (
        1,
        "",
        "ckptconv: error: refusing to create 'new/../x': the part of it that does not exist yet ('new/../x') holds "
        "'..', and ckptconv creates folders only below the part that exists; create them first\n",
    )
    assert run_cli("convert", "a.pt", "dangling/sub/out.pt") == (
        1,
        "",
        "ckptconv: error: cannot create 'dangling/sub': 'dangling' is a link that leads nowhere\n",
    )
    assert run_cli("convert", "a.pt", "a.pt/sub/out.pt") == (
        1,
        "",
        "ckptconv: error: cannot create 'a.pt/sub': 'a.pt' is a file, not a folder\n",
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.pt", "dangling"]


def test_a_link_to_a_file_in_dsts_chain_is_said_to_lead_to_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link that leads to a file is no link that leads nowhere: the error says where it leads."""
    _small(tmp_path / "a.pt")
    (tmp_path / "to_file").symlink_to(tmp_path / "a.pt")
    monkeypatch.chdir(tmp_path)
    assert run_cli("convert", "a.pt", "to_file/sub/out.pt") == (
        1,
        "",
        "ckptconv: error: cannot create 'to_file/sub': 'to_file' is a link to a file, not a folder\n",
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.pt", "to_file"]


def test_batch_creates_dst_below_what_exists_and_no_further(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import load_file

    from .conftest import assert_same_state

    (tmp_path / "zoo").mkdir()
    state = _small(tmp_path / "zoo" / "a.pt")
    monkeypatch.chdir(tmp_path)
    code, _, stderr = run_cli("batch", "zoo", "new/sub/out", "-q")
    assert (code, stderr) == (0, "")
    assert_same_state(load_file("new/sub/out/a.safetensors"), state, ordered=False)
    code, _, stderr = run_cli("batch", "zoo", "other/../x")
    assert (code, stderr) == (
        1,
        "ckptconv: error: refusing to create 'other/../x': the part of it that does not exist yet ('other/../x') "
        "holds '..', and ckptconv creates folders only below the part that exists; create them first\n",
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["new", "zoo"]


@pytest.mark.parametrize("command", [("--help",), ("convert", "--help"), ("verify", "--help")])
def test_help_imports_no_stage_of_the_pipeline(command: tuple[str, ...]) -> None:
    """--help pays for the command line alone: no reader, writer or checker (the verifier and its
    streaming threads were imported for the name of --verify's readers). Its time: bench/bench_help.py."""
    import subprocess
    import sys

    child = (
        "import contextlib, io, runpy, sys\n"
        f"sys.argv = ['ckptconv', *{list(command)!r}]\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    runpy.run_module('ckptconv', run_name='__main__')\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    modules = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout.split()
    assert "ckptconv.cli" in modules
    paid = [
        name
        for name in modules
        if name.startswith(("ckptconv.reading", "ckptconv.writing", "ckptconv.checking", "ckptconv.conversion"))
        or name in ("concurrent.futures", "hashlib", "torch", "numpy")
    ]
    assert paid == []


def test_a_model_folder_whose_files_fail_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights are written, then the disk fills while config.json is carried: the weights are removed, and
    the folders made for them too."""
    import errno
    import json

    from safetensors.torch import save_file

    from ckptconv.writing import model_files, write_policy

    (tmp_path / "hf").mkdir()
    save_file({"w": torch.ones(3)}, str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": ["X"], "model_type": "gpt2"}))
    real = model_files.atomic_output

    def full_disk(path: str, **kwargs: Any) -> Any:
        if path.endswith("config.json"):
            raise write_policy.os_error(OSError(errno.ENOSPC, "No space left on device"), path)  # as atomic_output says
        return real(path, **kwargs)

    monkeypatch.setattr(model_files, "atomic_output", full_disk)
    monkeypatch.chdir(tmp_path)
    code, _, stderr = run_cli("convert", "hf/", "new/sub/")
    assert (code, stderr.splitlines()[-1][:30]) == (1, "ckptconv: error: cannot write "), stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf"]


def test_a_folder_of_models_that_fails_part_way_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A diffusers-like pipeline folder: model_index.json and scheduler/ are carried, unet/ converts, then vae/'s
    weights turn out damaged: every file written is removed, and the folders made for them too."""
    import json

    from safetensors.torch import save_file

    pipeline = tmp_path / "pipe"
    for part in ("unet", "vae", "scheduler"):
        (pipeline / part).mkdir(parents=True)
    (pipeline / "model_index.json").write_text(
        json.dumps({"_class_name": "P", "unet": ["diffusers", "U"], "vae": ["diffusers", "V"]})
    )
    (pipeline / "scheduler" / "scheduler_config.json").write_text("{}")
    for part in ("unet", "vae"):
        (pipeline / part / "config.json").write_text(json.dumps({"_class_name": part}))
        save_file({"w": torch.ones(3)}, str(pipeline / part / "diffusion_pytorch_model.safetensors"))
    damaged = (pipeline / "vae" / "diffusion_pytorch_model.safetensors").read_bytes()
    (pipeline / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(damaged[:-4])
    monkeypatch.chdir(tmp_path)
    code, _, stderr = run_cli("convert", "pipe/", "new/sub/")
    assert code == 1 and "vae" in stderr, stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["pipe"]
