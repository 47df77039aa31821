"""A folder output as one transaction: every file staged beside the destination, published by one rename.

A model folder (weights or shards and their index, the configs and tokenizer carried beside them, the rewritten
``config.json``) and any folder output (shards, a DCP folder) are written into a staging folder beside the
destination, on the same file system, named so that nothing takes it for an output
(``.DST.ckptconv-staging-<pid>-<random>``: hidden, so discovery and batch skip it). Then:

* a fresh destination: the staging folder is renamed to it (``renameat2(RENAME_NOREPLACE)``);
* an existing one: every entry of it that the new output does not replace or drop is hard-linked into the staging
  folder at the same name (copied where links cannot be made), so that nothing ckptconv did not write is lost,
  and the two folders are exchanged in one step (``renameat2(RENAME_EXCHANGE)``); the old folder, now under the
  staging name, is then removed entry by entry: only the names the new folder holds too (replaced, or linked
  across) and the old output's files ckptconv wrote that the new output drops (:attr:`FolderTransaction.drop`:
  shards of an earlier output, by their provenance). Where the file system cannot exchange, the old folder is
  renamed aside and the staging folder into place, and the next writer renames the old one back if it was
  killed between the two.

So at every instant the destination is the old folder, byte for byte, or the new one whole: a failure or a signal
at any step before the exchange leaves the old folder untouched (and a fresh destination absent), and any step
after it leaves the new one. The staging folder's name, and whether the exchange happened (the staging folder's
device and inode), are recorded in the output's lock file (:mod:`.locks`) before each step: a writer killed by
SIGKILL leaves that record, and the next writer of the same output, holding the lock, removes what the killed one
provably made and nothing else. Ctrl-C and SIGTERM are held back from the first link to the end of the exchange.

Every step that writes or removes a file calls :func:`ckptconv.writing.faults.point` first, so the tests fail
each step in turn.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import errno
import functools
import os
import re
import shutil
import stat
import sys
from collections.abc import Iterable, Iterator
from typing import Any, Callable

from ckptconv.errors import CkptconvError, WriteError
from ckptconv.reading.read_policy import inside
from ckptconv.runtime.signals import signals_deferred
from ckptconv.writing import faults, write_policy
from ckptconv.writing.locks import OutputLock, resolved, short_name
from ckptconv.writing.staging import remove_abandoned_staging

__all__ = ["FolderTransaction", "enclosing", "enclosing_part", "is_staging", "locked", "published_outputs"]

_STAGING = re.compile(r"\A\..+\.ckptconv-(?:staging|old)-\d+-[0-9a-f]{8}\Z")

_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


# The folder outputs this process published, in order: a Ctrl-C that comes after one was published says so.
_PUBLISHED: list[str] = []


def published_outputs(*, forget: bool = False) -> tuple[str, ...]:
    """The folder outputs published (whole) in this process since the last ``forget``."""
    outputs = tuple(_PUBLISHED)
    if forget:
        _PUBLISHED.clear()
    return outputs


def is_staging(name: str) -> bool:
    """True when ``name`` is a transaction's staging (or set-aside) folder: never an output, never a source."""
    return bool(_STAGING.match(name))


