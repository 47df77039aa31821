"""convert SRC DST/ --max-shard-size S --part i/N: N processes at once give exactly the one-process folder."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from ckptconv.writing.parts import Part, parse_part

from .conftest import FIXTURES, dcp_one_process, run_cli
from .test_quantized_cli import FP8_CONFIG, fp8_block_state, model_folder

ROOT = Path(__file__).resolve().parent.parent
RUNS = FIXTURES / "runs"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def files_of(folder: Path) -> dict[str, str]:
    """Every entry of ``folder``, hidden ones too: name -> sha256 (a folder: "folder")."""
    return {
        path.name: "folder" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.iterdir())
    }


def _layers(path: Path) -> Path:
    torch.manual_seed(0)
    torch.save({f"layers.{i}.weight": torch.randn(48 + 16 * i, 64) for i in range(10)}, path)
    return path


def _fp8_folder(path: Path) -> Path:
    state = {}
    for layer in range(4):
        state.update({key.replace("layers.0", f"layers.{layer}"): value for key, value in fp8_block_state().items()})
    return model_folder(path, state, FP8_CONFIG)


def _dcp_folder(path: Path) -> Path:
    torch.manual_seed(1)
    state = {f"block{i}.w": torch.randn(40 + 8 * i, 32) for i in range(8)}
    dcp.save(state, checkpoint_id=str(path), **dcp_one_process())
    return path


SOURCES = {
    "cast": (_layers, "model.pt", ["--dtype", "bf16"], "20KB"),
    "fp8-dequantized-model-folder": (_fp8_folder, "fp8", ["--dtype", "bf16"], "60KB"),
    "dcp": (_dcp_folder, "dcp", ["--dtype", "fp16"], "6KB"),
    "zero2": (None, str(RUNS / "ds_zero2_bf16"), [], "1KB"),
    "megatron-legacy": (None, str(RUNS / "megatron_legacy_tp2"), [], "8KB"),
}


def _convert(source: Path, destination: Path, size: str, extra: list[str], part: str | None) -> subprocess.Popen[str]:
    # DST/ (a folder, whether or not another part made it already): a model folder's files are carried alike.
    args = [sys.executable, "-m", "ckptconv", "convert", str(source), f"{destination}/", "--max-shard-size", size]
    args += [*extra, *(["--part", part] if part else []), "-q"]
    return subprocess.Popen(args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("name", list(SOURCES))
def test_n_parts_at_once_write_the_one_process_folder(name: str, tmp_path: Path) -> None:
    make, source_name, extra, size = SOURCES[name]
    source = make(tmp_path / source_name) if make is not None else Path(source_name)
    one = _convert(source, tmp_path / "one", size, extra, None)
    assert one.wait(timeout=300) == 0, one.communicate()
    expected = files_of(tmp_path / "one")
    assert len([n for n in expected if n.endswith(".safetensors")]) >= 3  # enough shards for three parts

    count = 3
    processes = [_convert(source, tmp_path / "split", size, extra, f"{i}/{count}") for i in range(count)]
    outcome = [process.communicate(timeout=300) for process in processes]  # all started before any is waited for
    assert [process.returncode for process in processes] == [0] * count, outcome
    assert files_of(tmp_path / "split") == expected  # the same names and bytes, nothing hidden left behind
    assert not [path for path in tmp_path.iterdir() if "ckptconv-parts" in path.name or "ckptconv-lock" in path.name]
    if name == "cast":  # and the values, against torch's and safetensors' own readers
        reference = torch.load(source, weights_only=True)
        index = json.loads((tmp_path / "split" / "model.safetensors.index.json").read_text())
        for key, tensor in reference.items():
            got = load_file(str(tmp_path / "split" / index["weight_map"][key]))[key]
            assert got.dtype == torch.bfloat16 and torch.equal(got, tensor.to(torch.bfloat16))


def _hidden(tmp_path: Path) -> Path:
    """The parts' folder beside ``tmp_path/out`` (``.out.ckptconv-parts-<plan>``)."""
    (hidden,) = [path for path in tmp_path.iterdir() if path.name.startswith(".out.ckptconv-parts-")]
    return hidden


