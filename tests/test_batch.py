"""Batch conversion: a mixed zoo of real checkpoints, resume, failures, workers, Dask, and a SIGKILL."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from torch import nn

import ckptconv
from ckptconv.batching import flow
from ckptconv.batching.executors import Job, run_job, run_local
from ckptconv.batching.manifest import MANIFEST_NAME, Manifest, read_records
from ckptconv.batching.outputs import plan_outputs
from ckptconv.options import ConversionOptions
from ckptconv.reading.discovery import Item, discover
from ckptconv.transforms.keys import Pipeline, StripPrefix

from .batch_helpers import Explode, FolderRace, KillWorker
from .conftest import (
    FIXTURES,
    assert_same_state,
    swap_after_discovery,
    tiny_state_dict,
    training_checkpoint,
    views_state,
)
from .conftest import run_cli as run
from .test_errors import _malicious_legacy, _malicious_zip, _truncated
from .test_gpu_fixtures import importable_fixture_code  # noqa: F401 - a fixture the zoo test uses

ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------
# The zoo: committed GPU-saved files plus generated ones, good, broken and malicious
# ---------------------------------------------------------------------------------------

# Items that must fail, and a phrase of their message.
ZOO_FAILURES = {
    "gpu/torchscript_model.pt": "is a TorchScript archive",
    "gpu/fsdp2_rank0_dtensor_state_dict.pt": "holds DTensor/ShardedTensor shards",
    "broken/empty.pt": "is empty (0 bytes)",
    "broken/truncated.pt": "damaged zip checkpoint",
    "broken/page.pth": "is an HTML/XML page",
    "broken/lfs.bin": "is a Git LFS pointer",
    "broken/gan.pt": "holds several sets of weights ('G', 'D'); pick one with --select",
}
# Items that must be refused as unsafe (counted apart, exit 4), and a phrase of their message.
ZOO_UNSAFE = {
    "evil/evil.pt": "calls os.system (runs processes)",
    "evil/evil_legacy.pt": "calls posix.system (runs processes)",
}

# Files that are not checkpoints, or are hidden, and must be left alone.
ZOO_IGNORED = ["README.md", "config.json", "notes.txt", ".hidden/model.pt", "plain/.model_0.pt.abcdefgh.partial"]


def build_zoo(root: Path) -> Path:
    """At least 50 items: every committed GPU fixture (nested), and generated good, broken and evil files."""
    zoo = root / "zoo"
    shutil.copytree(FIXTURES / "gpu", zoo / "gpu", ignore=shutil.ignore_patterns("*.json", "*.md"))
    for folder in ("hf_sharded_bin", "hf_sharded_safetensors"):
        for index in (FIXTURES / "gpu" / folder).glob("*.json"):
            shutil.copy(index, zoo / "gpu" / folder / index.name)
    (zoo / "gpu" / "fsdp2_dcp" / ".metadata").write_bytes((FIXTURES / "gpu" / "fsdp2_dcp" / ".metadata").read_bytes())
    for name in ("plain", "legacy", "st", "pickles", "nested/deep/er", "collide", "noext", "broken", "evil", ".hidden"):
        (zoo / name).mkdir(parents=True, exist_ok=True)
    for seed in range(10):
        state = tiny_state_dict(seed)
        if seed % 2:
            state = {f"module.{key}": value for key, value in state.items()}  # DataParallel-style
        torch.save(state, zoo / "plain" / f"model_{seed}.pt")
    for seed in range(3):
        torch.save(tiny_state_dict(10 + seed), zoo / "legacy" / f"old_{seed}.pt", _use_new_zipfile_serialization=False)
        ckptconv.save(tiny_state_dict(20 + seed), zoo / "st" / f"weights_{seed}.safetensors")
    with open(zoo / "pickles" / "arrays.pkl", "wb") as file:
        pickle.dump({"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(3)}, file, protocol=4)
    torch.save(training_checkpoint(), zoo / "nested" / "deep" / "er" / "train.pth")
    torch.save(views_state(), zoo / "nested" / "deep" / "views.pt")
    torch.save(tiny_state_dict(30), zoo / "collide" / "x.pt")
    torch.save(tiny_state_dict(31), zoo / "collide" / "x.pth")
    torch.save(tiny_state_dict(32), zoo / "noext" / "weights")  # found by content, not by name
    (zoo / "broken" / "empty.pt").write_bytes(b"")
    _truncated({}, 0.6)(zoo / "broken")
    (zoo / "broken" / "page.pth").write_bytes(b"<!DOCTYPE html><html><body>Not found</body></html>")
    (zoo / "broken" / "lfs.bin").write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 1\n")
    torch.save({"G": tiny_state_dict(0), "D": tiny_state_dict(1)}, zoo / "broken" / "gan.pt")
    _malicious_zip(zoo / "evil")
    _malicious_legacy(zoo / "evil")
    (zoo / "README.md").write_text("# My zoo\n")
    (zoo / "config.json").write_text('{"hidden_size": 8}')
    (zoo / "notes.txt").write_text("The models were trained on a Tuesday.\n")  # 'T' starts protocol-0 pickles
    torch.save(tiny_state_dict(), zoo / ".hidden" / "model.pt")
    (zoo / "plain" / ".model_0.pt.abcdefgh.partial").write_bytes(b"half a file")
    return zoo


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_zoo(tmp_path_factory.mktemp("batch"))


def _canaries(zoo: Path) -> list[Path]:
    return list(zoo.rglob("canary"))


def _reference(path: Path) -> Any:
    """The source as torch.load (trusted, weights_only=False) or pickle.load sees it."""
    if path.read_bytes()[:2] == b"\x80\x04":  # protocol 4: pickle.dump, never torch.save
        with open(path, "rb") as file:
            return pickle.load(file)  # a plain pickle of numpy arrays
    return torch.load(path, map_location="cpu", weights_only=False)


def _library_reference(path: Path) -> dict[str, torch.Tensor]:
    """A sharded checkpoint's or DCP folder's weights, read by the libraries that wrote them."""
    if path.is_dir():  # DCP: torch's own converter (it unpickles .metadata: a trusted fixture)
        import warnings

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        target = path.parent / f"{path.name}.reference.pt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_to_torch_save(str(path), str(target))
        return dict(torch.load(target, weights_only=False)["model"])
    from safetensors.torch import load_file

    index = json.loads(path.read_text())
    state: dict[str, torch.Tensor] = {}
    for name in dict.fromkeys(index["weight_map"].values()):
        shard = path.parent / name
        state.update(
            load_file(shard)
            if name.endswith(".safetensors")
            else torch.load(shard, map_location="cpu", weights_only=True)
        )
    return state


def source_digest(path: Path) -> str:
    """The sha256 the manifest records: of the file, or of a folder checkpoint's files' names and sha256s."""
    if path.is_file() and not path.name.endswith(".index.json"):
        return sha256(path)
    folder = path if path.is_dir() else path.parent
    digest = hashlib.sha256()
    for member in sorted(folder.iterdir()):
        if member.is_file() and (
            member.name == ".metadata"
            or member.suffix in (".distcp", ".safetensors", ".bin", ".pt")
            or member.name.endswith(".index.json")
        ):
            digest.update(f"{member.name}\0{sha256(member)}\n".encode())
    return digest.hexdigest()


def expected_weights(path: Path, strip: str = "") -> dict[str, torch.Tensor]:
    """What a conversion of ``path`` must hold: torch.load's tensors where ckptconv found the weights."""
    if path.is_dir() or path.name.endswith(".index.json"):
        return {
            key[len(strip) :] if strip and key.startswith(strip) else key: tensor
            for key, tensor in _library_reference(path).items()
        }
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state: Mapping[str, Any] = load_file(path)
    else:
        value = _reference(path)
        if isinstance(value, nn.Module):
            value = value.state_dict()
        where = ckptconv.open(path).select().where
        for part in where.split(".") if where else ():
            value = value[part]
        state = value
    result = {}
    for name, value in state.items():
        tensor = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
        if isinstance(tensor, torch.Tensor):
            key = name[len(strip) :] if strip and name.startswith(strip) else name
            result[key] = tensor
    return result