@functools.cache
def _renameat2() -> Callable[[str, str, int], None] | None:
    """``renameat2(old, new, flags)`` of the C library (Linux, glibc 2.28 and later), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int

    def rename(old: str, new: str, flags: int) -> None:
        if function(_AT_FDCWD, os.fsencode(old), _AT_FDCWD, os.fsencode(new), flags) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), new)

    return rename


def _unsupported(error: OSError) -> bool:
    return error.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def _fsync_folder(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _identity(path: str) -> list[int] | None:
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return [info.st_dev, info.st_ino] if stat.S_ISDIR(info.st_mode) else None


def _relative(root: str, path: str) -> str:
    return os.path.relpath(path, root).replace(os.sep, "/")


def _remove_replaced(old: str, new: str, drop: Iterable[str]) -> bool:
    """Remove from the replaced folder ``old`` every file the new folder ``new`` holds too (replaced, or linked
    across) and those of ``drop``, then its empty folders; True when nothing is left of it."""
    dropped = set(drop)
    for root, folders, files in os.walk(old, topdown=False):
        for name in files + [folder for folder in folders if os.path.islink(os.path.join(root, folder))]:
            path = os.path.join(root, name)
            relative = _relative(old, path)
            if relative in dropped or os.path.lexists(os.path.join(new, *relative.split("/"))):
                faults.point(f"remove old {relative}")
                os.unlink(path)
        for name in folders:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(root, name))
    try:
        os.rmdir(old)
    except OSError:
        return False
    return True


class FolderTransaction:
    """The staging folder of one folder output, and its publication.

    Args:
        lock: the output's lock, held (:class:`~ckptconv.writing.locks.OutputLock`): its destination is the output.
        inputs: the input's files: the output may not be, or hold, one of them.
        fsync: make every step durable before the next (folders synced around the renames).

    Attributes:
        destination: the output folder (links resolved).
        path: the staging folder, where the new output's files are written.
        drop: relative names of the old output's files (ckptconv's own) that the new one removes.
        kept: after :meth:`publish`, the relative names of the old folder's files carried into the new one.

    Raises:
        WriteError: the destination is a file or a mount point, or holds a file of the input; the staging
            folder cannot be made.
    """

    def __init__(self, lock: OutputLock, *, inputs: write_policy.Inputs, fsync: bool = True) -> None:
        self.destination = lock.destination
        self.parent, name = os.path.split(self.destination)
        self.fsync = fsync
        self.drop: set[str] = set()
        self.kept: tuple[str, ...] = ()
        self.leftover: str | None = None
        self._lock = lock
        self._prefix = f".{short_name(name)}.ckptconv-"
        destination = self.destination
        if os.path.lexists(destination) and not os.path.isdir(destination):
            raise WriteError(f"{destination!r} is a file; give a folder for a sharded or DCP output", path=destination)
        if os.path.isdir(destination) and os.path.ismount(destination):
            raise WriteError(
                f"{destination!r} is a mount point; ckptconv publishes a folder output by renaming it into place, "
                "so give a folder inside it",
                path=destination,
            )
        for source in inputs.files:
            if os.path.isdir(destination) and inside(source, destination):
                raise WriteError(
                    f"refusing to write {destination!r} onto its own input: the folder holds {source!r}, which must "
                    "never be replaced or deleted; choose another output folder",
                    path=destination,
                )
        if lock.previous is not None:
            self._recover(lock.previous)
            lock.previous = None
        remove_abandoned_staging(destination, inputs=inputs)  # an earlier version's, inside the folder
        token = f"{os.getpid()}-{os.urandom(4).hex()}"
        self.path = os.path.join(self.parent, f"{self._prefix}staging-{token}")
        self._aside = os.path.join(self.parent, f"{self._prefix}old-{token}")
        lock.record(staging=os.path.basename(self.path), identity=None, aside=None, drop=[])
        try:
            faults.point("make the staging folder")
            os.mkdir(self.path)
        except OSError as error:
            raise write_policy.os_error(error, self.destination) from None
        self._identity = _identity(self.path)
        try:
            lock.record(identity=self._identity)
        except BaseException:
            self.discard()
            raise

    # -- the staging folder

    def drop_old(self, names: Iterable[str]) -> None:
        """The old output's files ``names`` (relative), which ckptconv wrote, go when the new output is published."""
        self.drop.update(names)

    def final(self, path: str) -> str:
        """The name ``path`` (in the staging folder) has once published."""
        if path == self.path or path.startswith(self.path + os.sep):
            return self.destination + path[len(self.path) :]
        return path

    def named_finally(self, error: CkptconvError) -> None:
        """Make ``error`` name the files it met by their final names, not where they were staged."""
        error.message = error.message.replace(self.path, self.destination)
        error.args = (error.message, *error.args[1:])
        if error.path is not None:
            error.path = self.final(error.path)

    @contextlib.contextmanager
    def undone_on_failure(self) -> Iterator[None]:
        """On any failure in the block: the staging folder goes, and the error names the files by their final
        names."""
        try:
            yield
        except BaseException as error:
            self.discard()
            if isinstance(error, CkptconvError):
                self.named_finally(error)
            raise

    def discard(self) -> None:
        """Remove the staging folder and what it holds (this write's files, and links to the old folder's)."""
        if self._identity is not None and _identity(self.path) == self._identity:
            shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            self._lock.record(staging=None, identity=None)

    # -- publication

    def publish(self) -> tuple[str, ...]:
        """Make the staged folder the destination in one step (the module's docstring says how); returns the old
        folder's files carried across (:attr:`kept`).

        Raises:
            WriteError: a step before the exchange failed: the destination is as it was, the staging folder gone.
        """
        try:
            with signals_deferred():
                if os.path.lexists(self.destination):
                    self._replace()
                else:
                    faults.point("rename the staging folder into place")
                    self._rename(self.path, self.destination)
                    _PUBLISHED.append(self.destination)
                    if self.fsync:
                        _fsync_folder(self.parent)
                with contextlib.suppress(OSError):  # a record left behind names a folder that is gone: harmless
                    self._lock.record(staging=None, identity=None, aside=None, drop=[])
        except OSError as error:
            self.discard()
            if isinstance(error, WriteError):
                raise
            raise write_policy.os_error(error, self.destination) from None
        except BaseException:
            self.discard()
            raise
        return self.kept

    def _rename(self, old: str, new: str) -> None:
        rename = _renameat2()
        if rename is not None:
            try:
                rename(old, new, _RENAME_NOREPLACE)
                return
            except OSError as error:
                if not _unsupported(error):
                    raise
        if os.path.lexists(new):  # without RENAME_NOREPLACE, rename() would replace an empty folder
            raise FileExistsError(errno.EEXIST, "exists", new)
        os.rename(old, new)

    def _replace(self) -> None:
        self.kept = tuple(self._carry_over())
        with contextlib.suppress(OSError):
            os.chmod(self.path, stat.S_IMODE(os.stat(self.destination).st_mode))
        if self.fsync:
            _fsync_folder(self.path)
        self._lock.record(drop=sorted(self.drop))
        old = self._exchange()
        # The new folder is in place: what follows only tidies up, and a failure there (or a kill, which the
        # next writer finishes from the lock file's record) never touches the new output.
        try:
            done = _remove_replaced(old, self.destination, self.drop)
        except Exception:
            self._lock.keep_record()  # the next writer of this output finishes the tidying
            return
        if not done:
            self._leave(old)

    def _exchange(self) -> str:
        """Swap the staging folder and the destination; returns where the old folder is now."""
        rename = _renameat2()
        faults.point("exchange the staging folder and the destination")
        if rename is not None:
            try:
                rename(self.path, self.destination, _RENAME_EXCHANGE)
            except OSError as error:
                if not _unsupported(error):
                    raise
            else:
                _PUBLISHED.append(self.destination)
                if self.fsync:
                    _fsync_folder(self.parent)
                return self.path
        self._lock.record(aside=os.path.basename(self._aside))
        os.rename(self.destination, self._aside)
        try:
            faults.point("rename the staging folder into place")
            os.rename(self.path, self.destination)
        except BaseException:
            os.rename(self._aside, self.destination)
            raise
        _PUBLISHED.append(self.destination)
        if self.fsync:
            _fsync_folder(self.parent)
        return self._aside

    def _leave(self, old: str) -> None:
        """Files the old folder still holds that were neither replaced nor carried (they appeared during the
        exchange): never removed. The folder is left under a name no writer cleans up, and named in a note."""
        self._lock.record(staging=None, identity=None, aside=None)
        with contextlib.suppress(OSError):
            kept = f"{self.destination}.ckptconv-previous-{os.urandom(4).hex()}"
            os.rename(old, kept)
            self.leftover = kept

    def _carry_over(self) -> list[str]:
        """Link into the staging folder every entry of the destination that the new output neither replaces (the
        same name) nor drops; return their names."""
        kept: list[str] = []

        def visit(relative: str) -> None:
            folder = os.path.join(self.destination, *relative.split("/")) if relative else self.destination
            for name in sorted(os.listdir(folder)):
                name_relative = f"{relative}/{name}" if relative else name
                if name_relative in self.drop:
                    continue
                source = os.path.join(folder, name)
                target = os.path.join(self.path, *name_relative.split("/"))
                info = os.lstat(source)
                if stat.S_ISDIR(info.st_mode):
                    if not os.path.lexists(target):
                        faults.point(f"keep {name_relative}/")
                        os.mkdir(target)
                        with contextlib.suppress(OSError):
                            os.chmod(target, stat.S_IMODE(info.st_mode))
                    elif not os.path.isdir(target) or os.path.islink(target):
                        continue  # the new output's file of that name replaces the folder
                    visit(name_relative)
                    continue
                if os.path.lexists(target):
                    continue  # replaced by the new output's file
                faults.point(f"keep {name_relative}")
                _link(source, target, info)
                kept.append(name_relative)

        visit("")
        return kept

    def _recover(self, record: dict[str, Any]) -> None:
        """Finish or undo what the killed writer that left ``record`` was doing, touching only what it made."""
        names = {key: record.get(key) for key in ("staging", "aside")}
        paths = {
            key: os.path.join(self.parent, name)
            for key, name in names.items()
            if isinstance(name, str) and name.startswith(self._prefix) and is_staging(name)
        }
        identity = record.get("identity")
        drop = [name for name in record.get("drop") or () if isinstance(name, str)]
        aside = paths.get("aside")
        if aside is not None and _identity(aside) is not None and not os.path.lexists(self.destination):
            os.rename(aside, self.destination)  # killed between its two renames: the old folder comes back
        published = identity is not None and _identity(self.destination) == identity
        for path in paths.values():
            if _identity(path) is None:
                continue
            if published:  # the old folder, replaced
                if not _remove_replaced(path, self.destination, drop):
                    self._leave(path)
            elif path == paths.get("staging") and _identity(path) == identity:
                shutil.rmtree(path, ignore_errors=True)  # never published: this write's files, links to the old
            else:
                with contextlib.suppress(OSError):
                    os.rmdir(path)  # made, and killed before it was recorded: empty


