"""Report: what a batch did, item by item, and the exit code that follows.

Workers never raise: each returns an :class:`ItemResult`, failures included.
:class:`BatchReport` collects them and owns the exit code, as black's
``report.py`` does, so the library and the CLI cannot disagree about whether a
batch succeeded. The same records, one JSON line each, make the manifest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptconv._text import human_bytes, plural
from ckptconv.batching.sharding import Shard, ShardPlan

__all__ = ["BatchReport", "ItemResult", "OutputFile"]

CONVERTED = "converted"
FAILED = "failed"
UNSAFE = "unsafe"  # refused as scan would call it unsafe: it names code-running callables; never read
SKIPPED = "skipped"
CANCELLED = "cancelled"
PLANNED = "planned"
STATUSES = (CONVERTED, FAILED, UNSAFE, SKIPPED, CANCELLED, PLANNED)

# The exit codes of every command (the CLI's --help and the README list them).
EXIT_OK = 0  # success
EXIT_FAILED = 1  # the operation failed: bad input, unsafe file, cannot write
EXIT_USAGE = 2  # usage error
EXIT_NEGATIVE = 3  # finished with a negative result: differences, no fit, failed batch items
EXIT_UNSAFE = 4  # scan found an unsafe file
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it); partial outputs removed
EXIT_TERMINATED = 143  # SIGTERM (128 + SIGTERM); partial outputs removed

# How long a Dask batch waits for its scheduler to answer and for a worker to join it: batch()'s default and
# --scheduler-timeout's (here, beside the exit codes, so the command line needs not import the executors).
SCHEDULER_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class OutputFile:
    """One file an item was written to.

    Attributes:
        path: relative to the output folder, ``/``-separated.
        size: bytes.
        sha256: hex digest, or None when checksums were turned off.
    """

    path: str
    size: int
    sha256: str | None = None


@dataclass(frozen=True)
class ItemResult:
    """What happened to one item of a batch.

    Attributes:
        source: the item's path relative to the source folder (``/``-separated).
        status: ``"converted"``; ``"failed"`` (see ``error``); ``"unsafe"`` (the file names callables that
            exist to run code, an ``UnsafeCheckpointError``: not converted, and the batch exits 4); ``"skipped"``
            (``resume`` found it converted already, or it holds training state, not weights: ``error`` says
            which); ``"cancelled"`` (never
            started, because ``fail_fast`` stopped the batch); ``"planned"``
            (a dry run).
        kind: ``"file"``, ``"sharded"``, ``"dcp"`` or ``"run"`` (a DeepSpeed run folder).
        output: where the output goes, relative to the output folder.
        source_size: bytes of the input (all its files).
        source_mtime_ns: the input's modification time when it was read.
        source_sha256: the input's hex digest (failed and unsafe items' too, where their files could be
            read), or None (checksums turned off, or the files could not be read).
        source_format: ``"torch-zip"``, ``"torch-legacy"``, ``"safetensors"``, ``"pickle"``.
        format: the output format.
        outputs: the files written, with their sizes and digests.
        tensors: keys written.
        bytes: tensor bytes written.
        error: one sentence saying what failed and what to do, for failed items.
        error_type: the exception's class (``"UnsafeCheckpointError"``);
            unexpected ones carry their module (``"builtins.RecursionError"``).
        notes: what :func:`ckptconv.convert` had to say.
        duration_s: seconds spent on the item.
        traceback: for unexpected exceptions (bugs), the traceback to report.
    """

    source: str
    status: str
    kind: str = "file"
    output: str = ""
    source_size: int = 0
    source_mtime_ns: int = 0
    source_sha256: str | None = None
    source_format: str = ""
    format: str = ""
    outputs: tuple[OutputFile, ...] = ()
    tensors: int = 0
    bytes: int = 0
    error: str = ""
    error_type: str = ""
    notes: tuple[str, ...] = ()
    duration_s: float = 0.0
    traceback: str = ""

    @property
    def ok(self) -> bool:
        """True unless the item failed, was unsafe or was cancelled."""
        return self.status in (CONVERTED, SKIPPED, PLANNED)

    def to_record(self) -> dict[str, Any]:
        """The item's manifest record (without the run's fields)."""
        record: dict[str, Any] = {
            "source": self.source,
            "kind": self.kind,
            "status": self.status,
            "source_size": self.source_size,
            "source_mtime_ns": self.source_mtime_ns,
            "source_sha256": self.source_sha256,
            "source_format": self.source_format or None,
            "format": self.format or None,
            "output": self.output or None,
            "outputs": [{"path": o.path, "size": o.size, "sha256": o.sha256} for o in self.outputs],
            "tensors": self.tensors,
            "bytes": self.bytes,
            "error": self.error or None,
            "error_type": self.error_type or None,
            "notes": list(self.notes),
            "duration_s": round(self.duration_s, 6),
        }
        if self.traceback:
            record["traceback"] = self.traceback
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ItemResult:
        """The inverse of :meth:`to_record`."""
        return cls(
            source=str(record["source"]),
            status=str(record["status"]),
            kind=str(record.get("kind") or "file"),
            output=str(record.get("output") or ""),
            source_size=int(record.get("source_size") or 0),
            source_mtime_ns=int(record.get("source_mtime_ns") or 0),
            source_sha256=record.get("source_sha256"),
            source_format=str(record.get("source_format") or ""),
            format=str(record.get("format") or ""),
            outputs=tuple(
                OutputFile(str(o["path"]), int(o["size"]), o.get("sha256")) for o in record.get("outputs") or ()
            ),
            tensors=int(record.get("tensors") or 0),
            bytes=int(record.get("bytes") or 0),
            error=str(record.get("error") or ""),
            error_type=str(record.get("error_type") or ""),
            notes=tuple(record.get("notes") or ()),
            duration_s=float(record.get("duration_s") or 0.0),
            traceback=str(record.get("traceback") or ""),
        )


@dataclass(frozen=True)
class BatchReport:
    """What :func:`ckptconv.batch` did.

    Attributes:
        source_dir: the folder that was searched.
        output_dir: the folder outputs went to.
        manifest: the manifest file (``""`` for a dry run).
        results: one :class:`ItemResult` per item found, sorted by source path.
        duration_s: wall-clock seconds for the whole batch.
        dry_run: nothing was converted or written.
        notes: sentences about the search itself: files skipped because they must
            not be read (a link leading outside the source folder, a FIFO).
        shard: the shard this run converted (``batch --shard``), else None.
        shards: with ``shard``, every shard's items and bytes (the whole plan).
        problems: for a report merged from the shards' manifests (``batch --report``), one sentence
            per shard that has not run or not finished, or per item two shards both planned; any makes the
            exit code 3.
    """

    source_dir: str
    output_dir: str
    manifest: str
    results: tuple[ItemResult, ...] = field(default_factory=tuple)
    duration_s: float = 0.0
    dry_run: bool = False
    notes: tuple[str, ...] = ()
    shard: Shard | None = None
    shards: tuple[ShardPlan, ...] = ()
    problems: tuple[str, ...] = ()

    def _with(self, status: str) -> tuple[ItemResult, ...]:
        return tuple(result for result in self.results if result.status == status)

    @property
    def converted(self) -> tuple[ItemResult, ...]:
        return self._with(CONVERTED)

    @property
    def failed(self) -> tuple[ItemResult, ...]:
        return self._with(FAILED)

    @property
    def unsafe(self) -> tuple[ItemResult, ...]:
        """Items refused because they name code-running callables (what ``scan`` calls unsafe)."""
        return self._with(UNSAFE)

    @property
    def skipped(self) -> tuple[ItemResult, ...]:
        return self._with(SKIPPED)

    @property
    def cancelled(self) -> tuple[ItemResult, ...]:
        return self._with(CANCELLED)

    @property
    def bytes_read(self) -> int:
        """Input bytes of the items converted in this run."""
        return sum(result.source_size for result in self.converted)

    @property
    def exit_code(self) -> int:
        """0 when every item is converted (now or before); 4 when any is unsafe (as ``scan`` exits); else 3
        when any failed or was cancelled, or a shard has not finished."""
        if self.unsafe:
            return EXIT_UNSAFE
        return EXIT_NEGATIVE if self.failed or self.cancelled or self.problems else EXIT_OK

    def counts(self) -> dict[str, int]:
        """How many items ended in each status (every status, zeros included), and ``"items"`` in all."""
        return {"items": len(self.results), **{status: len(self._with(status)) for status in STATUSES}}

    def summary(self) -> str:
        """One sentence: ``"converted 9 of 11 items (1.2 GiB in 8.1 s, 150 MiB/s); 1 unsafe (not converted),
        1 failed"``; the counts after the semicolon appear only when not zero."""
        done = len(self._with(PLANNED)) if self.dry_run else len(self.converted)
        text = f"{'would convert' if self.dry_run else 'converted'} {done} of {plural(len(self.results), 'item')}"
        if not self.dry_run and self.converted:
            rate = self.bytes_read / self.duration_s if self.duration_s > 0 else 0.0
            text += f" ({human_bytes(self.bytes_read)} in {self.duration_s:.1f} s, {human_bytes(rate)}/s)"
        rest = [
            f"{count} {what}"
            for count, what in (
                (len(self.skipped), "skipped"),
                (len(self.unsafe), "unsafe (not converted)"),
                (len(self.failed), "failed"),
                (len(self.cancelled), "cancelled"),
            )
            if count
        ]
        return text + ("; " + ", ".join(rest) if rest else "")

    def to_json(self) -> dict[str, Any]:
        """The report as ``ckptconv batch --json`` prints it (docs/batch.md describes every field)::

        {"schema": 1, "source_dir": "/data/zoo", "output_dir": "/data/out",
         "manifest": "/data/out/ckptconv-manifest.jsonl", "dry_run": false, "exit_code": 4,
         "duration_s": 8.1, "bytes_read": 1288490188,
         "counts": {"items": 11, "converted": 9, "failed": 1, "unsafe": 1, "skipped": 0, "cancelled": 0,
                    "planned": 0},
         "notes": [], "items": [<one manifest item record each>]}
        """
        return {
            "schema": 1,
            "source_dir": self.source_dir,
            "output_dir": self.output_dir,
            "manifest": self.manifest or None,
            "dry_run": self.dry_run,
            "exit_code": self.exit_code,
            "duration_s": round(self.duration_s, 6),
            "bytes_read": self.bytes_read,
            "counts": self.counts(),
            "notes": list(self.notes),
            "items": [result.to_record() for result in self.results],
            **self._split_json(),
        }

    def _split_json(self) -> dict[str, Any]:
        """A split batch's fields (``shard``, ``shards``, ``problems``), only where they are set."""
        fields: dict[str, Any] = {}
        if self.shard is not None:
            fields["shard"] = str(self.shard)
            fields["shards"] = [
                {"shard": str(plan.shard), "items": list(plan.items), "bytes": plan.bytes} for plan in self.shards
            ]
        if self.problems:
            fields["problems"] = list(self.problems)
        return fields
