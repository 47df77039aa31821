"""A model-folder output is one transaction: after a failure or a signal at any step, DST is the old output byte for
byte or the new one whole, never a mix (issue 45). Proven as SQLite does: every step that writes or removes a file
calls ckptconv.writing.faults.point, and the tests fail each step in turn, kill the writer at each step, and
interrupt it; plus one writer per output (two converts racing into one DST)."""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptconv.writing import faults

from .conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent
_FORK = multiprocessing.get_context("fork")


def _weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.weight": torch.randn(24, 24, generator=generator) for i in range(4)}


def _model_folder(folder: Path, seed: int, *, template: bool = True) -> Path:
    """A Hugging Face model folder: weights, config, generation config, a card, a large tokenizer, a chat template."""
    folder.mkdir()
    save_file(_weights(seed), folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32", "seed": seed}))
    (folder / "generation_config.json").write_text(json.dumps({"max_length": 10 + seed}))
    (folder / "README.md").write_text(f"model {seed}\n")
    vocab = {f"token{seed}_{i}": i for i in range(12_000)}  # ~250 kB: larger than the weights
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    if template:
        (folder / "chat_template.jinja").write_text("{{ messages }}" * (seed + 1))
    return folder


def _tree(folder: Path) -> dict[str, str] | None:
    """Every entry under ``folder``, hidden ones too: a file's sha256, a link's target, "dir" for a folder."""
    if not os.path.lexists(folder):
        return None
    found: dict[str, str] = {}
    for root, folders, files in os.walk(folder):
        for name in folders + files:
            path = Path(root) / name
            relative = str(path.relative_to(folder))
            if path.is_symlink():
                found[relative] = "link:" + os.readlink(path)
            elif path.is_dir():
                found[relative] = "dir"
            else:
                found[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def _leftovers(parent: Path) -> list[str]:
    """What a writer left beside its outputs: staging folders, set-aside folders, lock files."""
    return sorted(name for name in os.listdir(parent) if "ckptconv-" in name)


def _scenario(tmp_path: Path, kind: str) -> tuple[list[str], Path]:
    """The command of the new conversion, and DST prepared as ``kind`` says: absent (fresh), an earlier single-file
    model folder output, or an earlier sharded one; the earlier outputs hold a file of the user's too."""
    old = _model_folder(tmp_path / "a", 1)
    new = _model_folder(tmp_path / "b", 2, template=False)  # no chat template: the old one is not the new one's
    out = tmp_path / "out"
    if kind != "fresh":
        shards = ["--max-shard-size", "3KB"] if kind == "sharded" else []
        assert run_cli("convert", str(old), f"{out}/", *shards, "-q") == (0, "", "")
        (out / "notes.txt").write_text("the user's own")
        (out / "mine").mkdir()
        (out / "mine" / "data.bin").write_bytes(b"also the user's")
    return ["convert", str(new), f"{out}/", "--overwrite", "--dtype", "bf16", "-q"], out


def _with_hook(hook: Callable[[str], None] | None, args: list[str]) -> tuple[int, str, str]:
    saved = faults.hook
    faults.hook = hook
    try:
        return run_cli(*args)
    finally:
        faults.hook = saved


def _expected(tmp_path: Path, args: list[str], out: Path) -> tuple[dict[str, str] | None, list[str]]:
    """The new output whole (the same command into a copy of DST), and every step that command takes."""
    copy = tmp_path / "expected"
    if out.exists():
        shutil.copytree(out, copy, symlinks=True)
    steps: list[str] = []
    code, _, stderr = _with_hook(steps.append, [str(copy) + "/" if a == f"{out}/" else a for a in args])
    assert code == 0, stderr
    return _tree(copy), steps


def _restore(pristine: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    if pristine.exists():
        shutil.copytree(pristine, out, symlinks=True)


def _prepared(
    tmp_path: Path, kind: str
) -> tuple[list[str], Path, dict[str, str] | None, dict[str, str] | None, list[str], Path]:
    """The scenario ``kind``: its command, DST, the old and the new output, every step, and a pristine copy of DST
    (absent for a fresh one) that :func:`_restore` puts back before each run."""
    args, out = _scenario(tmp_path, kind)
    old = _tree(out)
    new, steps = _expected(tmp_path, args, out)
    pristine = tmp_path / "pristine"
    if out.exists():
        shutil.copytree(out, pristine, symlinks=True)
    return args, out, old, new, steps, pristine


@pytest.mark.parametrize("kind", ["fresh", "single", "sharded"])
def test_a_failure_at_every_step_leaves_the_old_output_or_the_new_one_whole(kind: str, tmp_path: Path) -> None:
    args, out, old, new, steps, pristine = _prepared(tmp_path, kind)
    assert len(steps) >= 12 and any(step.startswith(("exchange", "rename")) for step in steps)
    outcomes = []
    for failing in range(len(steps)):
        _restore(pristine, out)
        calls: list[str] = []

        def fail(step: str, failing: int = failing, calls: list[str] = calls) -> None:
            calls.append(step)
            if len(calls) - 1 == failing:
                raise OSError(errno.ENOSPC, "No space left on device")

        code, _, stderr = _with_hook(fail, args)
        assert len(calls) > failing, (failing, steps[failing])  # the step was reached, and failed
        tree = _tree(out)
        if code == 0:
            assert tree == new, (failing, steps[failing])
        else:
            assert code == 1 and stderr.startswith("ckptconv: error: ") and stderr.count("\n") == 1, stderr
            assert tree == old, (failing, steps[failing], stderr)  # old byte for byte, or (fresh) no folder at all
        left = _leftovers(tmp_path)
        if left:  # only a failure after the new folder was in place leaves its tidying to the next writer
            assert code == 0, (failing, steps[failing], left)
            assert run_cli(*args)[0] == 0
            assert _leftovers(tmp_path) == [] and _tree(out) == new
        outcomes.append((steps[failing], "new" if code == 0 else "old"))
    # Every step before the exchange keeps the old output; every step after it gives the new one.
    commit = next(i for i, (step, _) in enumerate(outcomes) if step.startswith(("exchange", "rename the staging")))
    assert {outcome for _, outcome in outcomes[: commit + 1]} == {"old"}, outcomes
    assert {outcome for _, outcome in outcomes[commit + 1 :]} <= {"new"}, outcomes


def _in_child(target: Callable[[], int]) -> multiprocessing.process.BaseProcess:
    """Run ``target`` in a forked child (torch is imported already: no start-up cost), exiting with its result."""

    def main() -> None:
        code = 1
        try:
            code = target()
        finally:
            os._exit(code)

    process = _FORK.Process(target=main)
    process.start()
    return process


def _pausing_at(step_index: int, marker: Path) -> Callable[[str], None]:
    """A hook that stops at the step ``step_index``, says so in ``marker``, and goes on once ``marker`` is gone
    (a signal held back meanwhile, as Ctrl-C is around the exchange, then lands when it should)."""
    calls = []

    def pause(step: str) -> None:
        calls.append(step)
        if len(calls) - 1 == step_index:
            marker.write_text(step)
            deadline = time.monotonic() + 60
            while marker.exists() and time.monotonic() < deadline:
                time.sleep(0.005)

    return pause


def _wait_for(marker: Path, process: Any) -> None:
    deadline = time.monotonic() + 60
    while not marker.exists() and process.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    if not marker.exists():
        process.kill()
        pytest.fail("the writer never reached the step")


def _finish(process: Any) -> None:
    process.join(30)
    if process.is_alive():
        process.kill()
        process.join()
        pytest.fail("the writer did not stop")


@pytest.mark.parametrize("kind", ["fresh", "sharded"])
def test_sigkill_at_every_step_leaves_the_old_output_or_the_new_one_and_the_next_run_cleans_up(
    kind: str, tmp_path: Path
) -> None:
    args, out, old, new, steps, pristine = _prepared(tmp_path, kind)
    outcomes = set()
    marker = tmp_path / "reached"
    for index in range(0, len(steps), 1 if kind == "fresh" else 2):  # every step, or every other (CI's time)
        _restore(pristine, out)
        marker.unlink(missing_ok=True)
        process = _in_child(lambda index=index: _with_hook(_pausing_at(index, marker), args)[0])
        _wait_for(marker, process)
        os.kill(process.pid, signal.SIGKILL)
        _finish(process)
        tree = _tree(out)
        assert tree in (old, new), (index, steps[index])
        outcomes.add("old" if tree == old else "new")
        # A fresh DST never holds a part of a model; leftovers are hidden, and the next run removes them.
        assert all(name.startswith(".") for name in _leftovers(tmp_path))
        code, _, stderr = run_cli(*args)
        assert code == 0, stderr
        assert _leftovers(tmp_path) == [] and _tree(out) == new, (index, steps[index])
    assert outcomes == {"old", "new"}


@pytest.mark.parametrize("kind", ["single", "sharded"])
def test_sigint_at_every_step_of_an_overwrite_keeps_the_old_output_or_says_the_new_one_is_whole(
    kind: str, tmp_path: Path
) -> None:
    args, out, old, new, steps, pristine = _prepared(tmp_path, kind)
    errors, marker = tmp_path / "stderr", tmp_path / "reached"
    for index in range(0, len(steps), 2 if kind == "single" else 3):
        _restore(pristine, out)
        marker.unlink(missing_ok=True)

        def interrupted(index: int = index) -> int:
            code, _, stderr = _with_hook(_pausing_at(index, marker), args)
            errors.write_text(stderr)
            return code

        process = _in_child(interrupted)
        _wait_for(marker, process)
        os.kill(process.pid, signal.SIGINT)
        time.sleep(0.05)
        marker.unlink()
        _finish(process)
        assert process.exitcode == 130, (index, steps[index], process.exitcode)
        message = errors.read_text()
        if message.endswith("no output was written\n"):
            assert _tree(out) == old, (index, steps[index])
        else:
            assert message == f"ckptconv: interrupted; {str(out)!r} was written whole first\n", message
            assert _tree(out) == new, (index, steps[index])
        assert _leftovers(tmp_path) == []


def test_a_file_size_limit_met_at_a_carried_file_keeps_the_whole_previous_output(tmp_path: Path) -> None:
    """The issue's case: the new weights fit under RLIMIT_FSIZE, tokenizer.json does not (EFBIG)."""
    args, out = _scenario(tmp_path, "single")
    old = _tree(out)
    limit = 100_000  # above a bf16 shard (~5 kB), below tokenizer.json (~250 kB)

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = subprocess.run(
        [sys.executable, "-m", "ckptconv", *args],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=limited,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "tokenizer.json" in done.stderr and "the file would exceed the allowed size" in done.stderr, done.stderr
    assert _tree(out) == old
    assert _leftovers(tmp_path) == []


def test_two_converts_into_one_folder_at_once_never_both_succeed_with_a_mix(tmp_path: Path) -> None:
    first = _model_folder(tmp_path / "a", 1)
    second = _model_folder(tmp_path / "b", 2, template=False)
    outcomes = []
    for race in range(12):
        out = tmp_path / f"out{race}"
        start = _FORK.Event()

        def racer(source: Path, out: Path = out, start: Any = start) -> int:
            start.wait()
            code, _, stderr = run_cli("convert", str(source), f"{out}/", "--dtype", "bf16", "-q")
            assert code == 0 or "ckptconv: error: " in stderr
            return code

        processes = [_in_child(lambda source=source: racer(source)) for source in (first, second)]
        start.set()
        for process in processes:
            _finish(process)
        codes = [process.exitcode for process in processes]
        assert sorted(codes) == [0, 1], codes  # one writer; the other refused (by the lock, or the existing output)
        winner = (first, second)[codes.index(0)]
        # The output is the winner's whole: its weights (read by the safetensors library) and its files.
        written = load_file(out / "model.safetensors")
        assert all(
            torch.equal(written[key], value.to(torch.bfloat16))
            for key, value in _weights(1 if winner == first else 2).items()
        )
        for name in ("tokenizer.json", "README.md", "generation_config.json"):
            assert (out / name).read_bytes() == (winner / name).read_bytes()
        assert (out / "chat_template.jinja").exists() == (winner == first)
        assert _leftovers(tmp_path) == []
        outcomes.append(codes)
    assert len(outcomes) == 12


def test_a_second_writer_is_refused_in_one_line_naming_the_first(tmp_path: Path) -> None:
    from ckptconv.writing.locks import OutputLock

    source = _model_folder(tmp_path / "a", 1)
    out = tmp_path / "out"
    with OutputLock(str(out)):
        code, _, stderr = run_cli("convert", str(source), f"{out}/")
    assert code == 1
    assert stderr == (
        f"ckptconv: error: another ckptconv is writing {str(out)!r} (pid {os.getpid()} on {os.uname().nodename} "
        f"running {' '.join(sys.argv)[:200]!r}); wait for it to finish\n"
    )
    assert not out.exists() and _leftovers(tmp_path) == []
    assert run_cli("convert", str(source), f"{out}/", "-q") == (0, "", "")  # the lock let go: the next one writes


def test_batch_checks_its_lock_before_the_outputs_that_exist(tmp_path: Path) -> None:
    from ckptconv.writing.locks import OutputLock

    zoo, out = tmp_path / "zoo", tmp_path / "out"
    zoo.mkdir()
    torch.save({"w": torch.ones(3)}, zoo / "m.pt")
    assert run_cli("batch", str(zoo), str(out), "-q")[0] == 0
    with OutputLock(str(out), what="ckptconv batch"):
        code, _, stderr = run_cli("batch", str(zoo), str(out))
    assert code == 1
    assert stderr.startswith(f"ckptconv: error: another ckptconv batch is writing {str(out)!r} (pid "), stderr
    assert "exist already" not in stderr and stderr.count("\n") == 1


def test_staging_folders_are_never_read_as_outputs_or_sources(tmp_path: Path) -> None:
    """A killed writer's staging folder beside DST is hidden: batch never finds the weights in it."""
    args, out = _scenario(tmp_path, "fresh")
    marker = tmp_path / "reached"
    steps = _expected(tmp_path, args, out)[1]
    index = next(i for i, step in enumerate(steps) if step.startswith(("exchange", "rename the")))
    process = _in_child(lambda: _with_hook(_pausing_at(index, marker), args)[0])
    _wait_for(marker, process)
    os.kill(process.pid, signal.SIGKILL)
    _finish(process)
    (staging,) = [name for name in _leftovers(tmp_path) if "staging" in name]
    assert (tmp_path / staging / "model.safetensors").exists() and not out.exists()
    code, stdout, _ = run_cli("batch", str(tmp_path), str(tmp_path.parent / f"{tmp_path.name}-batch"), "--dry-run")
    assert code == 0 and staging not in stdout, stdout


def test_a_folder_of_models_is_one_transaction_too(tmp_path: Path) -> None:
    """A diffusers-like pipeline (model_index.json, unet/, vae/): an --overwrite whose vae/ fails after the top and
    unet/ were converted leaves the earlier output byte for byte; one that succeeds replaces all of it."""
    pipeline = tmp_path / "pipe"
    (pipeline / "scheduler").mkdir(parents=True)
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "P", "unet": ["d", "U"], "vae": ["d", "V"]}))
    (pipeline / "scheduler" / "scheduler_config.json").write_text("{}")
    for part in ("unet", "vae"):
        (pipeline / part).mkdir()
        (pipeline / part / "config.json").write_text(json.dumps({"_class_name": part, "torch_dtype": "float32"}))
        save_file(_weights(3), pipeline / part / "diffusion_pytorch_model.safetensors")
    out = tmp_path / "out"
    assert run_cli("convert", str(pipeline), f"{out}/", "-q") == (0, "", "")
    old = _tree(out)
    big = _weights(3)
    big["model.layers.0.weight"][0, 0] = 1e10  # fp16 overflows here: vae/ is refused after unet/ was written
    save_file(big, pipeline / "vae" / "diffusion_pytorch_model.safetensors")
    code, _, stderr = run_cli("convert", str(pipeline), f"{out}/", "--overwrite", "--dtype", "fp16")
    assert code == 1 and "casting to float16 would turn finite values" in stderr, stderr
    assert _tree(out) == old and _leftovers(tmp_path) == []
    code, _, stderr = run_cli("convert", str(pipeline), f"{out}/", "--overwrite", "--dtype", "bf16", "-q")
    assert code == 0, stderr
    for part in ("unet", "vae"):
        assert load_file(out / part / "diffusion_pytorch_model.safetensors")["model.layers.1.weight"].dtype == (
            torch.bfloat16
        )
        assert json.loads((out / part / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert _leftovers(tmp_path) == [] and sorted(p.name for p in out.iterdir()) == [
        "model_index.json", "scheduler", "unet", "vae",
    ]  # fmt: skip


def test_an_overwrite_keeps_every_file_it_does_not_replace_as_the_same_file_and_names_it(tmp_path: Path) -> None:
    args, out = _scenario(tmp_path, "sharded")
    kept = {name: os.stat(out / name).st_ino for name in ("notes.txt", "mine/data.bin", "chat_template.jinja")}
    code, _, stderr = run_cli(*[arg for arg in args if arg != "-q"])
    assert code == 0, stderr
    assert {name: os.stat(out / name).st_ino for name in kept} == kept  # the same files, not copies
    assert (
        f"note: kept 3 files in {str(out)!r} that the new output does not use and ckptconv cannot tell it wrote: "
        "chat_template.jinja, mine/data.bin, notes.txt; remove them if they do not belong with the new output\n"
    ) in stderr
    # The earlier output's shards and index, which carry ckptconv's provenance, went; the new output is whole.
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("model")) == ["model.safetensors"]
    assert all(v.dtype == torch.bfloat16 for v in load_file(out / "model.safetensors").values())
