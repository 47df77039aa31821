"""Scan: is a checkpoint safe to ``torch.load``? An exact answer, with no code run.

:func:`scan` reads a checkpoint the way :func:`ckptconv.open` does, with the
same pickle machine (:mod:`ckptconv.reading.unpickling.unpickler`) that interprets every opcode
and never imports nor calls anything, and sorts the file into one verdict:

``safe``
    Everything the file names is re-implemented by ckptconv
    (:mod:`ckptconv.reading.unpickling.rebuild`): tensors, storages, containers, numpy data.
    ``torch.load(weights_only=True)`` loads such files too.
``foreign``
    It also names classes or functions from code that is not ckptconv's
    (a model class, ``argparse.Namespace``). Harmless to ckptconv, which
    keeps them as inert stand-ins, but ``torch.load(weights_only=False)``
    would import that code and call it. They are listed.
``unsafe``
    It names something from a family that runs code, touches files, sockets
    or processes, imports, compiles or loads further pickles
    (:mod:`ckptconv.reading.unpickling.pickle_policy`, documented in SECURITY.md), or it is built
    so that CPython's unpickler would read other opcodes than a scanner
    (a parser differential). Each finding is named with its opcode's offset.
``damaged``
    A checkpoint format, but broken (truncated, inconsistent, bytes after the
    pickle that no loader reads, expanding past the object budget).
``not-a-checkpoint``
    Another kind of file (HTML, GGUF, numpy, an archive, ...).
``unreadable``
    The file could not be read at all (permissions, a dangling link).

The judgement is an allowlist: whatever is not re-implemented is at least
``foreign``; the deny lists only decide what is ``unsafe``. A file that is
``unsafe`` is also refused by ``ckptconv convert``; ``damaged`` files are
refused as well. Reading a file to scan it runs nothing from it.
"""

from __future__ import annotations

import os
import re
import struct
import zipfile
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptconv._paths import PathLike, as_path, missing
from ckptconv.errors import (
    CkptconvError,
    LoadError,
    MalformedCheckpointError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)
from ckptconv.reading import read_policy
from ckptconv.reading.unpickling.unpickler import UnsafeFinding, recording_unsafe

__all__ = ["SAFE", "VERDICTS", "ScanReport", "ScanSummary", "scan", "scan_many"]


SAFE = "safe"
FOREIGN = "foreign"
UNSAFE = "unsafe"
DAMAGED = "damaged"
NOT_A_CHECKPOINT = "not-a-checkpoint"
UNREADABLE = "unreadable"
# From best to worst; a summary's worst verdict decides the exit code.
VERDICTS = (SAFE, FOREIGN, NOT_A_CHECKPOINT, DAMAGED, UNREADABLE, UNSAFE)

# Findings listed in a report's reason before "and N more".
_SHOWN = 3