def test_the_index_waits_for_every_part_and_a_bad_shard_stops_it(tmp_path: Path) -> None:
    source = _layers(tmp_path / "model.pt")
    out = tmp_path / "out"
    for index in (0, 1):  # one after another: the folder stays unpublished
        code, _, stderr = run_cli("convert", str(source), f"{out}/", "--max-shard-size", "20KB", "--part", f"{index}/3")
        assert code == 0, stderr
        assert f"is published when {2 - index} other part" in stderr
        assert not out.exists()
    staged = _hidden(tmp_path)
    shard = next(path for path in staged.iterdir() if path.name.endswith(".safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # one bit of one tensor, after its part recorded the shard's sha256
    shard.write_bytes(bytes(data))
    code, _, stderr = run_cli("convert", str(source), f"{out}/", "--max-shard-size", "20KB", "--part", "2/3")
    assert code == 1
    assert stderr.startswith(f"ckptconv: error: the shard {shard.name!r} of part ")
    assert stderr.endswith("is not what that part recorded; run that part again\n")
    assert not out.exists()  # nothing published

    owner = next(
        index
        for index in (0, 1)
        if shard.name in json.loads((staged / f"part-{index:04d}-of-0003.json").read_text())["shards"]
    )
    code, _, stderr = run_cli("convert", str(source), f"{out}/", "--max-shard-size", "20KB", "--part", f"{owner}/3")
    assert code == 0, stderr  # the part run again writes its shards again, and, last, publishes
    one = tmp_path / "one"
    assert run_cli("convert", str(source), f"{one}/", "--max-shard-size", "20KB")[0] == 0
    assert files_of(out) == files_of(one)
    assert not staged.exists()


def test_a_publish_refused_keeps_the_parts_for_the_next_try(tmp_path: Path) -> None:
    source = _layers(tmp_path / "model.pt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text("{}")  # an earlier output, and no --overwrite
    args = ["convert", str(source), f"{out}/", "--max-shard-size", "20KB"]
    for index in range(3):
        code, _, stderr = run_cli(*args, "--part", f"{index}/3")
    assert code == 2 and "already holds" in stderr  # the last part's publish is refused, as one process's would be
    assert [path.name for path in out.iterdir()] == ["model.safetensors.index.json"]  # untouched
    assert len(list(_hidden(tmp_path).glob("part-*.json"))) == 3
    code, _, stderr = run_cli(*args, "--part", "1/3", "--overwrite")
    assert code == 0, stderr
    one = tmp_path / "one"
    assert run_cli("convert", str(source), f"{one}/", "--max-shard-size", "20KB")[0] == 0
    assert files_of(out) == files_of(one)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["out.safetensors", "--part", "0/2"], "--part writes part of a sharded folder"),
        (["out/", "--to", "dcp", "--part", "0/2"], "--part writes part of a sharded folder"),
        (["out/", "--max-shard-size", "1MB", "--part", "2/2"], "part 2 is not in 0..1 (of 2 parts)"),
        (["out/", "--max-shard-size", "1MB", "--part", "x"], "--part takes INDEX/COUNT (0/4 to 3/4), not 'x'"),
    ],
)
def test_part_usage_errors(args: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _layers(tmp_path / "model.pt")
    monkeypatch.chdir(tmp_path)
    code, _, stderr = run_cli("convert", str(source), *args)
    assert code == 2
    assert message in stderr.splitlines()[-1]
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["model.pt"]


def test_parse_part() -> None:
    assert parse_part("3/4") == Part(3, 4)
    with pytest.raises(ValueError, match=r"not in 0\.\.3"):
        parse_part("4/4")
    with pytest.raises(ValueError, match=r"--part takes INDEX/COUNT"):
        parse_part("\u00b2/4")  # a digit to str.isdigit, not to int()


def test_dry_run_prints_the_plan_the_parts_follow(tmp_path: Path) -> None:
    source = _layers(tmp_path / "model.pt")
    out = tmp_path / "out"
    code, _, stderr = run_cli(
        "convert", str(source), f"{out}/", "--max-shard-size", "20KB", "--part", "1/3", "--dry-run"
    )
    assert code == 0 and not out.exists()
    lines = [line.removeprefix("note: ") for line in stderr.splitlines() if line.startswith("note: part ")]
    assert [line.split(":")[0] for line in lines] == ["part 0/3", "part 1/3 (this one)", "part 2/3"]
    claimed = {index: sorted(line.rsplit(": ", 1)[1].split(", ")) for index, line in enumerate(lines)}
    for index in range(3):
        assert run_cli("convert", str(source), f"{out}/", "--max-shard-size", "20KB", "--part", f"{index}/3")[0] == 0
        if index < 2:  # before the last part publishes, its records say what each part wrote
            staged = _hidden(tmp_path)
            record = json.loads((staged / f"part-{index:04d}-of-0003.json").read_text())
            assert sorted(record["shards"]) == claimed[index]
    assert sorted(path.name for path in out.iterdir() if path.suffix == ".safetensors") == sorted(
        name for names in claimed.values() for name in names
    )


def test_parts_finishing_at_once_publish_once(tmp_path: Path) -> None:
    """The race of the last parts: whatever the interleaving, exactly one of them publishes, once every record is
    there (threads: flock locks open files, so two threads contend as two processes do)."""
    import threading

    from safetensors.torch import save_file

    from ckptconv.reading.formats import safetensors as safetensors_reader
    from ckptconv.writing import shards
    from ckptconv.writing.files import WriteReport
    from ckptconv.writing.parts import write_part
    from ckptconv.writing.write_policy import Inputs

    save_file({f"t{i}": torch.full((4 + i,), float(i)) for i in range(3)}, str(tmp_path / "src.safetensors"))
    refs = safetensors_reader.read(str(tmp_path / "src.safetensors")).tree
    keys = sorted(refs)
    plan = shards.ShardPlan(tuple(((key, refs[key]),) for key in keys), tuple(refs[key].nbytes for key in keys))
    names, index = shards.shard_names("safetensors", 3)

    def write_shard(shard: object, path: str) -> WriteReport:
        Path(path).write_bytes(repr(shard).encode())
        return WriteReport(path, "safetensors", 1, 4, {}, (path,))

    def race(attempt: int) -> None:
        folder = tmp_path / f"out{attempt}"
        published: list[int] = []
        reports: list[WriteReport] = []
        barrier = threading.Barrier(2)

        def run(number: int) -> None:
            def publish(written_before: object) -> WriteReport:
                published.append(number)
                return WriteReport(str(folder), "safetensors", 3, 12)

            if number:
                barrier.wait()  # parts 1 and 2 set off together
            report = write_part(
                plan, names, index, str(folder), Part(number, 3), kind="safetensors", metadata={},
                write_shard=write_shard, publish=publish, inputs=Inputs([]), fsync=False,
            )  # fmt: skip
            reports.append(report)

        run(0)
        threads = [threading.Thread(target=run, args=(number,)) for number in (1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(published) == 1 and published[0] in (1, 2)
        assert sorted(report.pending for report in reports) in ([0, 1, 2], [0, 0, 2])  # either interleaving
        assert not [path for path in tmp_path.iterdir() if path.name.startswith(f".out{attempt}.ckptconv-parts-")]

    for attempt in range(20):
        race(attempt)
