"""batch --shard i/N: N processes at once into one DST, each item exactly once, per-shard resume, --report."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from ckptconv.batching.manifest import MANIFEST_NAME, read_records
from ckptconv.batching.sharding import Shard, assign, manifest_name, parse_shard

from .conftest import run_cli as run

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def build_zoo(root: Path) -> Path:
    """Nine items of different sizes in nested folders: .pt files, a safetensors file, a sharded checkpoint."""
    torch.manual_seed(0)
    (root / "a" / "b").mkdir(parents=True)
    (root / "c").mkdir()
    for index in range(7):
        folder = root / ("a" if index % 3 == 0 else "a/b" if index % 3 == 1 else "c")
        torch.save({"w": torch.randn(8 + 24 * index, 16), "n": torch.arange(index + 1)}, folder / f"m{index}.pt")
    save_file({"e": torch.randn(40, 16, dtype=torch.float64)}, str(root / "st.safetensors"))
    hf = root / "hf"
    hf.mkdir()
    save_file({"x": torch.randn(64, 8)}, str(hf / "model-00001-of-00002.safetensors"))
    save_file({"y": torch.randn(32, 8)}, str(hf / "model-00002-of-00002.safetensors"))
    index_map = {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index_map}))
    return root


ITEMS = 9


def outputs_of(folder: Path) -> dict[str, str]:
    """Every file in ``folder`` but the manifests: relative path -> sha256."""
    return {
        path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not path.name.startswith("ckptconv-manifest")
    }


def item_records(manifest: Path) -> list[dict[str, Any]]:
    return [record for record in read_records(str(manifest)) if record.get("record") == "item"]


def test_n_processes_at_once_give_the_one_process_output_each_item_once(tmp_path: Path) -> None:
    zoo = build_zoo(tmp_path / "zoo")
    reference = tmp_path / "one"
    done = subprocess.run(
        [sys.executable, "-m", "ckptconv", "batch", str(zoo), str(reference), "--dtype", "bf16", "-q"],
        check=False,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    # The values, against torch's and safetensors' own readers (never ours on both sides).
    for source in sorted(zoo.rglob("m*.pt")):
        expected = torch.load(source, weights_only=True)
        got = load_file(str(reference / source.relative_to(zoo).with_suffix(".safetensors")))
        assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], expected["w"].to(torch.bfloat16))
        assert torch.equal(got["n"], expected["n"])

    split = tmp_path / "split"
    count = 3
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "ckptconv", "batch", str(zoo), str(split), "--dtype", "bf16", "--shard", f"{i}/3"],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]  # all started before any is waited for
    finished = [process.communicate(timeout=300) for process in processes]
    assert [process.returncode for process in processes] == [0] * count, finished
    assert outputs_of(split) == outputs_of(reference)
    assert len(outputs_of(split)) == ITEMS
    sources = [
        record["source"]
        for i in range(count)
        for record in item_records(split / manifest_name(Shard(i, count)))
        if record["status"] == "converted"
    ]
    assert sorted(sources) == sorted(set(sources)) and len(sources) == ITEMS  # each item once, by one shard
    assert not (split / MANIFEST_NAME).exists()

    code, stdout, stderr = run("batch", "--report", str(split), "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["counts"]["converted"] == ITEMS and report["exit_code"] == 0
    assert stderr.startswith(f"converted {ITEMS} of {ITEMS} items (")


def _library_run(zoo: Path, out: Path, markers: Path, shard: Shard) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys, ckptconv\n"
        "from ckptconv.batching.sharding import Shard\n"
        "from tests.batch_helpers import KillAfter\n"
        "zoo, out, markers, manifest, index, count = sys.argv[1:]\n"
        "report = ckptconv.batch(zoo, out, shard=Shard(int(index), int(count)), resume=True,\n"
        "                        transforms=[KillAfter(markers, manifest, 2)])\n"
        "sys.exit(report.exit_code)\n"
    )
    manifest = out / manifest_name(shard)
    args = [str(zoo), str(out), str(markers), str(manifest), str(shard.index), str(shard.count)]
    return subprocess.run(
        [sys.executable, "-c", code, *args], check=False, env=_env(), cwd=ROOT, capture_output=True, text=True
    )


def test_a_shard_killed_half_way_converts_only_what_it_had_left_on_resume(tmp_path: Path) -> None:
    zoo = build_zoo(tmp_path / "zoo")
    out, markers = tmp_path / "out", tmp_path / "markers"
    markers.mkdir()
    shard = Shard(0, 2)
    manifest = out / manifest_name(shard)

    killed = _library_run(zoo, out, markers, shard)
    assert killed.returncode == -9, killed.stderr  # SIGKILL after two items
    first = [record["source"] for record in item_records(manifest)]
    assert len(first) == 2

    resumed = _library_run(zoo, out, markers, shard)
    assert resumed.returncode == 0, resumed.stderr
    runs = [record for record in read_records(str(manifest)) if record.get("record") == "run"]
    planned = runs[-1]["shard"]["items"]
    assert len(planned) >= 4  # the kill was half-way
    second = [record["source"] for record in item_records(manifest) if record["run"] == runs[-1]["run"]]
    assert sorted(second) == sorted(set(planned) - set(first))  # only what it had left, nothing twice

    # The other shard, then the whole: the same bytes as one process with the same options.
    assert _library_run(zoo, out, markers, Shard(1, 2)).returncode == 0
    reference = tmp_path / "one"
    one = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, ckptconv\nfrom tests.batch_helpers import KillAfter\n"
            "sys.exit(ckptconv.batch(sys.argv[1], sys.argv[2], transforms=[KillAfter(sys.argv[3], '', 2)]).exit_code)",
            str(zoo),
            str(reference),
            str(markers),
        ],
        check=False,
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert one.returncode == 0, one.stderr
    assert outputs_of(out) == outputs_of(reference)
    assert not [path for path in out.rglob("*") if path.name.endswith(".partial")]
    code, _, stderr = run("batch", "--report", str(out))
    assert code == 0, stderr


def test_two_runs_of_one_shard_are_refused_other_shards_are_not(tmp_path: Path) -> None:
    zoo = build_zoo(tmp_path / "zoo")
    out = tmp_path / "out"
    out.mkdir()
    with open(out / manifest_name(Shard(1, 2)), "ab") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running shard 1/2 holds it
        code, _, stderr = run("batch", str(zoo), str(out), "--shard", "1/2")
        assert code == 1
        assert stderr == (
            f"ckptconv: error: another ckptconv batch is writing to {str(out)!r} (its manifest is locked); "
            "wait for it to finish\n"
        )
        code, _, stderr = run("batch", str(zoo), str(out), "--shard", "0/2")
        assert code == 0, stderr
    code, _, stderr = run("batch", "--report", str(out))
    assert code == 3
    assert stderr.startswith(
        "unfinished: shard 1/2 has not run: ckptconv-manifest.shard-0001-of-0002.jsonl records no run\n"
    )


def test_report_merges_failures_and_names_shards_not_run(tmp_path: Path) -> None:
    zoo = build_zoo(tmp_path / "zoo")
    (zoo / "broken.pt").write_bytes(b"PK\x03\x04 truncated")
    out = tmp_path / "out"
    for index in range(2):
        run("batch", str(zoo), str(out), "--shard", f"{index}/2")
    code, stdout, stderr = run("batch", "--report", str(out), "--json")
    assert code == 3
    assert json.loads(stdout)["counts"]["failed"] == 1
    assert stderr.splitlines()[0].startswith("failed: broken.pt: ")
    assert stderr.splitlines()[-1].startswith(f"converted {ITEMS} of {ITEMS + 1} items (")

    os.remove(out / manifest_name(Shard(1, 2)))
    code, _, stderr = run("batch", "--report", str(out))
    assert code == 3
    assert "unfinished: shard 1/2 has not run: no ckptconv-manifest.shard-0001-of-0002.jsonl in the folder\n" in stderr

    run("batch", str(zoo), str(out), "--shard", "0/3", "--overwrite")
    assert (out / manifest_name(Shard(0, 3))).exists()
    code, _, stderr = run("batch", "--report", str(out))
    assert (code, stderr) == (  # the folder contradicts the command: a usage error, as DestinationError is
        2,
        f"ckptconv: error: {str(out)!r} holds the manifests of batches split in different ways (in 2 shards, in 3 "
        "shards); report on a folder that one of them wrote; see 'cli batch --help'\n",
    )


def test_a_killed_shard_is_reported_unfinished_and_its_items_not_converted(tmp_path: Path) -> None:
    zoo = build_zoo(tmp_path / "zoo")
    out, markers = tmp_path / "out", tmp_path / "markers"
    markers.mkdir()
    assert _library_run(zoo, out, markers, Shard(0, 1)).returncode == -9
    code, stdout, _ = run("batch", "--report", str(out), "--json")
    assert code == 3
    report = json.loads(stdout)
    assert report["counts"] == {**report["counts"], "converted": 2, "cancelled": ITEMS - 2}
    assert report["problems"][0].startswith("shard 0/1 has not finished: its latest run (")


def test_report_of_a_plain_batch(tmp_path: Path) -> None:
    zoo = build_zoo(tmp_path / "zoo")
    out = tmp_path / "out"
    assert run("batch", str(zoo), str(out))[0] == 0
    code, _, stderr = run("batch", "--report", str(out))
    assert code == 0 and stderr.startswith(f"converted {ITEMS} of {ITEMS} items (")
    code, _, stderr = run("batch", "--report", str(tmp_path / "zoo"))
    assert (code, stderr) == (
        1,
        f"ckptconv: error: {str(tmp_path / 'zoo')!r} holds no ckptconv batch manifest ({MANIFEST_NAME} or one per "
        "shard); run ckptconv batch into it first\n",
    )


def test_dry_run_prints_the_whole_plan(tmp_path: Path) -> None:
    zoo = build_zoo(tmp_path / "zoo")
    code, stdout, _ = run("batch", str(zoo), str(tmp_path / "out"), "--shard", "1/2", "--dry-run")
    assert code == 0
    lines = stdout.splitlines()
    headers = [line for line in lines if line.startswith("shard ")]
    assert [header.split(":")[0] for header in headers] == ["shard 0/2", "shard 1/2 (this one)"]
    listed = [line.strip() for line in lines if line.startswith("  ")]
    assert sorted(listed) == sorted(set(listed)) and len(listed) == ITEMS
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shard", "4/4"], "Invalid value for '--shard': shard index 4 is not in 0..3 (of 4 shards)"),
        (
            ["--shard", "1-4"],
            "Invalid value for '--shard': --shard takes INDEX/COUNT (0/4 to 3/4) or 'auto', not '1-4'",
        ),
        (["--shard", "0/0"], "Invalid value for '--shard': a batch splits into 1 to 9999 shards, not 0"),
    ],
)
def test_cli_shard_usage_errors(args: list[str], message: str, tmp_path: Path) -> None:
    code, _, stderr = run("batch", str(tmp_path), str(tmp_path / "out"), *args)
    assert code == 2
    assert stderr.splitlines()[-1] == f"ckptconv: error: {message}; see 'cli batch --help'"


def test_report_takes_only_dst(tmp_path: Path) -> None:
    code, _, stderr = run("batch", "--report", str(tmp_path), str(tmp_path / "x"))
    assert code == 2
    assert stderr.splitlines()[-1] == (
        "ckptconv: error: batch --report takes only DST, the output folder: ckptconv batch --report DST; "
        "see 'cli batch --help'"
    )


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "8"}, Shard(3, 8, "Slurm array")),
        (
            {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "4"},
            Shard(1, 4, "Slurm array"),
        ),
        (
            {
                "SLURM_ARRAY_TASK_ID": "9",
                "SLURM_ARRAY_TASK_COUNT": "4",
                "SLURM_ARRAY_TASK_MIN": "1",
                "SLURM_ARRAY_TASK_STEP": "4",
            },
            Shard(2, 4, "Slurm array"),
        ),
        ({"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}, Shard(2, 3, "torchrun")),
    ],
)
def test_shard_auto_reads_the_schedulers_variables(environ: dict[str, str], expected: Shard) -> None:
    assert parse_shard("auto", environ) == expected


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({}, "--shard auto found no Slurm array (SLURM_ARRAY_TASK_ID) or torchrun (RANK, WORLD_SIZE) variables"),
        ({"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2", "RANK": "0", "WORLD_SIZE": "2"}, "found both"),
        ({"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "1"}, "is not one of 3"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "--shard auto (torchrun): shard index 4 is not in 0..3"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x' is not a whole number"),
        ({"RANK": "\u00b2", "WORLD_SIZE": "4"}, "RANK='\u00b2' is not a whole number"),  # isdigit, not int
    ],
)
def test_shard_auto_refuses_what_it_cannot_read(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match="pass --shard") as raised:
        parse_shard("auto", environ)
    assert message in str(raised.value)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.integers(min_value=0, max_value=10**6), max_size=30),
    st.integers(min_value=1, max_value=8),
    st.randoms(use_true_random=False),
)
def test_the_assignment_is_deterministic_complete_and_balanced(sizes: list[int], count: int, order: Any) -> None:
    named = [(f"item{index:03d}", size) for index, size in enumerate(sizes)]
    owner = dict(zip([name for name, _ in named], assign(named, count)))
    shuffled = list(named)
    order.shuffle(shuffled)
    assert dict(zip([name for name, _ in shuffled], assign(shuffled, count))) == owner  # order of discovery: none
    assert all(0 <= shard < count for shard in owner.values())
    loads = [sum(size for name, size in named if owner[name] == shard) for shard in range(count)]
    # Greedy largest-first: no shard carries more than the lightest plus one item.
    assert max(loads) - min(loads) <= max(sizes, default=0)