def assert_output_matches(source: Path, output: Path, strip: str = "") -> None:
    expected = expected_weights(source, strip)
    assert_same_state(ckptconv.load(output), expected, ordered=False)
    if output.suffix == ".safetensors":
        with safe_open(output, framework="pt") as handle:  # the real safetensors library reads it
            assert set(handle.keys()) <= set(expected)
    else:
        assert_same_state(torch.load(output, weights_only=True), expected, ordered=False)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def items_of(manifest: Path) -> list[dict[str, Any]]:
    return [record for record in read_records(str(manifest)) if record["record"] == "item"]


# ---------------------------------------------------------------------------------------
# The zoo end to end
# ---------------------------------------------------------------------------------------


@pytest.mark.usefixtures("importable_fixture_code")
def test_zoo_converts_the_good_and_records_the_bad(zoo: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    seen: list[str] = []
    report = ckptconv.batch(
        zoo, out, transforms=[StripPrefix("module")], jobs=2, progress=lambda result: seen.append(result.source)
    )

    names = [result.source for result in report.results]
    assert len(names) >= 50
    assert names == sorted(names) and sorted(seen) == names
    assert {r.source: r.error for r in report.failed}.keys() == ZOO_FAILURES.keys(), [r.error for r in report.failed]
    for result in report.failed:
        assert ZOO_FAILURES[result.source] in result.error, result.error
        assert result.error_type and "\n" not in result.error and not result.traceback
    assert {r.source: r.error for r in report.unsafe}.keys() == ZOO_UNSAFE.keys(), [r.error for r in report.unsafe]
    for result in report.unsafe:
        assert ZOO_UNSAFE[result.source] in result.error and result.error_type == "UnsafeCheckpointError"
    assert report.exit_code == 4
    assert not report.skipped and not report.cancelled
    assert not _canaries(zoo), "a malicious pickle ran"

    # Never items: shards on their own, non-checkpoints, hidden files.
    assert not any("-of-00008" in name or name.endswith(".distcp") for name in names)
    for ignored in ZOO_IGNORED:
        assert ignored not in names
    # The collision rule: both keep their full name.
    assert {r.source: r.output for r in report.results if r.source.startswith("collide/")} == {
        "collide/x.pt": "collide/x.pt.safetensors",
        "collide/x.pth": "collide/x.pth.safetensors",
    }

    for result in report.converted:
        output = out / result.outputs[0].path
        source = zoo / result.source
        if result.kind == "model":  # a Hugging Face folder (an index beside config.json): a model folder out
            assert result.output.endswith("/") and result.outputs[0].path == result.output + "model.safetensors"
            assert (out / result.output / "config.json").read_bytes() == (source / "config.json").read_bytes()
            source = next(source.glob("*.index.json"))
        else:
            assert result.output == result.outputs[0].path
        assert output.suffix == ".safetensors"
        assert_output_matches(source, output, strip="module.")
        assert result.source_sha256 == source_digest(source)
        assert result.outputs[0].sha256 == sha256(output) and result.outputs[0].size == output.stat().st_size
        assert result.tensors == len(ckptconv.load(output))
    assert {r.source for r in report.converted if r.kind == "model"} == {
        "gpu/hf_sharded_bin",
        "gpu/hf_sharded_safetensors",
    }

    # The manifest: a run record, one item record per item, an end record; the outputs and nothing else.
    records = list(read_records(str(out / MANIFEST_NAME)))
    assert [r["record"] for r in records] == ["run"] + ["item"] * len(names) + ["end"]
    assert sorted(r["source"] for r in records[1:-1]) == names
    assert records[-1]["failed"] == len(ZOO_FAILURES) and records[-1]["converted"] == len(report.converted)
    assert records[-1]["unsafe"] == len(ZOO_UNSAFE)
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert written == sorted([MANIFEST_NAME, *(o.path for r in report.converted for o in r.outputs)])


def test_sharded_and_dcp_folders_are_one_item_each(zoo: Path) -> None:
    items = {item.name: item for item in discover(zoo)}
    sharded = items["gpu/hf_sharded_safetensors/model.safetensors.index.json"]
    assert sharded.kind == "sharded"
    assert sharded.members[0] == sharded.name and len(sharded.members) == 9
    assert sharded.size == sum((zoo / member).stat().st_size for member in sharded.members)
    dcp = items["gpu/fsdp2_dcp"]
    assert dcp.kind == "dcp" and dcp.members[0] == "gpu/fsdp2_dcp/.metadata"
    assert not [name for name in items if "hf_sharded" in name and not name.endswith(".index.json")]
    planned = {plan.item.name: plan.output for plan in plan_outputs(list(items.values()), "safetensors")}
    assert planned[sharded.name] == "gpu/hf_sharded_safetensors/model.safetensors"
    assert planned["gpu/hf_sharded_bin/pytorch_model.bin.index.json"] == "gpu/hf_sharded_bin/pytorch_model.safetensors"
    assert planned["gpu/fsdp2_dcp"] == "gpu/fsdp2_dcp.safetensors"
    assert planned["gpu/timm_style_ema.pth.tar"] == "gpu/timm_style_ema.safetensors"
    assert planned["noext/weights"] == "noext/weights.safetensors"


@pytest.mark.parametrize(
    "globs, expected",
    [
        (["**/*.pth"], ["broken/page.pth", "collide/x.pth", "gpu/train_checkpoint.pth", "nested/deep/er/train.pth"]),
        (["*.pth"], []),
        (["gpu/*.pth"], ["gpu/train_checkpoint.pth"]),
        (["nested/**"], ["nested/deep/er/train.pth", "nested/deep/views.pt"]),
        (["**/*.bin"], ["broken/lfs.bin", "gpu/hf_sharded_bin/pytorch_model.bin.index.json"]),
        (["legacy/old_[01].pt", "st/*_2.*"], ["legacy/old_0.pt", "legacy/old_1.pt", "st/weights_2.safetensors"]),
    ],
)
def test_glob_selects_items(globs: list[str], expected: list[str], zoo: Path) -> None:
    assert [item.name for item in discover(zoo, globs=globs)] == expected


def test_output_collisions_are_deterministic_and_never_silent(tmp_path: Path) -> None:
    for name in ("x.pt", "x.pth", "x.pt.safetensors", "y.safetensors", "z.bin"):
        torch.save(tiny_state_dict(), tmp_path / name)
    planned = {p.item.name: (p.output, p.problem) for p in plan_outputs(discover(tmp_path), "safetensors")}
    # x.pt and x.pth collide, so both keep their full name; x.pt's full name then collides with the
    # third file's output, and those two are refused, naming each other.
    assert planned["x.pth"] == ("x.pth.safetensors", "")
    assert planned["y.safetensors"] == ("y.safetensors", "")
    assert planned["z.bin"] == ("z.safetensors", "")
    assert planned["x.pt"][1] == (
        "'x.pt' and 'x.pt.safetensors' would all be written to 'x.pt.safetensors'; "
        "rename one of them, or leave it out with --glob"
    )
    assert "'x.pt.safetensors' and 'x.pt'" in planned["x.pt.safetensors"][1]
    report = ckptconv.batch(tmp_path, tmp_path / "out")
    assert [r.source for r in report.failed] == ["x.pt", "x.pt.safetensors"]
    assert [r.error_type for r in report.failed] == ["WriteError", "WriteError"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        MANIFEST_NAME,
        "x.pth.safetensors",
        "y.safetensors",
        "z.safetensors",
    ]


def test_outputs_differing_only_in_case_collide_where_the_file_system_folds_case(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A.pt and a.pt: on macOS or Windows A.safetensors and a.safetensors are one file, so the second
    item failed as 'already exists' (or, with --overwrite, replaced the first's output while the
    manifest recorded both). Where the output folder folds case both are refused, naming each other."""
    zoo = tmp_path / "zoo"
    (zoo / "Sub").mkdir(parents=True)
    (zoo / "sub").mkdir()
    for name in ("A.pt", "a.pt", "Sub/m.pt", "sub/m.pt", "b.pt"):
        torch.save({"w": torch.ones(2)}, zoo / name)
    assert not ckptconv.batching.outputs.folds_case(str(tmp_path / "out"))  # this machine's file system keeps case
    assert not ckptconv.batch(zoo, tmp_path / "kept").failed  # so nothing collides here

    planned = {p.item.name: (p.output, p.problem) for p in plan_outputs(discover(zoo), "safetensors", fold_case=True)}
    assert planned["b.pt"] == ("b.safetensors", "")
    assert planned["A.pt"] == (
        "A.pt.safetensors",
        "'A.pt' and 'a.pt' would all be written to 'A.pt.safetensors' (names that differ only in case are one "
        "file in the output folder); rename one of them, or leave it out with --glob",
    )
    assert planned["sub/m.pt"][1].startswith("'sub/m.pt' and 'Sub/m.pt' would all be written to 'sub/m.pt.safetensors'")
    monkeypatch.setattr(flow, "folds_case", lambda path: True)
    report = ckptconv.batch(zoo, tmp_path / "out")
    assert sorted(r.source for r in report.failed) == ["A.pt", "Sub/m.pt", "a.pt", "sub/m.pt"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([MANIFEST_NAME, "b.safetensors"])


def test_an_item_that_became_a_link_out_of_the_zoo_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between discovery and conversion m.pt became a link to a file outside the source folder, which
    discovery never takes: the worker read it anyway (and put its first bytes in the error)."""
    zoo, secret = tmp_path / "zoo", tmp_path / "secret.txt"
    zoo.mkdir()
    secret.write_text("root:x:0:0")
    for name in ("a.pt", "m.pt"):
        torch.save({"w": torch.ones(2)}, zoo / name)

    def swap() -> None:
        (zoo / "m.pt").unlink()
        (zoo / "m.pt").symlink_to(secret)

    swap_after_discovery(monkeypatch, flow, swap)
    report = ckptconv.batch(zoo, tmp_path / "out")
    (failed,) = report.failed
    assert failed.source == "m.pt"
    assert failed.error == (
        f"'m.pt' is now a link that leads outside the source folder (to {str(secret)!r}); not followed"
    )
    assert "72 6f 6f 74" not in (tmp_path / "out" / MANIFEST_NAME).read_text()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([MANIFEST_NAME, "a.safetensors"])


@pytest.mark.parametrize("kind", ["file", "dcp"])
def test_an_item_swapped_for_a_link_after_the_worker_checked_it_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The worker asked discovery's rules again, then opened the item by name: swapped for a link out of
    the zoo in between, the file outside was converted (its weights in the output). Every open during the
    item now asks the read policy, which holds it to the source folder."""
    from ckptconv.batching import executors

    zoo, outside = tmp_path / "zoo", tmp_path / "outside"
    zoo.mkdir()
    outside.mkdir()
    torch.save({"w": torch.ones(2)}, zoo / "a.pt")
    secret = {"secret": torch.arange(3.0)}
    if kind == "file":
        torch.save({"w": torch.ones(2)}, zoo / "m.pt")
        torch.save(secret, outside / "m.pt")
        swapped, target = zoo / "m.pt", outside / "m.pt"
    else:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            dcp.save({"w": torch.ones(2)}, checkpoint_id=str(zoo / "m"))
            dcp.save(secret, checkpoint_id=str(outside / "m"))
        swapped, target = zoo / "m", outside / "m"  # the DCP folder itself
    prepare = executors._prepare_folder

    def swap_then_prepare(job: Any) -> Any:
        if job.item.name in ("m.pt", "m"):
            if swapped.is_dir():
                shutil.rmtree(swapped)
            else:
                swapped.unlink()
            swapped.symlink_to(target)
        return prepare(job)

    monkeypatch.setattr(executors, "_prepare_folder", swap_then_prepare)
    report = ckptconv.batch(zoo, tmp_path / "out")
    (failed,) = report.failed
    assert failed.source == ("m.pt" if kind == "file" else "m")
    read, leads_to = (swapped, target) if kind == "file" else (swapped / ".metadata", target / ".metadata")
    assert failed.error == (
        f"{str(read)!r} is a link that leads outside the source folder {str(zoo)!r} (to {str(leads_to)!r}); "
        "not followed"
    )
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([MANIFEST_NAME, "a.safetensors"])
    # Outside a batch the path a user names is theirs: the same link converts.
    assert ckptconv.load(swapped).keys() == {"secret"}


_NAMES = st.lists(
    st.builds(
        lambda folder, stem, suffix: f"{folder}{stem}{suffix}",
        st.sampled_from(["", "a/", "a/b/", "b/"]),
        st.sampled_from(["x", "x.pt", "x.pth", "model", "model.safetensors"]),
        st.sampled_from(["", ".pt", ".pth", ".bin", ".safetensors", ".pth.tar", ".tar", ".ckpt"]),
    ),
    unique=True,
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(names=_NAMES, format=st.sampled_from(["safetensors", "pt"]), seed=st.randoms())
def test_output_plans_never_share_a_path_and_ignore_order(names: list[str], format: str, seed: Any) -> None:
    items = [Item(name, f"/zoo/{name}", "file", 0, 0) for name in names]
    planned = plan_outputs(items, format)
    assert [p.item for p in planned] == items
    good = [p.output for p in planned if not p.problem]
    assert len(good) == len(set(good))
    assert all(p.output.endswith(".safetensors" if format == "safetensors" else ".pt") for p in planned)
    assert all(p.output.rsplit("/", 1)[0] == p.item.name.rsplit("/", 1)[0] for p in planned if "/" in p.item.name)
    shuffled = list(items)
    seed.shuffle(shuffled)
    assert {p.item.name: (p.output, bool(p.problem)) for p in plan_outputs(shuffled, format)} == {
        p.item.name: (p.output, bool(p.problem)) for p in planned
    }


# ---------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------


@pytest.fixture
def small_zoo(tmp_path: Path) -> Path:
    zoo = tmp_path / "zoo"
    (zoo / "a" / "b").mkdir(parents=True)
    torch.save({f"module.{k}": v for k, v in tiny_state_dict(0).items()}, zoo / "a" / "b" / "model.pth")
    torch.save(training_checkpoint(), zoo / "a" / "train.pt")
    ckptconv.save(tiny_state_dict(2), zoo / "c.safetensors")
    return zoo


def test_cli_batch_casts_and_mirrors_the_tree(small_zoo: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = run(
        "batch", str(small_zoo), str(out), "--dtype", "bf16", "--strip-prefix", "module", "--jobs", "2"
    )
    assert (code, stdout) == (0, ""), stderr
    assert stderr.startswith("converted 3 of 3 items (")
    assert stderr.endswith(f"; manifest: {out / MANIFEST_NAME}\n")
    for source, output in [
        ("a/b/model.pth", "a/b/model.safetensors"),
        ("a/train.pt", "a/train.safetensors"),
        ("c.safetensors", "c.safetensors"),
    ]:
        expected = {
            key: value.to(torch.bfloat16) if value.is_floating_point() else value
            for key, value in expected_weights(small_zoo / source, "module.").items()
        }
        assert_same_state(ckptconv.load(out / output), expected, ordered=False)


def test_cli_batch_lists_failures_and_exits_3(small_zoo: Path, tmp_path: Path) -> None:
    (small_zoo / "a" / "empty.pt").write_bytes(b"")
    out = tmp_path / "out"
    code, stdout, stderr = run("batch", str(small_zoo), str(out), "--to", "pt")
    assert code == 3 and stdout == ""
    lines = stderr.splitlines()
    empty = str(small_zoo / "a" / "empty.pt")
    assert lines[0] == (  # a converted item's wrapper, named with its flag (issue 40)
        "note: a/b/model.pth: every key starts with 'module.' (DataParallel/DDP); pass --strip-prefix module or "
        "--canonical to remove it"
    )
    assert lines[1] == f"failed: a/empty.pt: {empty!r} is empty (0 bytes); the download or save did not finish"
    assert lines[2].startswith("converted 3 of 4 items (") and lines[2].endswith(
        "); 1 failed; manifest: " + str(out / MANIFEST_NAME)
    )
    assert len(lines) == 3
    assert_same_state(
        torch.load(out / "a" / "b" / "model.pt", weights_only=True),
        expected_weights(small_zoo / "a" / "b" / "model.pth"),
        ordered=False,
    )


def test_cli_dry_run_writes_nothing(small_zoo: Path, tmp_path: Path) -> None:
    code, stdout, stderr = run("batch", str(small_zoo), str(tmp_path / "out"), "--dry-run")
    assert code == 0
    assert stdout.splitlines() == [
        "a/b/model.pth -> a/b/model.safetensors",
        "a/train.pt -> a/train.safetensors",
        "c.safetensors -> c.safetensors",
    ]
    assert stderr == "would convert 3 of 3 items; nothing was written\n"
    assert not (tmp_path / "out").exists()


def test_cli_fail_fast_cancels_the_rest(small_zoo: Path, tmp_path: Path) -> None:
    (small_zoo / "a" / "a_broken.pt").write_bytes(b"<html></html>")
    code, _, stderr = run("batch", str(small_zoo), str(tmp_path / "out"), "--fail-fast", "-j", "1")
    assert code == 3
    assert "stopped after the first failure (--fail-fast); 3 items were not started" in stderr
    assert [r["source"] for r in items_of(tmp_path / "out" / MANIFEST_NAME)] == ["a/a_broken.pt"]


def test_fail_fast_with_workers_cancels_what_has_not_started(tmp_path: Path) -> None:
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (zoo / "a_broken.pt").write_bytes(b"")
    for index in range(12):
        torch.save(tiny_state_dict(index), zoo / f"m{index:02}.pt")
    report = ckptconv.batch(zoo, tmp_path / "out", jobs=2, fail_fast=True)
    assert [r.source for r in report.failed] == ["a_broken.pt"] and report.exit_code == 3
    assert report.cancelled and len(report.converted) + len(report.cancelled) == 12
    recorded = [r["source"] for r in items_of(tmp_path / "out" / MANIFEST_NAME)]
    assert sorted(recorded) == sorted(r.source for r in report.results if r.status != "cancelled")
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == sorted(
        r.output for r in report.converted
    )


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--scheduler", "tcp://127.0.0.1:1"], 2, "ckptconv: error: --scheduler needs --executor dask; see "),
        (["--jobs", "0"], 2, "0 is not in the range x>=1"),
        (["--to", "onnx"], 2, "Invalid value for '--to'"),
    ],
)
def test_cli_usage_errors(args: list[str], code: int, message: str, small_zoo: Path, tmp_path: Path) -> None:
    result = run("batch", str(small_zoo), str(tmp_path / "out"), *args)
    assert result[0] == code and message in result[2]
    assert not (tmp_path / "out").exists()


def test_cli_errors_before_starting_are_one_line(small_zoo: Path, tmp_path: Path) -> None:
    assert run("batch", str(tmp_path / "nope"), str(tmp_path / "out")) == (
        1,
        "",
        f"ckptconv: error: {str(tmp_path / 'nope')!r} does not exist; check the path\n",
    )
    assert run("batch", str(small_zoo), str(small_zoo)) == (
        1,
        "",
        f"ckptconv: error: the output folder {str(small_zoo)!r} is the source folder; choose another one\n",
    )
    assert run("batch", str(tmp_path / "empty_dir_missing"), str(tmp_path / "out"))[0] == 1
    (tmp_path / "nothing").mkdir()
    assert run("batch", str(tmp_path / "nothing"), str(tmp_path / "out")) == (
        0,
        "",
        f"found no checkpoints under {str(tmp_path / 'nothing')!r}\n",
    )


def test_output_folder_inside_the_source_is_not_searched(small_zoo: Path) -> None:
    out = small_zoo / "converted"
    assert ckptconv.batch(small_zoo, out).exit_code == 0
    again = ckptconv.batch(small_zoo, out, resume=True)
    assert [r.source for r in again.results] == ["a/b/model.pth", "a/train.pt", "c.safetensors"]
    assert len(again.skipped) == 3


def test_an_output_folder_under_the_source_that_is_a_link_out_of_it_is_written_and_read_back(tmp_path: Path) -> None:
    """SRC/out a link to a scratch disk: the read policy's source-folder rule (read_policy.confined) held the
    batch's own outputs to SRC when convert read them back to verify them, and refused every item ("is a
    link that leads outside the source folder"), where the batch converted them before."""
    from safetensors.torch import load_file

    zoo, scratch = tmp_path / "zoo", tmp_path / "scratch"
    zoo.mkdir()
    scratch.mkdir()
    state = {"w": torch.arange(6.0).reshape(2, 3), "i": torch.tensor([3, -1])}
    torch.save(state, zoo / "m.pt")
    (zoo / "out").symlink_to(scratch)
    report = ckptconv.batch(zoo, zoo / "out")
    assert [(r.source, r.status, r.error) for r in report.results] == [("m.pt", "converted", "")]
    written = load_file(scratch / "m.safetensors")
    expected = torch.load(zoo / "m.pt", weights_only=True)
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)


def test_the_source_folder_rule_leaves_out_only_an_output_folder_inside_the_source(tmp_path: Path) -> None:
    """An output folder above SRC (``batch zoo .``) must not take SRC's own files out of the rule."""
    from ckptconv.reading import read_policy

    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (tmp_path / "secret.txt").write_text("secret")
    (zoo / "m.pt").symlink_to(tmp_path / "secret.txt")
    said = (
        f"{str(zoo / 'm.pt')!r} is a link that leads outside the source folder {str(zoo)!r} "
        f"(to {str(tmp_path / 'secret.txt')!r}); not followed"
    )
    for output in (tmp_path, tmp_path / "out", zoo / "out"):
        with read_policy.confined(str(zoo), output=str(output)), pytest.raises(ckptconv.LoadError) as caught:
            read_policy.check_file(str(zoo / "m.pt"))
        assert str(caught.value) == said
    (zoo / "out").symlink_to(tmp_path)  # the batch's own outputs, wherever the folder leads
    with read_policy.confined(str(zoo), output=str(zoo / "out")):
        read_policy.check_file(str(zoo / "out" / "secret.txt"))


# ---------------------------------------------------------------------------------------
# Resume and the manifest
# ---------------------------------------------------------------------------------------


def test_resume_skips_what_is_done_and_redoes_what_changed(small_zoo: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    manifest = out / MANIFEST_NAME
    first = ckptconv.batch(small_zoo, out)
    assert len(first.converted) == 3 and len(items_of(manifest)) == 3

    again = ckptconv.batch(small_zoo, out, resume=True)
    assert [r.status for r in again.results] == ["skipped"] * 3 and again.exit_code == 0
    assert again.results[0].outputs == first.results[0].outputs  # the record's outputs and digests
    assert len(items_of(manifest)) == 3

    # Touched but unchanged (mtime differs, sha256 matches): still done.
    os.utime(small_zoo / "c.safetensors", ns=(1, 1))
    # Changed content: converted again. A deleted output: converted again.
    torch.save(tiny_state_dict(7), small_zoo / "a" / "train.pt")
    (out / "a" / "b" / "model.safetensors").unlink()
    third = ckptconv.batch(small_zoo, out, resume=True)
    assert {r.source: r.status for r in third.results} == {
        "a/b/model.pth": "converted",
        "a/train.pt": "converted",
        "c.safetensors": "skipped",
    }
    assert_output_matches(small_zoo / "a" / "train.pt", out / "a" / "train.safetensors")

    # Other options make other bytes: resuming with them is refused (issue 14), --overwrite redoes all.
    with pytest.raises(ckptconv.DestinationError, match=r"^cannot resume: 3 items in .* other options"):
        ckptconv.batch(small_zoo, out, resume=True, transforms=[ckptconv.Cast("fp16")])
    fourth = ckptconv.batch(small_zoo, out, resume=True, overwrite=True, transforms=[ckptconv.Cast("fp16")])
    assert len(fourth.converted) == 3
    assert ckptconv.load(out / "c.safetensors")["conv.weight"].dtype == torch.float16

    # Without --resume existing outputs stop the batch before it starts, pointing to --resume, not an overwrite.
    (out / "c.safetensors").unlink()
    with pytest.raises(ckptconv.DestinationError) as caught:
        ckptconv.batch(small_zoo, out)
    assert str(caught.value) == (
        f"2 of 3 outputs exist already in {str(out)!r} (e.g. 'a/b/model.safetensors'; a batch ran there before); "
        "pass --resume to skip what it converted, or --overwrite to convert them again"
    )
    assert len(ckptconv.batch(small_zoo, out, overwrite=True).converted) == 3


@pytest.mark.parametrize("forged", ["outside", "absolute", "link", "other-bytes", "other-output"])
def test_resume_trusts_only_outputs_inside_dst_with_their_recorded_size_and_digest(
    small_zoo: Path, tmp_path: Path, forged: str
) -> None:
    """A record whose outputs are not this item's file in DST (with its size and sha256) vouches for nothing."""
    out = tmp_path / "out"
    code, _, _ = run("batch", str(small_zoo), str(out), "--glob", "c.safetensors")
    assert code == 0
    real = out / "c.safetensors"
    decoy = tmp_path / "elsewhere" / "c.safetensors"  # the same bytes, outside DST
    decoy.parent.mkdir()
    shutil.copyfile(real, decoy)
    lines = (out / MANIFEST_NAME).read_text().splitlines(keepends=True)
    records = [json.loads(line) for line in lines]
    (item,) = [r for r in records if r["record"] == "item"]
    if forged == "outside":
        item["outputs"][0]["path"] = "../elsewhere/c.safetensors"
        real.unlink()
    elif forged == "absolute":
        item["outputs"][0]["path"] = str(decoy)
        real.unlink()
    elif forged == "link":
        real.unlink()
        real.symlink_to(decoy)
    elif forged == "other-bytes":  # same size, other content: the recorded sha256 says so
        assert item["outputs"][0]["sha256"]
        data = bytearray(real.read_bytes())
        data[-1] ^= 0xFF
        real.write_bytes(bytes(data))
    else:  # the output of another item, existing in DST: not this item's output
        shutil.copyfile(decoy, out / "other.safetensors")
        item["outputs"][0]["path"] = "other.safetensors"
        real.unlink()
    (out / MANIFEST_NAME).write_text("".join(json.dumps(r) + "\n" for r in records))
    code, _, stderr = run("batch", str(small_zoo), str(out), "--glob", "c.safetensors", "--resume")
    assert code == 0
    assert stderr.splitlines()[-1].startswith("converted 1 of 1 item (")
    assert not real.is_symlink()
    assert_output_matches(small_zoo / "c.safetensors", real)
    assert decoy.read_bytes() == (out / "c.safetensors").read_bytes() or forged == "other-bytes"


def test_batch_refuses_a_zoo_with_a_folder_it_cannot_list(tmp_path: Path) -> None:
    """A checkpoint 25 folders of 200 characters down (deeper than PATH_MAX): batch said "found no
    checkpoints" and exit 0; the folder it cannot list is named, and nothing is converted."""
    from .test_scan import _deep_folder

    zoo = tmp_path / "zoo"
    zoo.mkdir()
    names = _deep_folder(zoo)
    real = os.path.realpath(zoo)
    depth = next(i for i in range(1, len(names) + 1) if len(os.path.join(real, *names[:i])) >= 4096)
    code, _, stderr = run("batch", str(zoo), str(tmp_path / "out"))
    assert code == 1
    (line,) = stderr.splitlines()  # one line; the CLI shortens its middle, the folder is whole in the error
    assert line.startswith(f"ckptconv: error: {'/'.join(names[:depth])[:1000]}".replace(": a", ": 'a", 1))
    assert line.endswith(
        f" in {str(zoo)!r} cannot be listed (File name too long); what it holds would be missed, so stopping "
        "(move it higher up, or fix its permissions)"
    )
    with pytest.raises(ckptconv.LoadError) as caught:
        ckptconv.batch(zoo, tmp_path / "out")
    assert caught.value.path == os.path.join(real, *names[:depth])
    assert not (tmp_path / "out").exists()


def test_a_failing_items_cleanup_never_removes_a_folder_a_sibling_writes_into(tmp_path: Path) -> None:
    """``batch --jobs 2``: a failing item removed the output folder it had made while another worker was about
    to write into it, which failed with "folder ... does not exist; create it first" (see FolderRace)."""
    zoo = tmp_path / "zoo"
    (zoo / "m").mkdir(parents=True)
    for name, key in (("l", "l"), ("m/a", "w"), ("m/b", "f"), ("n", "n")):
        torch.save({key: torch.ones(2)}, zoo / f"{name}.pt")
    out, markers = tmp_path / "out", tmp_path / "markers"
    markers.mkdir()
    report = ckptconv.batch(zoo, out, jobs=2, transforms=[FolderRace(str(markers), str(out / "m"))])
    assert {r.source: (r.status, r.error.split(": ")[-1][:4]) for r in report.results} == {
        "l.pt": ("converted", ""),
        "m/a.pt": ("converted", ""),
        "m/b.pt": ("failed", "boom"),
        "n.pt": ("converted", ""),
    }
    assert_output_matches(zoo / "m" / "a.pt", out / "m" / "a.safetensors")
    # The folder only a failed item needed is still removed, once no item uses it.
    (zoo / "m" / "a.pt").unlink()
    report = ckptconv.batch(zoo, tmp_path / "out2", jobs=2, transforms=[FolderRace(str(markers), "", 0.1)])
    assert [r.source for r in report.failed] == ["m/b.pt"]
    assert not (tmp_path / "out2" / "m").exists()


def test_a_torn_manifest_line_is_ignored_and_repaired(small_zoo: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    ckptconv.batch(small_zoo, out, glob="a/**")
    with open(out / MANIFEST_NAME, "ab") as file:
        file.write(b'{"record":"item","source":"c.safetensors","status":"conv')  # killed mid-write
    report = ckptconv.batch(small_zoo, out, resume=True)
    assert {r.source: r.status for r in report.results} == {
        "a/b/model.pth": "skipped",
        "a/train.pt": "skipped",
        "c.safetensors": "converted",
    }
    lines = (out / MANIFEST_NAME).read_bytes().splitlines()
    assert lines[-1].startswith(b'{"record":"end"') and sum(1 for line in lines if b"conv" in line[-5:]) == 1
    assert [r["source"] for r in items_of(out / MANIFEST_NAME)] == ["a/b/model.pth", "a/train.pt", "c.safetensors"]


def test_resume_replaces_what_a_killed_run_wrote_but_did_not_record(small_zoo: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    ckptconv.batch(small_zoo, out)
    # As if killed after c.safetensors was renamed into place but before its record was written,
    # and while another output was still a hidden .partial file.
    lines = (out / MANIFEST_NAME).read_bytes().splitlines(keepends=True)
    (out / MANIFEST_NAME).write_bytes(b"".join(line for line in lines if b'"c.safetensors"' not in line))
    (out / "c.safetensors").write_bytes(b"not what the batch would write")
    (out / ".c.safetensors.k3j9x_2a.partial").write_bytes(b"half")
    (out / ".c.safetensors.keep.me").write_bytes(b"not ours")
    report = ckptconv.batch(small_zoo, out, resume=True)
    assert {r.source: r.status for r in report.results} == {
        "a/b/model.pth": "skipped",
        "a/train.pt": "skipped",
        "c.safetensors": "converted",
    }
    assert_output_matches(small_zoo / "c.safetensors", out / "c.safetensors")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".c.safetensors.keep.me"]
    assert [r["source"] for r in items_of(out / MANIFEST_NAME)] == ["a/b/model.pth", "a/train.pt", "c.safetensors"]


def test_one_batch_per_output_folder(tmp_path: Path) -> None:
    path = str(tmp_path / MANIFEST_NAME)
    first, second = Manifest(path, run="a", fingerprint="f"), Manifest(path, run="b", fingerprint="f")
    busy = r"another ckptconv batch is writing to .*; wait for it to finish"
    with first, pytest.raises(ckptconv.WriteError, match=busy), second:  # the lock is taken on entering
        pass
    with Manifest(path, run="c", fingerprint="f") as manifest:  # released
        manifest.append("run", {})


# ---------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------


def _job(zoo: Path, out: Path, name: str, *steps: Any) -> Job:
    item = next(item for item in discover(zoo) if item.name == name)
    output = name.rsplit(".", 1)[0] + ".safetensors"
    return Job(item, str(out / output), output, ConversionOptions(to="safetensors", transforms=Pipeline.of(steps)))


def test_a_worker_never_raises(small_zoo: Path, tmp_path: Path) -> None:
    result = run_job(_job(small_zoo, tmp_path, "c.safetensors", Explode()))
    assert result.status == "failed" and result.error_type == "builtins.RuntimeError"
    assert result.error.startswith("unexpected RuntimeError while converting 'c.safetensors': boom (a bug in ckptconv")
    assert "Traceback (most recent call last)" in result.traceback and "boom" in result.traceback
    assert not (tmp_path / "c.safetensors").exists()


def test_a_dying_worker_fails_only_its_own_item(small_zoo: Path, tmp_path: Path) -> None:
    jobs = [
        _job(small_zoo, tmp_path, "a/b/model.pth"),
        _job(small_zoo, tmp_path, "a/train.pt", KillWorker()),
        _job(small_zoo, tmp_path, "c.safetensors"),
    ]
    results = {result.source: result for result in run_local(jobs, workers=2)}
    assert results["a/train.pt"].error_type == "WorkerDied"
    assert results["a/train.pt"].error.startswith("the worker process died while converting it")
    assert results["a/b/model.pth"].status == results["c.safetensors"].status == "converted"
    assert_output_matches(small_zoo / "c.safetensors", tmp_path / "c.safetensors")


def test_the_library_api(small_zoo: Path, tmp_path: Path) -> None:
    for module in ("batching.flow", "reading.discovery", "batching.executors", "batching.manifest", "batching.report"):
        importlib.import_module(f"ckptconv.{module}")
    assert inspect.isfunction(ckptconv.batch)  # no submodule shadows the function
    parameters = list(inspect.signature(ckptconv.batch).parameters.values())
    assert [p.name for p in parameters[:2]] == ["source_dir", "output_dir"]
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in parameters[2:])
    with pytest.raises(TypeError):
        ckptconv.batch(small_zoo, tmp_path / "out", ckptconv.ConversionOptions())  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"^batch\(\) got an unexpected keyword argument 'tranforms'$"):
        ckptconv.batch(small_zoo, tmp_path / "out", tranforms=[])
    with pytest.raises(ValueError, match="executor must be one of local, dask"):
        ckptconv.batch(small_zoo, tmp_path / "out", executor="ray")
    report = ckptconv.batch(small_zoo, tmp_path / "out", checksums=False, fsync=False)
    assert isinstance(report, ckptconv.BatchReport) and isinstance(report.results[0], ckptconv.ItemResult)
    assert report.results[0].source_sha256 is None and report.results[0].outputs[0].sha256 is None
    assert report.summary().startswith("converted 3 of 3 items (")


def test_progress_bar_goes_to_stderr(small_zoo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckptconv.batch(small_zoo, tmp_path / "out", progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "ckptconv batch: 100%" in captured.err and "3/3 items" in captured.err


# ---------------------------------------------------------------------------------------
# Dask
# ---------------------------------------------------------------------------------------


def test_dask_local_cluster_runs_the_batch(small_zoo: Path, tmp_path: Path) -> None:
    distributed = pytest.importorskip("distributed")
    (small_zoo / "bad.pt").write_bytes(b"\x80\x02cos\nsystem\nq\x00.")
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None
    ) as cluster:
        assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
        code, _, stderr = run(
            "batch",
            str(small_zoo),
            str(tmp_path / "out"),
            "--executor",
            "dask",
            "--scheduler",
            cluster.scheduler_address,
            "--strip-prefix",
            "module",
        )
    assert code == 4, stderr  # an unsafe item: as scan exits
    assert "unsafe: bad.pt:" in stderr and "calls os.system (runs processes)" in stderr
    assert "converted 3 of 4 items (" in stderr and "; 1 unsafe (not converted); manifest: " in stderr
    for source, output in [
        ("a/b/model.pth", "a/b/model.safetensors"),
        ("a/train.pt", "a/train.safetensors"),
        ("c.safetensors", "c.safetensors"),
    ]:
        assert_output_matches(small_zoo / source, tmp_path / "out" / output, strip="module.")
    assert len(items_of(tmp_path / "out" / MANIFEST_NAME)) == 4


def test_dask_missing_is_a_clear_error(small_zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "distributed", None)
    code, _, stderr = run("batch", str(small_zoo), str(tmp_path / "out"), "--executor", "dask")
    assert (code, stderr) == (
        1,
        "ckptconv: error: the dask executor needs the 'distributed' package; "
        "install it with: pip install 'ckptconv[dask]'\n",
    )


# ---------------------------------------------------------------------------------------
# SIGKILL part-way, then --resume
# ---------------------------------------------------------------------------------------


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_sigkill_then_resume_converts_every_item_exactly_once(tmp_path: Path) -> None:
    zoo = tmp_path / "zoo"
    for index in range(24):
        folder = zoo / f"run{index % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(index)
        torch.save(
            {"module.w": torch.randn(768, 1024), "module.n": torch.arange(index + 1)}, folder / f"ckpt_{index}.pt"
        )
    out = tmp_path / "out"
    manifest = out / MANIFEST_NAME
    command = [
        sys.executable,
        "-m",
        "ckptconv",
        "batch",
        str(zoo),
        str(out),
        "--jobs",
        "2",
        "--verify",
        "--strip-prefix",
        "module",
    ]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, cwd=ROOT)
    deadline = time.monotonic() + 60
    workers: set[int] = set()
    while time.monotonic() < deadline and len(items_of(manifest)) < 4:
        workers |= _descendants(process.pid)
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    process.wait()
    done_before = len(items_of(manifest))
    print(
        f"killed after {done_before} of 24 items; in the folder:",
        sorted(p.name for p in out.rglob("*") if p.is_file() and p.name != MANIFEST_NAME),
    )
    assert 4 <= done_before < 24, "the batch was not killed part-way; make its items bigger"
    assert not [r for r in read_records(str(manifest)) if r["record"] == "end"]
    # Its workers notice and exit (they would otherwise finish items nobody records).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in workers):
        time.sleep(0.05)
    if Path(f"/proc/self/task/{os.getpid()}/children").exists():  # CONFIG_PROC_CHILDREN
        assert workers and not [
            pid
            for pid in workers
            if Path(f"/proc/{pid}/status").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()
        ]

    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True, cwd=ROOT, check=False)
    assert resumed.returncode == 0, resumed.stderr
    assert (
        f"converted {24 - done_before} of 24 items" in resumed.stderr and f"; {done_before} skipped" in resumed.stderr
    )

    records = items_of(manifest)
    assert sorted(r["source"] for r in records) == sorted(f"run{i % 4}/ckpt_{i}.pt" for i in range(24))
    assert all(r["status"] == "converted" for r in records)
    for record in records:
        output = out / record["output"]
        assert record["outputs"] == [
            {"path": record["output"], "size": output.stat().st_size, "sha256": sha256(output)}
        ]
        assert record["source_sha256"] == sha256(zoo / record["source"])
        assert_output_matches(zoo / record["source"], output, strip="module.")
    leftovers = [
        p.name for p in out.rglob("*") if p.is_file() and p.name != MANIFEST_NAME and p.suffix != ".safetensors"
    ]
    assert leftovers == []
    assert len(list(out.rglob("*.safetensors"))) == 24


def test_bench_script_runs(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_batch.py"), "--smoke", "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert figures["jobs"]["1"]["items_per_s"] > 0
    # per_item_ms is a difference of two timings (9 items minus 3): on a loaded machine it can come out
    # negative, so only check that it was computed (speed is judged in bench/, never in a test).
    assert math.isfinite(figures["tiny"]["per_item_ms"]["1"])
