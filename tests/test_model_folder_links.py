"""Links to folders inside a model folder are carried as real folders; a folder link that leaves it is refused in one
line, as a file link out is (issue 45)."""

from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import load_file

from .conftest import run_cli
from .test_transaction import _leftovers, _model_folder, _tree, _weights


def test_a_link_to_a_folder_inside_the_model_folder_is_carried_as_a_real_folder(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "model", 1)
    (folder / "tokenizer_files").mkdir()
    (folder / "tokenizer_files" / "tokenizer.json").write_text('{"model": "inner"}')
    (folder / "tokenizer_files" / "nested").mkdir()
    (folder / "tokenizer_files" / "nested" / "vocab.txt").write_text("a\nb\n")
    os.symlink("tokenizer_files", folder / "tokenizer")  # relative, as `ln -s` in the folder makes it
    out = tmp_path / "out"
    code, _, stderr = run_cli("convert", str(folder), f"{out}/")
    assert code == 0, stderr
    for name in ("tokenizer", "tokenizer_files"):
        assert (out / name).is_dir() and not (out / name).is_symlink()
        assert (out / name / "tokenizer.json").read_bytes() == b'{"model": "inner"}'
        assert (out / name / "nested" / "vocab.txt").read_bytes() == b"a\nb\n"
    assert not any(path.is_symlink() for path in out.rglob("*"))
    written = load_file(out / "model.safetensors")
    assert all(written[key].equal(value) for key, value in _weights(1).items())


def test_a_folder_link_that_leaves_the_model_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "model", 1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret.txt").write_text("not the model's")
    os.symlink(elsewhere, folder / "tokenizer")
    out = tmp_path / "out"
    code, _, stderr = run_cli("convert", str(folder), f"{out}/")
    assert code == 1
    assert stderr == (
        f"ckptconv: error: {str(folder / 'tokenizer')!r} is a link that leads outside the checkpoint folder "
        f"{str(folder)!r}; ckptconv reads only files inside it (copy the folder in instead of linking it)\n"
    )
    assert not out.exists() and _leftovers(tmp_path) == []


def test_a_folder_link_that_loops_is_refused_in_one_line(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "model", 1)
    (folder / "sub").mkdir()
    os.symlink("..", folder / "sub" / "up")
    before = _tree(folder)
    code, _, stderr = run_cli("convert", str(folder), f"{tmp_path / 'out'}/")
    assert code == 1
    assert stderr == (
        f"ckptconv: error: {str(folder / 'sub' / 'up')!r} is a link to a folder that holds it (a loop); "
        "remove the link\n"
    )
    assert not (tmp_path / "out").exists() and _tree(folder) == before
