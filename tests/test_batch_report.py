"""batch's report: unsafe items counted apart (exit 4), every item's source sha256, --json, and a Dask
scheduler without workers (issue 40, item 4)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
import torch

import ckptconv
from ckptconv.batching.manifest import MANIFEST_NAME, read_records

from .conftest import run_cli as run
from .conftest import tiny_state_dict, training_checkpoint
from .test_errors import _malicious_zip


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def zoo(tmp_path: Path) -> Path:
    """Three good items, a malicious pickle (it would run os.system under torch.load) and an empty file."""
    zoo = tmp_path / "zoo"
    (zoo / "a" / "b").mkdir(parents=True)
    torch.save({f"module.{k}": v for k, v in tiny_state_dict(0).items()}, zoo / "a" / "b" / "model.pth")
    torch.save(training_checkpoint(), zoo / "a" / "train.pt")
    ckptconv.save(tiny_state_dict(2), zoo / "c.safetensors")
    _malicious_zip(zoo)  # zoo/evil.pt, and zoo/canary if it ever ran
    (zoo / "a" / "empty.pt").write_bytes(b"")
    return zoo


def _items(out: Path) -> dict[str, dict[str, object]]:
    return {r["source"]: r for r in read_records(str(out / MANIFEST_NAME)) if r["record"] == "item"}


def test_cli_batch_counts_an_unsafe_item_apart_and_exits_4(zoo: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = run("batch", str(zoo), str(out))
    assert (code, stdout) == (4, ""), stderr
    notes = [line for line in stderr.splitlines() if line.startswith("note: ")]
    assert notes == [  # the converted item's wrapper, named with its flag
        "note: a/b/model.pth: every key starts with 'module.' (DataParallel/DDP); pass --strip-prefix module or "
        "--canonical to remove it"
    ]
    lines = [line for line in stderr.splitlines() if not line.startswith("note: ")]
    assert len(lines) == 3, lines
    # (The reader's own sentence follows; test_errors holds it to its words.)
    assert lines[0].startswith(f"unsafe: evil.pt: {zoo / 'evil.pt'} calls os.system (runs processes) ")
    empty = str(zoo / "a" / "empty.pt")
    assert lines[1] == f"failed: a/empty.pt: {empty!r} is empty (0 bytes); the download or save did not finish"
    assert lines[2].startswith("converted 3 of 5 items (")
    assert lines[2].endswith(f"); 1 unsafe (not converted), 1 failed; manifest: {out / MANIFEST_NAME}")
    assert not (zoo / "canary").exists()
    assert not (out / "evil.safetensors").exists()

    items = _items(out)
    assert items["evil.pt"]["status"] == "unsafe" and items["evil.pt"]["error_type"] == "UnsafeCheckpointError"
    assert items["a/empty.pt"]["status"] == "failed"
    # Every item's source digest, the unsafe and failed ones' too, by hashlib on the bytes.
    for source, record in items.items():
        assert record["source_sha256"] == _sha256(zoo / source), source
    end = next(r for r in read_records(str(out / MANIFEST_NAME)) if r["record"] == "end")
    assert (end["converted"], end["failed"], end["unsafe"]) == (3, 1, 1)


def test_an_unsafe_item_makes_the_library_report_exit_4(zoo: Path, tmp_path: Path) -> None:
    (zoo / "a" / "empty.pt").unlink()
    report = ckptconv.batch(zoo, tmp_path / "out", jobs=2)
    assert [r.source for r in report.unsafe] == ["evil.pt"] and not report.failed, report.results
    assert report.exit_code == 4 and report.unsafe[0].source_sha256 == _sha256(zoo / "evil.pt")
    assert report.summary().endswith("; 1 unsafe (not converted)")
    # Without checksums, no digest is taken for anyone.
    report = ckptconv.batch(zoo, tmp_path / "out2", checksums=False)
    assert all(r.source_sha256 is None for r in report.results)


def test_cli_batch_json_prints_the_report_on_stdout(zoo: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = run("batch", str(zoo), str(out), "--json", "-q")
    assert code == 4
    report = json.loads(stdout)
    assert report["exit_code"] == 4 and report["manifest"] == str(out / MANIFEST_NAME)
    assert report["counts"] == {
        "items": 5,
        "converted": 3,
        "failed": 1,
        "unsafe": 1,
        "skipped": 0,
        "cancelled": 0,
        "planned": 0,
    }
    by_source = {item["source"]: item for item in report["items"]}
    assert set(by_source) == set(_items(out))
    for source, item in by_source.items():
        manifest = _items(out)[source]
        assert {k: manifest[k] for k in item} == item, source  # the manifest's records, the run's fields aside
    assert by_source["evil.pt"]["status"] == "unsafe"
    # The errors still go to stderr, even with -q.
    assert stderr.splitlines()[0].startswith(f"unsafe: evil.pt: {zoo / 'evil.pt'} calls os.system ")


def test_cli_batch_json_dry_run(zoo: Path, tmp_path: Path) -> None:
    code, stdout, stderr = run("batch", str(zoo), str(tmp_path / "out"), "--json", "--dry-run")
    assert code == 0, stderr
    report = json.loads(stdout)  # the listing is in the JSON, not printed beside it
    assert report["dry_run"] is True and report["manifest"] is None and report["counts"]["planned"] == 5
    assert stderr == "would convert 5 of 5 items; nothing was written\n"
    assert not (tmp_path / "out").exists()


def test_dask_scheduler_without_workers_gives_up_after_the_timeout(zoo: Path, tmp_path: Path) -> None:
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=0, processes=True, host="127.0.0.1", dashboard_address=None) as cluster:
        address = cluster.scheduler_address
        started = time.monotonic()
        code, stdout, stderr = run(
            "batch",
            str(zoo),
            str(tmp_path / "out"),
            "--executor",
            "dask",
            "--scheduler",
            address,
            "--scheduler-timeout",
            "2",
        )
        waited = time.monotonic() - started
    assert (code, stdout) == (1, "")
    assert stderr.splitlines() == [
        f"connecting to the Dask scheduler at {address} (waiting up to 2 s for a worker; --scheduler-timeout)",
        f"ckptconv: error: no Dask worker joined the scheduler at {address!r} within 2 s; start workers "
        f"(dask worker {address}) or pass a longer --scheduler-timeout",
    ]
    assert 2 <= waited < 30
    assert not (tmp_path / "out").exists()  # refused before the output folder or its manifest was made


def test_scheduler_timeout_must_be_positive(zoo: Path, tmp_path: Path) -> None:
    code, _, stderr = run("batch", str(zoo), str(tmp_path / "out"), "--scheduler-timeout", "0")
    assert code == 2 and "Invalid value for '--scheduler-timeout': 0.0 is not in the range x>0" in stderr
    with pytest.raises(ValueError, match="scheduler_timeout must be more than 0 seconds, not 0"):
        ckptconv.batch(zoo, tmp_path / "out", scheduler_timeout=0)
