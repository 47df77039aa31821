"""Manifest: the append-only record of a batch, and what ``resume`` trusts.

``<output>/ckptconv-manifest.jsonl`` holds one JSON object per line. Each run
appends a ``"run"`` record (its options), one ``"item"`` record per item it
converted or failed, as soon as that item finishes, and an ``"end"`` record
with the counts. Every record is flushed and fsynced before the next item is
recorded, so a crash or a SIGKILL loses nothing that had finished; a line torn
by a crash mid-write is ignored when the file is read back.

Only the process that runs the batch writes the manifest (workers return their
results to it), and it holds an exclusive lock on the file for the whole run,
so two batches can never write into one output folder at once.

An item record (``schema`` 1)::

    {"record": "item", "schema": 1, "run": "20261130T101500Z-3f2a", "finished_at": "2026-11-30T10:15:02Z",
     "source": "a/b/model.pth", "kind": "file", "status": "converted",
     "source_size": 5200, "source_mtime_ns": 1764..., "source_sha256": "9f86...",
     "source_format": "torch-zip", "format": "safetensors", "output": "a/b/model.safetensors",
     "outputs": [{"path": "a/b/model.safetensors", "size": 4410, "sha256": "2c26..."}],
     "tensors": 9, "bytes": 4096, "error": null, "error_type": null, "notes": [...],
     "duration_s": 0.012, "options": "5e1f0c2a9b7d4e31", "ckptconv_version": "0.1.0"}

``options`` is a fingerprint of everything that changes an output's bytes
(the selection, the transforms, the output format, ``trust``).
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

from ckptconv._version import __version__
from ckptconv.batching.report import CONVERTED, ItemResult
from ckptconv.errors import LoadError, WriteError
from ckptconv.reading import read_policy
from ckptconv.writing import write_policy

__all__ = ["MANIFEST_NAME", "Manifest", "latest_conversions", "read_records"]

MANIFEST_NAME = "ckptconv-manifest.jsonl"
SCHEMA = 1


def now() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def read_records(path: str) -> Iterator[dict[str, Any]]:
    """Every complete record in a manifest; a missing file has none, torn lines are skipped."""
    if not os.path.lexists(path):
        return
    write_policy.check_not_a_link(path)
    try:
        file = read_policy.open_file(path)
    except LoadError as error:
        raise WriteError(f"cannot use the manifest: {error}", path=path) from None
    with file:
        for line in file:
            if not line.endswith(b"\n"):
                continue  # the last line of a run that was killed mid-write
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record


def latest_conversions(path: str) -> dict[str, dict[str, Any]]:
    """For each source, its latest ``"converted"`` item record (what ``resume`` checks)."""
    latest: dict[str, dict[str, Any]] = {}
    for record in read_records(path):
        if record.get("record") == "item" and record.get("status") == CONVERTED and "source" in record:
            latest[str(record["source"])] = record
    return latest


class Manifest:
    """An open manifest: appends records durably, under an exclusive lock.

    Use it as a context manager; :meth:`append` writes one record.

    Raises:
        WriteError: the file cannot be opened, or another batch holds its lock.
    """

    def __init__(self, path: str, *, run: str, fingerprint: str) -> None:
        self.path = path
        self.run = run
        self.fingerprint = fingerprint
        self._file: BinaryIO | None = None

    def __enter__(self) -> Manifest:
        # Never through a link, never a FIFO: see ckptconv.writing.write_policy.
        file = write_policy.open_append(self.path)
        try:
            _lock(file, self.path)
            # A run that was killed mid-line leaves a torn last line; start on a fresh one.
            end = os.fstat(file.fileno()).st_size
            if end > 0 and os.pread(file.fileno(), 1, end - 1) != b"\n":
                file.write(b"\n")
        except BaseException:
            file.close()
            raise
        self._file = file
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def append(self, kind: str, fields: Mapping[str, Any]) -> None:
        """Write one record and make it durable before returning."""
        if self._file is None:
            raise RuntimeError("use Manifest as a context manager: with Manifest(...) as manifest")
        record = {"record": kind, "schema": SCHEMA, "run": self.run, **fields}
        if kind == "item":
            record.update(finished_at=now(), options=self.fingerprint, ckptconv_version=__version__)
        try:
            data = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        except UnicodeEncodeError:
            # A file name that is not UTF-8 (or a lone surrogate in a name): JSON's \udcXX
            # escapes keep it exact, and json.loads gives back the same str.
            data = (json.dumps(record, ensure_ascii=True, separators=(",", ":")) + "\n").encode("ascii")
        try:
            self._file.write(data)
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as error:
            raise WriteError(
                f"cannot write the manifest {self.path!r}: {error.strerror or error}", path=self.path
            ) from None

    def item(self, result: ItemResult) -> None:
        """Record one finished item."""
        self.append("item", result.to_record())


def _lock(file: BinaryIO, path: str) -> None:
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; one batch per folder is then up to the user
        return
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise WriteError(
            f"another ckptconv batch is writing to {os.path.dirname(path)!r} (its manifest is locked); "
            "wait for it to finish",
            path=path,
        ) from None
    except OSError:
        return  # file systems without locks (some network mounts): carry on unlocked