def _link(source: str, target: str, info: os.stat_result) -> None:
    """Give ``target`` the file ``source`` (a hard link; a copy where the file system has none)."""
    try:
        os.link(source, target, follow_symlinks=False)
        return
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.EXDEV, errno.ENOTSUP):
            raise
    if stat.S_ISLNK(info.st_mode):
        os.symlink(os.readlink(source), target)
    elif stat.S_ISREG(info.st_mode):
        shutil.copy2(source, target, follow_symlinks=False)
    else:
        raise WriteError(
            f"cannot carry {source!r} into the new output: it is not a regular file and cannot be linked; move it out "
            "of the folder first",
            path=source,
        )


class _Part:
    """A folder inside an enclosing transaction's output (a diffusers component, ``unet/``): written into that
    transaction's staging folder, published with it."""

    leftover: str | None = None

    def __init__(self, outer: FolderTransaction, relative: str) -> None:
        self.outer = outer
        self.relative = relative
        self.destination = os.path.join(outer.destination, relative) if relative else outer.destination
        self.path = os.path.join(outer.path, relative) if relative else outer.path
        write_policy.make_folders(self.path, root=outer.path)

    def drop_old(self, names: Iterable[str]) -> None:
        self.outer.drop_old(f"{self.relative}/{name}" if self.relative else name for name in names)

    def final(self, path: str) -> str:
        return self.outer.final(path)

    def named_finally(self, error: CkptconvError) -> None:
        self.outer.named_finally(error)

    @contextlib.contextmanager
    def undone_on_failure(self) -> Iterator[None]:
        try:
            yield
        except CkptconvError as error:
            self.named_finally(error)
            raise

    def publish(self) -> tuple[str, ...]:
        return ()  # with the enclosing transaction


