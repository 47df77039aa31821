"""Scan: is a checkpoint safe to ``torch.load``? An exact answer, with no code run.

:func:`scan` reads a checkpoint the way :func:`ckptconv.open` does, with the
same pickle machine (:mod:`ckptconv.reading.unpickling.unpickler`) that interprets every opcode
and never imports nor calls anything, and sorts the file into one verdict:

``safe``
    ``torch.load(weights_only=True)`` loads it: everything it names is what torch's weights-only
    unpickler allows by default (tensors, storages, containers, plain data), its pickles use only
    the opcodes that unpickler reads, and every zip record's CRC-32 matches its bytes (which
    torch does not check). A plain pickle, which ``torch.load`` does not open, is held to the same
    allowlist and opcodes; a safetensors file holds nothing but tensors.
``torch-refuses``
    Nothing in it runs code and ckptconv reads it, but ``torch.load(weights_only=True)`` refuses
    it: it names numpy arrays or dtypes, or another global torch allows only after
    ``torch.serialization.add_safe_globals`` (:mod:`ckptconv.reading.unpickling.torch_parity`),
    or uses pickle opcodes torch's weights-only unpickler lacks, or is a pre-0.4 tar checkpoint.
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
    pickle that no loader reads, expanding past the object budget, a record whose
    CRC-32 does not match).
``not-a-checkpoint``
    Another kind of file (HTML, GGUF, a numpy file without objects, ...).
``not-scanned``
    An archive that scan cannot open or that goes past its bounds
    (:mod:`ckptconv.checking.archives`): what it holds was not seen.
``unreadable``
    The file could not be read at all (permissions, a dangling link).

A folder (a sharded, DCP or training-run checkpoint, or any folder given to
:func:`scan`) and an archive are one item each, whose verdict is the worst of
every file in it that ``torch.load``, ``pickle``, numpy or an archive tool would
open (optimizer and scheduler states, ``training_args.bin``, ``rng_state.pth``,
archives, pickles whatever their names); the report names that file and lists
every file's own report in ``files``.

The judgement is an allowlist: whatever is not re-implemented is at least
``foreign``; the deny lists only decide what is ``unsafe``. A file that is
``unsafe`` is also refused by ``ckptconv convert``; ``damaged`` files are
refused as well. Reading a file to scan it runs nothing from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import zipfile
from collections import Counter
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptconv._paths import PathLike, as_path, missing
from ckptconv.checking import archives
from ckptconv.checking.embedded import scan_embedded
from ckptconv.errors import (
    CkptconvError,
    LoadError,
    MalformedCheckpointError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)
from ckptconv.reading import read_policy
from ckptconv.reading.formats import torch_legacy
from ckptconv.reading.unpickling.torch_parity import recording_torch_refusals
from ckptconv.reading.unpickling.unpickler import UnsafeFinding, recording_unsafe

__all__ = ["SAFE", "VERDICTS", "ScanReport", "ScanSummary", "scan", "scan_many", "scannable_files"]


SAFE = "safe"
TORCH_REFUSES = "torch-refuses"
FOREIGN = "foreign"
UNSAFE = "unsafe"
DAMAGED = "damaged"
NOT_A_CHECKPOINT = "not-a-checkpoint"
NOT_SCANNED = "not-scanned"
UNREADABLE = "unreadable"
# From best to worst; a summary's worst verdict decides the exit code.
VERDICTS = (SAFE, TORCH_REFUSES, FOREIGN, NOT_A_CHECKPOINT, DAMAGED, NOT_SCANNED, UNREADABLE, UNSAFE)

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
        files: for a folder or an archive, the report of every file in it that was scanned
            (archive members as ``archive:member``), worst first.
    """

    path: str
    verdict: str
    reason: str
    format: str = ""
    unsafe: tuple[UnsafeFinding, ...] = ()
    foreign: Mapping[str, int] = field(default_factory=dict)
    files: tuple[ScanReport, ...] = ()

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
            **({"files": [report.to_dict() for report in self.files]} if self.files else {}),
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
        path: a file (any format :func:`ckptconv.open` reads, an archive, or any
            other file), a sharded checkpoint (its folder or ``*.index.json``), a DCP
            or training-run folder, or any folder: a folder or an archive is one
            item, the worst of every file in it (see the module docstring).

    Returns:
        A :class:`ScanReport`; bad input is a verdict, never an exception.

    Example:
        >>> report = ckptconv.scan("downloaded.pth")   # doctest: +SKIP
        >>> report.verdict, report.reason              # doctest: +SKIP
        ('unsafe', 'names posix.system (runs processes) at pickle byte 24 of archive/data.pkl')
    """
    path = as_path(path)
    if os.path.isdir(path):
        from ckptconv.reading.formats import dcp, sharded

        itself = dcp.is_dcp_folder(path) or sharded.find_index(path) is not None
        with read_policy.confined(path):  # links out of the folder are refused, as discovery skips them
            return _scan_folder(path, recursive=True, itself=itself)
    return _scan_file(path, depth=0)


def _scan_file(path: str, *, depth: int) -> ScanReport:
    """One file: a checkpoint's verdict, or an archive's (the worst of its members)."""
    report = _scan_checkpoint(path)
    if report.verdict == NOT_A_CHECKPOINT:
        archive = _archive_kind(path)
        if archive is not None and not (archive == "zip" and _is_torch_zip(path)):
            return _scan_archive(path, archive, depth)
    return report


def _is_torch_zip(path: str) -> bool:
    """A zip torch writes (TorchScript's, say: refused as such, its pickles scanned as embedded ones), not an
    archive of files: it holds a ``data.pkl``."""
    from ckptconv.loading import _PARSE_FAILURES
    from ckptconv.reading.formats.torch_zip import fold_case

    try:
        with read_policy.open_file(path) as file, zipfile.ZipFile(file) as archive:
            return any(fold_case(name).rpartition("/")[2] == "data.pkl" for name in archive.namelist())
    except (*_PARSE_FAILURES, OSError, LoadError):
        return False


def _scan_checkpoint(path: str) -> ScanReport:
    from ckptconv.loading import open as open_checkpoint
    from ckptconv.reading.integrity import check_record_crcs

    findings: list[UnsafeFinding] = []
    refused: set[str] = set()
    with recording_unsafe(findings), recording_torch_refusals(refused):
        try:
            checkpoint = open_checkpoint(path)
        except UnsafeCheckpointError as error:
            # Refusals that are not a name (parser differentials) arrive as errors.
            found = _dedupe([*findings, *scan_embedded(path)])
            reason = _unsafe_reason(found, path) + "; " + _about(error, path) if found else _about(error, path)
            return ScanReport(path, UNSAFE, reason, unsafe=found)
        except UnsupportedFormatError as error:
            return _refused(path, NOT_A_CHECKPOINT, error, findings)
        except MalformedCheckpointError as error:
            return _refused(path, DAMAGED, error, findings)
        except LoadError as error:
            return _refused(path, UNREADABLE, error, findings)
    found = _dedupe([*findings, *scan_embedded(path)])
    foreign = dict(checkpoint.foreign_globals)
    if found:
        return ScanReport(path, UNSAFE, _unsafe_reason(found, path), checkpoint.format, found, foreign)
    try:
        check_record_crcs(list(checkpoint.tensors()))  # torch.load does not: a flipped bit loads silently
    except (MalformedCheckpointError, LoadError) as error:
        return ScanReport(path, DAMAGED, _about(error, path), checkpoint.format, (), foreign)
    if foreign:
        modules = sorted({name.rpartition(".")[0] or name for name in foreign})
        reason = (
            f"names code that is not here ({_listed(foreign)}); torch.load(weights_only=False) would import "
            f"{_listed(modules)} and call it; ckptconv reads the file without importing it (convert it, or "
            "ckptconv.load() it)"
        )
        return ScanReport(path, FOREIGN, reason, checkpoint.format, (), foreign)
    if checkpoint.format in _PICKLE_LOADED:
        return ScanReport(path, SAFE, _SAFE_REASON + ": pickle.load runs nothing from it", checkpoint.format)
    if refused:
        return ScanReport(path, TORCH_REFUSES, _refused_reason(sorted(refused)), checkpoint.format)
    if checkpoint.format in ("safetensors", "sharded"):
        return ScanReport(path, SAFE, _SAFE_REASON, checkpoint.format)
    return ScanReport(path, SAFE, _SAFE_REASON + ", which torch.load(weights_only=True) loads", checkpoint.format)


_SAFE_REASON = "holds only tensors, containers and plain data"
# Formats whose pickles are read with pickle.load, not torch.load: a plain pickle, a DCP folder's .metadata.
_PICKLE_LOADED = frozenset(["pickle", "dcp", "megatron-torch-dist"])


def _listed(names: Iterable[str]) -> str:
    names = list(names)
    return ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _refused_reason(refused: Sequence[str]) -> str:
    opcodes = [name.removeprefix("opcode ") for name in refused if name.startswith("opcode ")]
    names = [name for name in refused if not name.startswith("opcode ")]
    parts = []
    if names:
        parts.append(
            f"names {_listed(names)}, which torch.load(weights_only=True) refuses until they are allowed "
            "(torch.serialization.add_safe_globals)"
        )
    if opcodes:
        parts.append(f"uses pickle opcodes torch.load(weights_only=True) does not read ({_listed(opcodes)})")
    return "nothing in it runs code, but it " + " and ".join(parts) + "; ckptconv converts it as it is"


def _archive_kind(path: str) -> str | None:
    try:
        with read_policy.open_file(path) as file:
            return archives.kind(file.read(512))
    except (OSError, LoadError):
        return None


def _scan_archive(path: str, kind: str, depth: int) -> ScanReport:
    """The worst of an archive's members (bounded: :mod:`ckptconv.checking.archives`)."""
    if depth >= archives.MAX_DEPTH:
        return ScanReport(path, NOT_SCANNED, f"an archive inside {depth} others, deeper than scan opens; unpack it")
    reports: list[ScanReport] = []
    count = 0
    try:
        with archives.private_folder() as folder:
            for member in archives.members(path, kind, folder):
                count += 1
                where = f"{path}:{member.name}"
                if member.unsafe:
                    reports.append(ScanReport(where, UNSAFE, member.unsafe))
                elif member.problem:
                    reports.append(ScanReport(where, DAMAGED if member.broken else NOT_SCANNED, member.problem))
                elif member.file and kind == "tar" and os.path.basename(member.name) in torch_legacy.TAR_MEMBERS:
                    reports.append(_scan_legacy_member(os.path.basename(member.name), member.file, where))
                elif member.file:
                    reports.append(_renamed(_scan_file(member.file, depth=depth + 1), member.file, where))
    except archives.NotScanned as error:
        reports.append(ScanReport(path, NOT_SCANNED, f"not scanned: {error}"))
    except OSError as error:
        reports.append(ScanReport(path, NOT_SCANNED, f"not scanned: cannot be unpacked ({error})"))
    if not reports:
        return ScanReport(
            path,
            NOT_A_CHECKPOINT,
            f"a {kind} archive of {count:,} members, none that torch.load, pickle, numpy or an unpacker would open",
            f"{kind} archive",
        )
    return _combined(path, reports, f"{kind} archive")


def _scan_legacy_member(name: str, file: str, where: str) -> ScanReport:
    """A member of a pre-0.4 tar checkpoint: every pickle in it, read as torch's ``legacy_load`` reads them."""
    from ckptconv.loading import _PARSE_FAILURES

    findings: list[UnsafeFinding] = []
    with recording_unsafe(findings):
        try:
            foreign = torch_legacy.tar_member_pickles(name, file, where)
            broken = ""
        except (CkptconvError, *_PARSE_FAILURES) as error:
            foreign, broken = Counter(), _about(error, where)
    found = _dedupe(findings)
    if found:
        return ScanReport(where, UNSAFE, _unsafe_reason(found, where), torch_legacy.FORMAT + " tar", found)
    if broken:
        return ScanReport(where, DAMAGED, broken, torch_legacy.FORMAT + " tar")
    if foreign:
        reason = (
            f"names code that is not here ({_listed(foreign)}); torch.load(weights_only=False) would import and call it"
        )
        return ScanReport(where, FOREIGN, reason, torch_legacy.FORMAT + " tar", (), dict(foreign))
    reason = (
        "a member of torch's pre-0.4 tar checkpoint: nothing in it runs code, but torch.load(weights_only=True) "
        "refuses the format (and ckptconv does not convert it); re-save it with torch.save"
    )
    return ScanReport(where, TORCH_REFUSES, reason, torch_legacy.FORMAT + " tar")


def _renamed(report: ScanReport, copy: str, where: str) -> ScanReport:
    """A member's report, as scanned from its private ``copy``, spelled with its place in the archive."""

    def spelled(text: str) -> str:
        return text.replace(repr(copy), repr(where)).replace(copy, where)

    return ScanReport(
        spelled(report.path),
        report.verdict,
        spelled(report.reason),
        report.format,
        tuple(dataclasses.replace(finding, where=spelled(finding.where)) for finding in report.unsafe),
        report.foreign,
        tuple(_renamed(inner, copy, where) for inner in report.files),
    )


def _combined(path: str, reports: Sequence[ScanReport], fmt: str) -> ScanReport:
    """One item's report: the worst of its files', naming that file, every file's report kept (worst first)."""
    ordered = sorted(reports, key=lambda report: -VERDICTS.index(report.verdict))
    worst = ordered[0]
    counts = Counter(report.verdict for report in reports)
    tally = ", ".join(f"{counts[verdict]} {verdict}" for verdict in VERDICTS if counts[verdict])
    inside = worst.path[len(path) :].lstrip(":/" + os.sep) if worst.path.startswith(path) else worst.path
    noun = "file" if len(reports) == 1 else "files"
    reason = (f"{inside}: " if inside else "") + f"{worst.reason} (the worst of {len(reports)} {noun}: {tally})"
    foreign: Counter[str] = Counter()
    for report in reports:
        foreign.update(report.foreign)
    unsafe = tuple(finding for report in ordered for finding in report.unsafe)
    return ScanReport(path, worst.verdict, reason, fmt, unsafe, dict(foreign), tuple(ordered))


def _scan_folder(folder: str, *, recursive: bool, others: Container[str] = (), itself: bool = False) -> ScanReport:
    """A folder: its checkpoint (sharded, DCP, a training run), if it is one, and every other file in it
    that torch.load, pickle, numpy or an archive tool would open (in its subfolders too when ``recursive``),
    but ``others`` (absolute paths: the files of other items, scanned as those). ``itself``: the folder is known
    to be a checkpoint (discovery found a DCP or training-run folder), so its own verdict counts even when
    ckptconv refuses its format (an FSDP1 LOCAL_STATE_DICT run is ``not-a-checkpoint``)."""
    from ckptconv.reading.detection import checkpoint_files

    own: ScanReport | None = _scan_checkpoint(folder)
    read: set[str] = set()
    if own is not None and own.verdict == NOT_A_CHECKPOINT and not itself:
        own = None  # a folder that is no checkpoint itself: only its files count
    elif own is not None and own.verdict in (SAFE, TORCH_REFUSES, FOREIGN):
        # Read whole as a checkpoint: its files are not scanned again. A refused one's may not all have been.
        with contextlib.suppress(CkptconvError, OSError):
            read = {os.path.abspath(file) for file in checkpoint_files(folder)}
    reports = [] if own is None else [own]
    skip = _Either(read, others)
    reports += [_scan_file(file, depth=0) for file in scannable_files(folder, recursive=recursive, skip=skip)]
    if not reports:
        return ScanReport(
            folder, NOT_A_CHECKPOINT, "holds no file that torch.load, pickle, numpy or an archive tool would open"
        )
    if own is not None and len(reports) == 1:
        return own
    return _combined(folder, reports, own.format if own is not None else "folder")


class _Either(Container[str]):
    def __init__(self, *sets: Container[str]) -> None:
        self.sets = sets

    def __contains__(self, item: object) -> bool:
        return any(item in found for found in self.sets)


def scannable_files(folder: str, *, recursive: bool, skip: Container[str] = ()) -> list[str]:
    """The regular files under ``folder`` that ``torch.load``, ``pickle``, numpy, safetensors or an archive tool
    would open (:func:`ckptconv.checking.archives.scannable_head`), hidden ones and those in ``skip`` left out,
    as are links that lead out of ``folder`` (as discovery leaves them)."""
    found = []
    for root, subfolders, names in os.walk(folder):
        subfolders[:] = sorted(name for name in subfolders if not name.startswith(".")) if recursive else []
        for name in sorted(names):
            path = os.path.join(root, name)
            if name.startswith(".") or os.path.abspath(path) in skip:
                continue
            if os.path.islink(path) and not read_policy.found_inside(path, folder):
                continue
            try:
                with read_policy.open_file(path) as file:
                    head = file.read(512)
            except (OSError, LoadError):
                continue
            if archives.scannable_head(name, head):
                found.append(path)
    return found


def _refused(path: str, verdict: str, error: Exception, findings: Sequence[UnsafeFinding]) -> ScanReport:
    found = _dedupe([*findings, *scan_embedded(path)])
    if found:
        # A file that names code-running functions is unsafe however broken the rest is.
        return ScanReport(path, UNSAFE, f"{_unsafe_reason(found, path)}; reading it also failed: {error}", unsafe=found)
    return ScanReport(path, verdict, _about(error, path))


def scan_many(paths: Iterable[PathLike]) -> ScanSummary:
    """:func:`scan` every path; folders are searched the way ``ckptconv batch`` finds checkpoints.

    A folder that is itself a sharded or DCP checkpoint is one item; any other
    folder contributes every checkpoint under it (sharded, DCP and training-run
    folders as one item each, the worst of every file in them), and every other
    file under it that ``torch.load``, ``pickle``, numpy or an archive tool would
    open (archives, pickles whatever their names) as an item of its own.
    Files are scanned whatever their name.

    Raises:
        LoadError: a path does not exist.
    """
    from ckptconv.reading.discovery import DCP, RUN, discover, member_paths
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
            covered: set[str] = set()
            with read_policy.confined(path):
                items = discover(path, unlisted=unlisted)
                one_file = {
                    os.path.abspath(file)
                    for item in items
                    if item.kind not in (DCP, RUN)
                    for file in member_paths(item)
                }
                for item in items:
                    if item.kind in (DCP, RUN):
                        # A training run's folder holds its older tags and optimizer files: all scanned
                        # (but the checkpoints beside them that are items of their own).
                        report = _scan_folder(item.path, recursive=item.kind == RUN, others=one_file, itself=True)
                    else:
                        report = scan(item.path)
                    reports.append(report)
                    covered.update(os.path.abspath(file) for file in member_paths(item))
                    covered.update(_files_of(report))
                # What discovery does not call a checkpoint but torch.load or an unpacker opens all the same.
                loose = scannable_files(os.path.abspath(path), recursive=True, skip=covered)
                reports.extend(_scan_file(file, depth=0) for file in loose)
            # A folder that could not be listed is never called safe: what it holds was not scanned.
            reports.extend(
                ScanReport(folder, UNREADABLE, f"cannot be listed ({why}); what it holds was not scanned")
                for folder, why in unlisted
            )
        else:
            reports.append(scan(path))
    return ScanSummary(tuple(reports))


def _files_of(report: ScanReport) -> Iterator[str]:
    yield os.path.abspath(report.path)
    for inner in report.files:
        yield from _files_of(inner)
