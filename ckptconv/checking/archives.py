"""Archives for ``scan``: every member of a zip, a tar or a compressed file, opened and bounded.

A download often arrives as an archive of a model folder, and whoever unpacks it
runs ``torch.load`` on what comes out. :func:`members` walks an archive (a zip that
is not a torch checkpoint, a tar, a ``.tar.gz``/``.tgz``/``.tar.bz2``/``.tar.xz``, or
one gzip/bzip2/xz-compressed file) and hands each member that ``torch.load``, numpy
or an archive tool could open to the caller as a file: copied, one at a time, into a
private temporary folder (``tempfile``'s, mode 0700) under a name chosen here, never
the member's own, and removed once the caller is done with it. Nothing is unpacked
anywhere else, and a member's bytes are read once, as a stream.

What is refused, with the member named:

* an archive that goes past a bound (:data:`MAX_MEMBERS` members, more than
  :data:`MAX_RATIO` times its own size unpacked, archives nested deeper than
  :data:`MAX_DEPTH`) or that scan cannot open (7-Zip, zstd, an encrypted member):
  ``not-scanned``, since what it holds was not seen;
* a member that unpacking would put outside the folder it is unpacked in (an
  absolute name, ``..``), a link that leads out, a device or FIFO: ``unsafe``,
  whatever its bytes (``tar -x`` and ``unzip`` follow such names).
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import lzma
import os
import re
import shutil
import stat
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from ckptconv.reading import read_policy
from ckptconv.suffixes import CHECKPOINT_SUFFIXES

__all__ = ["MAX_DEPTH", "MAX_MEMBERS", "MAX_RATIO", "Member", "NotScanned", "kind", "members", "scannable_head"]

#: Members one archive may hold (a zip bomb of empty entries would otherwise take hours).
MAX_MEMBERS = 100_000
#: Bytes unpacked per byte of archive, over the whole archive (model weights compress barely at all;
#: a deflate bomb reaches 1000), plus :data:`_SLACK`.
MAX_RATIO = 100
_SLACK = 256 << 20
#: Archives inside archives inside archives: no deeper.
MAX_DEPTH = 3
# Room left free in the temporary folder beside a member copied there.
_ROOM = 64 << 20
_CHUNK = 1 << 20
_HEAD = 512

_ARCHIVES = (
    (b"PK\x03\x04", "zip"),
    (b"PK\x05\x06", "zip"),  # an empty zip
    (b"\x1f\x8b", "gzip"),
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"(\xb5/\xfd", "zstd"),
    (b"7z\xbc\xaf\x27\x1c", "7z"),
    (b"Rar!\x1a\x07", "rar"),
)
# What scan cannot open: named in the verdict.
_UNOPENED = {"zstd": "a zstd-compressed file", "7z": "a 7-Zip archive", "rar": "a RAR archive"}
_DECOMPRESSORS: dict[str, Any] = {
    "gzip": lambda file: gzip.GzipFile(fileobj=file, mode="rb"),
    "bzip2": bz2.BZ2File,
    "xz": lzma.LZMAFile,
}
_PICKLE_PROTOCOLS = (b"\x02", b"\x03", b"\x04", b"\x05")
_SUFFIX = re.compile(r"(\.[A-Za-z0-9_]{1,16}){1,2}\Z")


class NotScanned(Exception):
    """The archive went past a bound, or cannot be opened: what it holds was not (all) seen."""


@dataclass(frozen=True)
class Member:
    """One member of an archive that the caller must judge.

    Attributes:
        name: its name in the archive (as written there).
        file: a private copy of its bytes (a regular file, removed once the walk moves on),
            or ``""`` when ``unsafe`` or ``problem`` already says everything.
        unsafe: why unpacking it is itself an attack (it leaves the folder), or ``""``.
        problem: why it was not read (``damaged`` when ``broken``), or ``""``.
        broken: the archive's own checks failed on it (a bad CRC-32, a truncated stream).
    """

    name: str
    file: str = ""
    unsafe: str = ""
    problem: str = ""
    broken: bool = False


def kind(head: bytes) -> str | None:
    """``"zip"``, ``"tar"``, ``"gzip"``, ``"bzip2"``, ``"xz"``, ``"zstd"``, ``"7z"``, ``"rar"`` or None."""
    for magic, name in _ARCHIVES:
        if head.startswith(magic):
            return name
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    return None


def scannable_head(name: str, head: bytes) -> bool:
    """True for a file that ``torch.load``, ``pickle``, numpy, safetensors or an archive tool would open:
    named like a checkpoint, or starting like a pickle, a zip, a tar, a compressed file, safetensors or a ``.npy``
    of objects (numpy loads those with pickle)."""
    if name.lower().endswith(CHECKPOINT_SUFFIXES) or kind(head) is not None:
        return True
    if head[:1] == b"\x80" and head[1:2] in _PICKLE_PROTOCOLS:
        return True
    if head.startswith(b"\x93NUMPY"):  # only an array of objects holds a pickle (numpy's allow_pickle)
        return b"'|O'" in head or b'"|O"' in head
    # safetensors: an 8-byte little-endian header length, then its JSON
    return len(head) > 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < 100 << 20


def _leaves(name: str) -> str:
    """Why unpacking a member called ``name`` writes outside the folder, or ``""``."""
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name):
        return "has an absolute name: unpacking it writes outside the folder it is unpacked in"
    if ".." in parts:
        return "has a name with '..': unpacking it writes outside the folder it is unpacked in"
    return ""


def _link_leaves(name: str, target: str) -> str:
    if target.startswith(("/", "\\")):
        return f"is a link to {target!r}, outside the folder it is unpacked in"
    depth = 0
    for part in [*name.replace("\\", "/").split("/")[:-1], *target.replace("\\", "/").split("/")]:
        if part == "..":
            depth -= 1
            if depth < 0:
                return f"is a link to {target!r}, outside the folder it is unpacked in"
        elif part not in ("", "."):
            depth += 1
    return ""


class _Budget:
    def __init__(self, limit: int) -> None:
        self.left = limit
        self.count = 0

    def member(self) -> None:
        self.count += 1
        if self.count > MAX_MEMBERS:
            raise NotScanned(f"it holds more than {MAX_MEMBERS:,} members (the limit)")

    def take(self, nbytes: int, where: str) -> None:
        self.left -= nbytes
        if self.left < 0:
            raise NotScanned(
                f"it unpacks to more than {MAX_RATIO} times its size (at {where!r}): a compression bomb, or "
                "an archive too big to scan in place; unpack it and scan the folder"
            )


def members(path: str, archive_kind: str, folder: str) -> Iterator[Member]:
    """Every member of the archive at ``path`` (of :func:`kind` ``archive_kind``) that the caller must judge.

    ``folder`` is a private temporary folder; each member's copy in it lives until the next is asked for.

    Raises:
        NotScanned: a bound was passed, or the archive cannot be opened (see the module docstring).
    """
    if archive_kind in _UNOPENED:
        raise NotScanned(f"it is {_UNOPENED[archive_kind]}, which scan cannot open; unpack it and scan the files")
    with read_policy.open_file(path) as file:
        # the size of the file opened (and checked regular), not of whatever the path names by then
        budget = _Budget(MAX_RATIO * os.fstat(file.fileno()).st_size + _SLACK)
        if archive_kind == "zip":
            yield from _zip_members(file, budget, folder)
            return
        if archive_kind == "tar" or _is_tar(file):
            file.seek(0)
            yield from _tar_members(file, budget, folder)
            return
        file.seek(0)
        with _DECOMPRESSORS[archive_kind](file) as stream:
            name = os.path.basename(path)
            inner = name.rsplit(".", 1)[0] if "." in name else name
            budget.member()
            member = _copied(inner, stream, budget, folder, 0)
            yield member
            _remove(member)


def _is_tar(file: IO[bytes]) -> bool:
    """True for a compressed tar (``.tar.gz`` ...), False for one compressed file (``model.pt.gz``)."""
    file.seek(0)
    try:
        with tarfile.open(fileobj=file, mode="r|*") as tar:
            return tar.next() is not None
    except (tarfile.TarError, OSError, EOFError, zlib.error):
        return False


def _copied(name: str, stream: IO[bytes], budget: _Budget, folder: str, count: int) -> Member:
    """The member ``name``, read from ``stream``: skipped (``Member(name)`` with no file) when nothing would
    open it, else copied into ``folder`` (a copy that could not be finished is removed at once)."""
    copy = ""
    try:
        head = stream.read(_HEAD)
        budget.take(len(head), name)
        if not scannable_head(name, head):
            return Member(name)
        if count and shutil.disk_usage(folder).free < count + _ROOM:
            return Member(name, problem=f"it is {count:,} bytes, more than the temporary folder has room for")
        suffix = _SUFFIX.search(os.path.basename(name))
        # A fresh name (mode 0600) in a folder only this process's user can enter; never the member's name.
        descriptor, copy = tempfile.mkstemp(suffix=suffix.group(0).lower() if suffix else "", dir=folder)
        with os.fdopen(descriptor, "wb") as out:
            out.write(head)
            written = len(head)
            while chunk := stream.read(_CHUNK):
                budget.take(len(chunk), name)
                out.write(chunk)
                written += len(chunk)
                if written % _ROOM < len(chunk) and shutil.disk_usage(folder).free < _ROOM:
                    # a compressed file says nothing of its size up front: the room is checked as it grows
                    _remove(Member(name, file=copy))
                    return Member(name, problem="it unpacks to more than the temporary folder has room for")
    except NotScanned:
        _remove(Member(name, file=copy))
        raise
    except (OSError, EOFError, zipfile.BadZipFile, tarfile.TarError, lzma.LZMAError, zlib.error) as error:
        _remove(Member(name, file=copy))
        return Member(name, problem=f"cannot be unpacked ({error})", broken=True)
    return Member(name, file=copy)


def _zip_members(file: IO[bytes], budget: _Budget, folder: str) -> Iterator[Member]:
    try:
        archive = zipfile.ZipFile(file)
        infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as error:
        raise NotScanned(f"its zip directory cannot be read ({error})") from None
    if len(infos) > MAX_MEMBERS:
        raise NotScanned(f"it holds {len(infos):,} members, more than {MAX_MEMBERS:,} (the limit)")
    for info in infos:
        budget.member()
        leaves = _leaves(info.filename)
        if leaves:
            yield Member(info.filename, unsafe=leaves)
            continue
        mode = info.external_attr >> 16
        if stat.S_ISLNK(mode):
            target = archive.read(info)[:4096].decode("utf-8", "replace") if info.file_size < 4096 else "/"
            leaves = _link_leaves(info.filename, target)
            if leaves:
                yield Member(info.filename, unsafe=leaves)
            continue
        if info.is_dir():
            continue
        if info.flag_bits & 1:
            yield Member(info.filename, problem="it is encrypted: scan cannot read it")
            continue
        try:
            stream = archive.open(info)
        except (zipfile.BadZipFile, NotImplementedError, OSError, ValueError) as error:
            yield Member(info.filename, problem=f"cannot be unpacked ({error})", broken=True)
            continue
        with stream:
            member = _copied(info.filename, stream, budget, folder, info.file_size)
        yield member
        _remove(member)


def _tar_members(file: IO[bytes], budget: _Budget, folder: str) -> Iterator[Member]:
    try:
        tar = tarfile.open(fileobj=file, mode="r|*")  # noqa: SIM115 - closed below; a stream: members in order, each read once
    except (tarfile.TarError, OSError, EOFError) as error:
        raise NotScanned(f"it cannot be read as a tar archive ({error})") from None
    with tar:
        while True:
            try:
                info = tar.next()
            except (tarfile.TarError, OSError, EOFError, lzma.LZMAError, zlib.error) as error:
                yield Member("(the rest of the archive)", problem=f"cannot be read ({error})", broken=True)
                return
            if info is None:
                return
            budget.member()
            leaves = _leaves(info.name)
            if leaves:
                yield Member(info.name, unsafe=leaves)
                continue
            if info.issym() or info.islnk():
                leaves = _link_leaves(info.name, info.linkname) if info.issym() else _leaves(info.linkname)
                if leaves:
                    yield Member(info.name, unsafe=leaves)
                continue
            if info.ischr() or info.isblk() or info.isfifo():
                yield Member(info.name, unsafe="is a device file or FIFO: unpacking it makes one")
                continue
            if not info.isreg():
                continue
            budget.take(info.size, info.name)  # before reading it
            stream = tar.extractfile(info)
            if stream is None:
                continue
            member = _copied(info.name, stream, _Budget(info.size + _HEAD), folder, info.size)
            yield member
            _remove(member)


def _remove(member: Member) -> None:
    if member.file:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(member.file)


@contextlib.contextmanager
def private_folder() -> Iterator[str]:
    """A temporary folder only this process's user can enter, removed with what is in it."""
    with tempfile.TemporaryDirectory(prefix="ckptconv-scan-") as folder:
        yield folder