@dataclass(frozen=True)
class ScanReport:
    """What :func:`scan` found in one checkpoint.

    Attributes:
        path: the file or folder scanned.
        verdict: one of :data:`VERDICTS` (see the module docstring).
        reason: one sentence saying why.
        format: the detected format (``torch-zip``, ``pickle``, ...), ``""`` if none.
        unsafe: every dangerous name or construct, with where it is.
        foreign: classes and functions that became stand-ins, with object counts.
    """

    path: str
    verdict: str
    reason: str
    format: str = ""
    unsafe: tuple[UnsafeFinding, ...] = ()
    foreign: Mapping[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when the verdict is ``safe``."""
        return self.verdict == SAFE

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (one item of ``ckptconv scan --json``)."""
        return {
            "path": self.path,
            "verdict": self.verdict,
            "reason": self.reason,
            "format": self.format,
            "unsafe": [finding.to_dict() for finding in self.unsafe],
            "foreign": dict(self.foreign),
        }


@dataclass(frozen=True)
class ScanSummary:
    """The reports of several items and what they add up to."""

    reports: tuple[ScanReport, ...]

    @property
    def counts(self) -> dict[str, int]:
        """How many items got each verdict (every verdict listed, zeros included)."""
        counts = dict.fromkeys(VERDICTS, 0)
        for report in self.reports:
            counts[report.verdict] += 1
        return counts

    @property
    def worst(self) -> str:
        """The worst verdict among the items (``safe`` when there are none)."""
        return max((report.verdict for report in self.reports), key=VERDICTS.index, default=SAFE)

    def summary(self) -> str:
        """One line: ``3 items: 1 safe, 1 foreign, 1 unsafe``."""
        parts = [f"{count} {verdict}" for verdict, count in self.counts.items() if count]
        noun = "item" if len(self.reports) == 1 else "items"
        return f"{len(self.reports)} {noun}: " + (", ".join(parts) if parts else "nothing scanned")

    def to_dict(self) -> dict[str, Any]:
        """What ``ckptconv scan --json`` prints."""
        return {"items": [report.to_dict() for report in self.reports], "counts": self.counts, "worst": self.worst}


def _dedupe(findings: Iterable[UnsafeFinding]) -> tuple[UnsafeFinding, ...]:
    # A zip's data.pkl is read by the format reader and again among the zip's members.
    seen: set[tuple[str, int]] = set()
    kept = []
    for finding in findings:
        key = (finding.name, finding.offset)
        if key not in seen:
            seen.add(key)
            kept.append(finding)
    return tuple(kept)


def _about(error: Exception, path: str) -> str:
    """An error's message without the leading file name (the report's line already starts with it)."""
    text = str(error)
    for prefix in (repr(path), path):
        if text.startswith(prefix):
            return text[len(prefix) :].lstrip(" :")
    return text


def _unsafe_reason(findings: Sequence[UnsafeFinding], path: str) -> str:
    def describe(finding: UnsafeFinding) -> str:
        inside = finding.where[len(path) :].lstrip(":/ ") if finding.where.startswith(path) else ""
        return finding.describe() + (f" of {inside}" if inside else "")

    shown = "; ".join(describe(finding) for finding in findings[:_SHOWN])
    more = f"; and {len(findings) - _SHOWN} more" if len(findings) > _SHOWN else ""
    return shown + more


def scan(path: PathLike) -> ScanReport:
    """Say whether a checkpoint is safe to load, and why, without running anything from it.

    Args:
        path: a file (any format :func:`ckptconv.open` reads, or any other
            file), a sharded checkpoint (its folder or ``*.index.json``) or a
            DCP folder.

    Returns:
        A :class:`ScanReport`; bad input is a verdict, never an exception.

    Example:
        >>> report = ckptconv.scan("downloaded.pth")   # doctest: +SKIP
        >>> report.verdict, report.reason              # doctest: +SKIP
        ('unsafe', 'names posix.system (runs processes) at pickle byte 24 of archive/data.pkl')
    """
    from ckptconv.loading import open as open_checkpoint

    path = as_path(path)
    findings: list[UnsafeFinding] = []
    with recording_unsafe(findings):
        try:
            checkpoint = open_checkpoint(path)
        except UnsafeCheckpointError as error:
            # Refusals that are not a name (parser differentials) arrive as errors.
            found = _dedupe([*findings, *_scan_embedded(path)])
            reason = _unsafe_reason(found, path) + "; " + _about(error, path) if found else _about(error, path)
            return ScanReport(path, UNSAFE, reason, unsafe=found)
        except UnsupportedFormatError as error:
            return _refused(path, NOT_A_CHECKPOINT, error, findings)
        except MalformedCheckpointError as error:
            return _refused(path, DAMAGED, error, findings)
        except LoadError as error:
            return _refused(path, UNREADABLE, error, findings)
    found = _dedupe([*findings, *_scan_embedded(path)])
    foreign = dict(checkpoint.foreign_globals)
    if found:
        return ScanReport(path, UNSAFE, _unsafe_reason(found, path), checkpoint.format, found, foreign)
    if foreign:
        names = ", ".join(list(foreign)[:_SHOWN]) + (
            f" and {len(foreign) - _SHOWN} more" if len(foreign) > _SHOWN else ""
        )
        modules = sorted({name.rpartition(".")[0] or name for name in foreign})
        shown = ", ".join(modules[:_SHOWN]) + (f" and {len(modules) - _SHOWN} more" if len(modules) > _SHOWN else "")
        reason = (
            f"names code that is not here ({names}); torch.load(weights_only=False) would import {shown} and call "
            "it; ckptconv reads the file without importing it (convert it, or ckptconv.load() it)"
        )
        return ScanReport(path, FOREIGN, reason, checkpoint.format, (), foreign)
    return ScanReport(path, SAFE, "holds only tensors, containers and plain data", checkpoint.format)


# Pickles inside other containers are scanned up to this size each.
_MAX_EMBEDDED = 256 << 20
_PICKLE_SUFFIXES = (".pkl", ".pickle")
# Members named otherwise are scanned if they start like a pickle and are at most this big.
_MAX_UNNAMED = 16 << 20
_PROTOCOLS = (b"\x02", b"\x03", b"\x04", b"\x05")
_STORAGE_RECORD = re.compile(r"(^|/)data/\d+$")


def _embedded_pickles(path: str) -> list[tuple[str, bytes]]:
    """``(where, bytes)`` of every pickle inside a zip archive or a numpy object array.

    ``torch.load`` reads one member of a zip, but other loaders (and an
    attacker's instructions) may read any; numpy's ``allow_pickle`` loads the
    data of an object ``.npy`` as a pickle. Zip members are read from their
    local headers, so a damaged central directory (a wrong CRC, a name that
    disagrees with the local header) does not hide them.
    """
    try:
        with read_policy.open_file(path) as file:  # regular files only: a FIFO would never end
            head = file.read(8)
            if head.startswith(b"\x93NUMPY"):
                return _npy_pickle(path, file)
            if head.startswith(b"PK\x03\x04"):
                return _zip_pickles(path, file)
    except (OSError, LoadError):
        return []
    return []


def _npy_pickle(path: str, file: Any) -> list[tuple[str, bytes]]:
    file.seek(6)
    major = file.read(2)[:1]
    size_format = "<H" if major == b"\x01" else "<I"
    raw = file.read(struct.calcsize(size_format))
    if len(raw) != struct.calcsize(size_format):
        return []
    (header_size,) = struct.unpack(size_format, raw)
    header = file.read(min(header_size, 1 << 16))
    if b"'|O'" not in header and b'"|O"' not in header:
        return []
    return [(f"{path} (object array data)", file.read(_MAX_EMBEDDED))]


def _zip_pickles(path: str, file: Any) -> list[tuple[str, bytes]]:
    from ckptconv.loading import _PARSE_FAILURES

    try:
        archive = zipfile.ZipFile(file)
        infos = archive.infolist()
    except (*_PARSE_FAILURES, OSError):
        return []
    found = []
    for info in infos:
        if info.is_dir() or info.flag_bits & 1 or info.compress_size > _MAX_EMBEDDED:
            continue
        named = info.filename.lower().endswith(_PICKLE_SUFFIXES)
        if not named and (info.file_size > _MAX_UNNAMED or _STORAGE_RECORD.search(info.filename)):
            continue  # tensor bytes (torch's data/N records), or too big to be a hidden payload
        data = _zip_member_bytes(file, info)
        if data is not None and (named or (data[:1] == b"\x80" and data[1:2] in _PROTOCOLS)):
            found.append((f"{path}:{info.filename}", data))
    return found


def _zip_member_bytes(file: Any, info: zipfile.ZipInfo) -> bytes | None:
    """A member's bytes from its local header, without the CRC or name checks zipfile makes."""
    from ckptconv.reading.formats.torch_zip import INFLATION_SLACK, MAX_INFLATION

    try:
        file.seek(info.header_offset)
        local = file.read(30)
        if len(local) != 30 or local[:4] != b"PK\x03\x04":
            return None
        name_length, extra_length = struct.unpack("<HH", local[26:30])
        file.seek(info.header_offset + 30 + name_length + extra_length)
        raw = file.read(info.compress_size)
        if info.compress_type == zipfile.ZIP_STORED:
            return bytes(raw)
        if info.compress_type == zipfile.ZIP_DEFLATED:
            # No more than a pickle inflates to (a zip bomb's zeros would be read up to the limit).
            limit = min(_MAX_EMBEDDED, MAX_INFLATION * info.compress_size + INFLATION_SLACK)
            return zlib.decompressobj(-15).decompress(raw, limit)
    except (OSError, zlib.error, struct.error, ValueError, OverflowError):
        return None
    return None


def _scan_embedded(path: str) -> list[UnsafeFinding]:
    """Unsafe names in the pickles :func:`_embedded_pickles` finds (they are only read, never built on)."""
    from ckptconv.loading import _PARSE_FAILURES
    from ckptconv.reading.unpickling.unpickler import Unpickler

    findings: list[UnsafeFinding] = []
    with recording_unsafe(findings):
        for where, data in _embedded_pickles(path):
            unpickler = Unpickler(data, source=where, persistent_load=lambda _pid: None)
            try:
                unpickler.load()
                unpickler.check_end()
            except (CkptconvError, *_PARSE_FAILURES):
                continue  # a broken pickle: whatever it named before breaking is recorded
    return findings


def _refused(path: str, verdict: str, error: Exception, findings: Sequence[UnsafeFinding]) -> ScanReport:
    found = _dedupe([*findings, *_scan_embedded(path)])
    if found:
        # A file that names code-running functions is unsafe however broken the rest is.
        return ScanReport(path, UNSAFE, f"{_unsafe_reason(found, path)}; reading it also failed: {error}", unsafe=found)
    return ScanReport(path, verdict, _about(error, path))


def scan_many(paths: Iterable[PathLike]) -> ScanSummary:
    """:func:`scan` every path; folders are searched the way ``ckptconv batch`` finds checkpoints.

    A folder that is itself a sharded or DCP checkpoint is one item; any other
    folder contributes every checkpoint under it (sharded and DCP folders as
    one item each). Files are scanned whatever their name.

    Raises:
        LoadError: a path does not exist.
    """
    from ckptconv.reading.discovery import RUN, discover, unread_files
    from ckptconv.reading.formats import dcp, sharded

    reports = []
    for raw in paths:
        path = as_path(raw)
        if not os.path.lexists(path):
            raise LoadError(f"{missing(path)}; check the path", path=path)
        if os.path.isdir(path) and not dcp.is_dcp_folder(path) and sharded.find_index(path) is None:
            # Discovery follows a link only inside the folder; held to that while scanning too, a file
            # swapped for a link out of it since is refused, not read (and its first bytes not shown).
            unlisted: list[tuple[str, str]] = []
            with read_policy.confined(path):
                for item in discover(path, unlisted=unlisted):
                    reports.append(scan(item.path))
                    if item.kind == RUN:
                        # A training run is one item to convert, but every pickle in it is scanned:
                        # older tags, optimizer files beside per-rank model files.
                        reports.extend(scan(extra) for extra in unread_files(item))
            # A folder that could not be listed is never called safe: what it holds was not scanned.
            reports.extend(
                ScanReport(folder, UNREADABLE, f"cannot be listed ({why}); what it holds was not scanned")
                for folder, why in unlisted
            )
        else:
            reports.append(scan(path))
    return ScanSummary(tuple(reports))