_ENCLOSING: contextvars.ContextVar[FolderTransaction | None] = contextvars.ContextVar("enclosing", default=None)


def enclosing_part(destination: str) -> _Part | None:
    """The part of the enclosing transaction's output that ``destination`` names, or None outside one."""
    outer = _ENCLOSING.get()
    if outer is None:
        return None
    relative = os.path.relpath(resolved(destination), outer.destination)
    if relative == os.pardir or relative.startswith(os.pardir + os.sep):
        return None
    return _Part(outer, "" if relative == os.curdir else relative.replace(os.sep, "/"))


@contextlib.contextmanager
def enclosing(lock: OutputLock, *, source: str, fsync: bool) -> Iterator[FolderTransaction]:
    """One transaction for every folder output written in the block inside ``lock``'s destination (a folder of
    models: its top and each part), published when the block ends, or discarded when it fails."""
    files = [os.path.join(root, name) for root, _, names in os.walk(source) for name in names]
    transaction = FolderTransaction(lock, inputs=write_policy.Inputs(files), fsync=fsync)
    token = _ENCLOSING.set(transaction)
    try:
        with transaction.undone_on_failure():
            yield transaction
            transaction.publish()
    finally:
        _ENCLOSING.reset(token)


@contextlib.contextmanager
def locked(destination: str | None, *, what: str = "ckptconv") -> Iterator[OutputLock | None]:
    """The lock on ``destination`` for the block (None: nothing is written, or the destination is part of an
    enclosing transaction's output, whose lock covers it); the missing folders above it are made first, and
    removed again when the block fails."""
    if destination is None or enclosing_part(destination) is not None:
        yield None
        return
    parent = os.path.dirname(destination.rstrip("/" + os.sep)) or os.curdir  # as the user spelled it, for errors
    made = write_policy.make_folders(parent) if not os.path.isdir(parent) else []
    try:
        with OutputLock(destination, what=what) as lock:
            yield lock
    except BaseException:
        write_policy.remove_folders(made)
        raise
