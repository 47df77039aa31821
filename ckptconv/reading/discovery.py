"""Discover: find the checkpoints under a folder.

:func:`discover` walks a folder and returns one :class:`Item` per checkpoint (no
tensor is read, no torch is imported); ``ckptconv batch`` converts them
(:mod:`ckptconv.batching.outputs` names their outputs) and ``ckptconv scan``
scans them.

What counts as one item:

* a file whose **name** ends in a checkpoint suffix (``.pt``, ``.pth``,
  ``.bin``, ``.pkl``, ``.pickle``, ``.ckpt``, ``.safetensors``, ``.pth.tar``,
  ``.pt.tar``), whatever its content, so that a broken ``model.pt`` is reported
  rather than silently passed over;
* any other file whose **content** is a torch zip checkpoint, a legacy torch
  file or safetensors (plain pickles are only taken by suffix: too many other
  things are pickles);
* a **sharded checkpoint**: a ``*.index.json`` with a ``weight_map`` and the
  shards it names count as one item, the shards are never items of their own;
* a **DCP folder** (``torch.distributed.checkpoint``: ``.metadata`` and
  ``*.distcp``) is one item;
* a **model folder** (with ``models=True``, as ``ckptconv batch`` asks): a folder that
  :func:`ckptconv.reading.model_folder.resolve_model` takes as a model (its weights, one file
  or an index and shards, beside a ``config.json`` or PEFT's ``adapter_config.json``; a
  training run's ``checkpoint-500/``; a folder of model folders) is one item, converted as
  ``ckptconv convert`` converts it, into a model folder; the files at its top (training state
  beside the weights included) and its parts are not items of their own;
* a **training run's folder** as DeepSpeed writes it (``latest`` naming a tag
  folder of per-rank model and optimizer states, or the tag folder itself) is
  one item: its latest checkpoint; the folders inside it are not walked. So is
  a folder of per-rank DTensor files (``model_world_size_2_rank_0.pt`` ...); the
  other files beside them (verl's ``optim_*``/``extra_state_*``) are not items.

Hidden files and folders (``.git``, the ``.partial`` files of unfinished
writes) and everything else (``config.json``, ``README.md``) are left alone.
With ``globs``, only items whose relative path matches one of them are kept.

What is never read (:mod:`ckptconv.reading.read_policy`), each skipped with a note:
a link that leads outside the source folder (a zoo must not pull in files
from elsewhere: follow it by copying the file in), and a FIFO, device or
socket with a checkpoint's name (reading one would block or never end).
Links to files that stay inside the source folder are followed; links to
folders are never followed. Shards that an index names are part of its item,
also when they lie in a subfolder, and never items of their own.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ckptconv._paths import PathLike, as_path, missing
from ckptconv.errors import LoadError
from ckptconv.reading import read_policy
from ckptconv.suffixes import CHECKPOINT_SUFFIXES, DCP_DATA_SUFFIX, DCP_METADATA, INDEX_SUFFIX

__all__ = [
    "Item",
    "discover",
    "folder_above",
    "refusal",
    "unread_files",
]


FILE = "file"
SHARDED = "sharded"
DCP = "dcp"
RUN = "run"
MODEL = "model"

# Longest first, so "x.pth.tar" loses ".pth.tar", not ".tar".


@dataclass(frozen=True)
class Item:
    """One checkpoint to convert.

    Attributes:
        name: its path relative to the source folder, ``/``-separated: the file,
            the ``*.index.json`` of a sharded checkpoint, or the DCP folder.
        path: the absolute path of the same.
        kind: ``"file"``, ``"sharded"``, ``"dcp"``, ``"run"`` (a DeepSpeed run folder) or ``"model"``
            (a model folder: :class:`ckptconv.reading.model_folder.Model`).
        size: bytes, summed over every file of the item.
        mtime_ns: the latest modification time among its files.
        members: for sharded, DCP, run and model items, every file it consists of (relative
            paths, the index first; a model folder's weights, then the files it carries); empty for a single file.
    """

    name: str
    path: str
    kind: str
    size: int
    mtime_ns: int
    members: tuple[str, ...] = ()


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """A path glob: ``**/`` spans folders (or none), ``*`` and ``?`` stay within one."""
    out = []
    index = 0
    pattern = pattern.replace(os.sep, "/").lstrip("/")
    while index < len(pattern):
        char = pattern[index]
        if pattern.startswith("**/", index):
            out.append("(?:.*/)?")
            index += 3
            continue
        if pattern.startswith("**", index):
            out.append(".*")
            index += 2
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[":
            end = pattern.find("]", index + 2 if pattern[index + 1 : index + 2] in ("!", "]") else index + 1)
            if end == -1:
                out.append(re.escape(char))
            else:
                body = pattern[index + 1 : end]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append(f"[{body.replace(chr(92), chr(92) * 2)}]")
                index = end
        else:
            out.append(re.escape(char))
        index += 1
    return re.compile("".join(out) + r"\Z")


def _stat(path: str) -> tuple[int, int]:
    try:
        info = os.stat(path)
    except OSError:
        return 0, 0  # a dangling link; converting it reports why
    return info.st_size, info.st_mtime_ns


def _run_members(folder: str) -> tuple[list[str], bool] | None:
    """The files of the training-run checkpoint ``folder`` holds (relative, ``/``-separated), and
    whether the folders inside it belong to it; None if it holds none."""
    from ckptconv.errors import CkptconvError
    from ckptconv.reading.formats import deepspeed, megatron_legacy, rank_shards

    try:
        files = deepspeed.checkpoint_files(folder) or megatron_legacy.checkpoint_files(folder)
    except (CkptconvError, OSError):
        return None
    if files is not None:
        return [os.path.relpath(path, folder).replace(os.sep, "/") for path in files], True
    shards = rank_shards.find_files(folder)
    if shards is not None:
        return [os.path.basename(path) for path in shards + rank_shards.sibling_files(folder, shards)], False
    return None


def _model_members(folder: str, names: Sequence[str]) -> tuple[list[str], tuple[str, ...]] | None:
    """The files of the model ``folder`` is (relative, ``/``-separated: its weights, then what it carries, then
    its parts' files), and its parts; None when it is no model folder (see the module docstring)."""
    from ckptconv.errors import CkptconvError
    from ckptconv.reading.model_folder import ADAPTER_CONFIG_NAME, CONFIG_NAME, DECLARATIONS, resolve_model

    if not any(name in (CONFIG_NAME, ADAPTER_CONFIG_NAME, *DECLARATIONS) for name in names):
        return None
    model = resolve_model(folder, strict=False)
    if model is None:
        return None
    members = [os.path.relpath(path, folder).replace(os.sep, "/") for path in model.weights]
    # A file beside the weights that must not be read (a link out): converting the item says so, and fails it.
    with contextlib.suppress(CkptconvError, OSError):
        members += [name for name in model.inventory.carried if name not in members]
    for part in model.parts:
        below = resolve_model(os.path.join(folder, part), strict=False)
        files = below.weights if below is not None else ()
        members += [os.path.relpath(path, folder).replace(os.sep, "/") for path in files]
    return members, model.parts


def unread_files(item: Item) -> list[str]:
    """The checkpoint files inside a ``run`` item's folder that converting it does not read
    (older tags, optimizer files beside per-rank model files), for a scanner to look at."""
    from ckptconv.reading.detection import is_checkpoint_file
    from ckptconv.reading.formats import deepspeed, megatron_legacy, rank_shards

    read = set(
        deepspeed.checkpoint_files(item.path)
        or megatron_legacy.checkpoint_files(item.path)
        or rank_shards.find_files(item.path)
        or []
    )
    extra = []
    for folder, subfolders, filenames in os.walk(item.path):
        subfolders.sort()
        for name in sorted(filenames):
            path = os.path.join(folder, name)
            if path not in read and is_checkpoint_file(path):
                extra.append(path)
    return extra


def _index_shards(path: str, folder: str) -> list[str] | None:
    """The shard file names a ``*.index.json`` names; None if it is not a readable index."""
    from ckptconv.errors import CkptconvError
    from ckptconv.reading.formats.sharded import read_index

    try:
        weight_map, _ = read_index(path, folder=folder)
    except (CkptconvError, OSError):
        return None
    return sorted({str(shard) for shard in weight_map.values()})


def folder_above(path: str, name: str) -> str:
    """The folder that ``path`` is ``name`` (``/``-separated, relative) inside of."""
    for _ in name.split("/"):
        path = os.path.dirname(path)
    return path


def refusal(item: Item, excluded: Iterable[str] = ()) -> str:
    """Why ``item`` must not be read now, or ``""``: the rules :func:`discover` applied, asked again
    when the item is converted (it may have become a link out of the source folder since)."""
    root = folder_above(item.path, item.name)
    if os.path.islink(item.path) and os.path.isdir(item.path):
        return f"a link to a folder (to {os.readlink(item.path)!r}); not followed"
    if os.path.isdir(item.path) or not os.path.lexists(item.path):
        return ""  # a folder item (DCP, a training run): its files are read by its format's rules
    return _refusal(item.path, root, excluded)


def _refusal(path: str, root: str, excluded: Iterable[str] = ()) -> str:
    """Why ``path`` (found under ``root``) must not be read, or ``""``."""
    if os.path.islink(path):
        if not read_policy.found_inside(path, root):
            return f"a link that leads outside the source folder (to {os.readlink(path)!r}); not followed"
        if any(read_policy.inside(path, folder) for folder in excluded):
            return f"a link into the output folder (to {os.readlink(path)!r}); not followed"
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return ""  # a dangling link: converting it says so
    if not stat.S_ISREG(mode):
        return f"{read_policy.kind_of(mode)}, not a regular file"
    return ""


def _looks_relevant(name: str) -> bool:
    return (
        name.lower().endswith((*CHECKPOINT_SUFFIXES, DCP_DATA_SUFFIX))
        or name.endswith(INDEX_SUFFIX)
        or name == DCP_METADATA
    )


def member_paths(item: Item) -> list[str]:
    """The absolute paths of a sharded, DCP or run item's files (the item's own path for a single file)."""
    if item.kind == FILE:
        return [item.path]
    folder = os.path.dirname(item.path) if item.kind == SHARDED else item.path
    prefix = item.name.rsplit("/", 1)[0] if item.kind == SHARDED and "/" in item.name else ""
    if item.kind in (DCP, RUN, MODEL) and all(member.startswith(item.name + "/") for member in item.members):
        prefix = item.name
    return [
        os.path.join(folder, *(member[len(prefix) + 1 :] if prefix else member).split("/")) for member in item.members
    ]


def _relative(root: str, path: str) -> str:
    relative = os.path.relpath(path, root)
    return "" if relative == "." else relative.replace(os.sep, "/")


def _join(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def _group(root: str, folder: str, rel_folder: str, name: str, kind: str, members: Sequence[str]) -> Item:
    sizes = [_stat(os.path.join(folder, member)) for member in members]
    path = os.path.join(folder, name) if kind == SHARDED else folder
    rel = (rel_folder or os.path.basename(root)) if kind in (DCP, RUN, MODEL) else _join(rel_folder, name)
    return Item(
        name=rel,
        path=path,
        kind=kind,
        size=sum(size for size, _ in sizes),
        mtime_ns=max((mtime for _, mtime in sizes), default=0),
        members=tuple(_join(rel_folder, member) for member in members),
    )


def discover(
    source_dir: PathLike,
    *,
    globs: Iterable[str] = (),
    exclude: Iterable[PathLike] = (),
    notes: list[str] | None = None,
    unlisted: list[tuple[str, str]] | None = None,
    models: bool = False,
) -> list[Item]:
    """Every checkpoint under ``source_dir``, sorted by relative path.

    Args:
        source_dir: the folder to walk (recursively; links to folders are not followed).
        globs: keep only items whose relative path, or one of whose files,
            matches one of these (``"**/*.pth"``, ``"runs/*/last.ckpt"``).
        exclude: folders to leave out (the output folder, when it is inside),
            whatever their spelling (links are resolved).
        notes: when given, a sentence is appended for every file skipped because
            it must not be read (a link leading outside, a FIFO): see the module docstring.
        unlisted: when given, ``(folder, why)`` is appended for every folder that could not be
            listed (no permission, a path deeper than PATH_MAX), and the walk goes on; when
            None, such a folder is an error. Either way it is never passed over in silence:
            what it holds would go unconverted and unscanned.
        models: a model folder is one item (kind ``"model"``, see the module docstring); without it
            (``scan``, which looks at every file), its files are items one by one.

    Returns:
        One :class:`Item` per checkpoint.

    Raises:
        LoadError: ``source_dir`` is missing or not a folder, or (without ``unlisted``) a folder
            under it cannot be listed.

    Example:
        >>> [item.name for item in discover("zoo")]  # doctest: +SKIP
        ['a/model.pth', 'hf/model.safetensors.index.json', 'run1/dcp']
    """
    from ckptconv.reading.detection import is_checkpoint_file

    shown = as_path(source_dir)
    given = os.path.abspath(shown)
    if not os.path.exists(given):
        raise LoadError(f"{missing(shown)}; check the path", path=given)
    if not os.path.isdir(given):
        raise LoadError(f"{shown!r} is not a folder; use `ckptconv convert` for one file", path=given)
    root = os.path.realpath(given)  # SRC spelled through a link: walk (and compare) the real folder
    excluded = {os.path.realpath(as_path(path)) for path in exclude}
    patterns = [_glob_regex(pattern) for pattern in globs]
    items: list[Item] = []
    claimed: set[str] = set()  # files an index in a folder above claimed as its shards
    skipped = notes if notes is not None else []

    def cannot_list(error: OSError) -> None:
        folder = str(error.filename or root)
        why = error.strerror or str(error)
        if unlisted is None:
            raise LoadError(
                f"{_relative(root, folder) or shown!r} in {shown!r} cannot be listed ({why}); what it holds "
                "would be missed, so stopping (move it higher up, or fix its permissions)",
                path=folder,
            )
        unlisted.append((folder, why))

    for folder, subfolders, found_names in os.walk(root, onerror=cannot_list):
        subfolders[:] = sorted(
            name for name in subfolders if not name.startswith(".") and os.path.join(folder, name) not in excluded
        )
        rel_folder = _relative(root, folder)
        names = []
        for name in sorted(found_names):
            path = os.path.join(folder, name)
            if path in claimed:
                continue
            reason = _refusal(path, root, excluded)
            if reason:
                if _looks_relevant(name):
                    skipped.append(f"skipped {_join(rel_folder, name)!r}: {reason}")
                continue
            names.append(name)
        filenames = set(names)
        taken: set[str] = set()
        found: list[Item] = []
        run = _run_members(folder)
        model = _model_members(folder, names) if models and run is None else None
        if model is not None:
            # A model folder: one item, converted into a model folder. Its parts are in it; a subfolder
            # that is no part of it (checkpoint-500/ beside the model) is walked as ever.
            members, parts = model
            subfolders[:] = [name for name in subfolders if name not in parts]
            claimed.update(os.path.join(folder, *member.split("/")) for member in members if "/" in member)
            found.append(_group(root, folder, rel_folder, "", MODEL, members))
            taken.update(names)
        elif run is not None:
            # One checkpoint of a training run: its latest (older DeepSpeed tags inside are not
            # items), or its per-rank model files (their optimizer files beside them are not
            # either). Other checkpoints beside it (an exported pytorch_model.bin) still are.
            members, owns_subfolders = run
            if owns_subfolders:
                subfolders[:] = []
            found.append(_group(root, folder, rel_folder, "", RUN, members))
            taken.update(members)
        elif DCP_METADATA in names and any(name.endswith(DCP_DATA_SUFFIX) for name in names):
            # torch.distributed.checkpoint writes one folder per checkpoint.
            members = [DCP_METADATA] + [name for name in names if name != DCP_METADATA]
            found.append(_group(root, folder, rel_folder, "", DCP, members))
            taken.update(names)
        for name in names:
            if name in taken or not name.endswith(INDEX_SUFFIX) or name.startswith("."):
                continue
            shards = _index_shards(os.path.join(folder, name), folder)
            if shards is None:
                continue  # some other *.index.json; not a checkpoint
            present = [shard for shard in shards if "/" not in shard and shard in filenames]
            below = [
                shard
                for shard in shards
                if "/" in shard
                and ".." not in shard.split("/")
                and os.path.isfile(os.path.join(folder, *shard.split("/")))
                and read_policy.within(os.path.join(folder, *shard.split("/")), folder)
            ]
            claimed.update(os.path.join(folder, *shard.split("/")) for shard in below)
            found.append(_group(root, folder, rel_folder, name, SHARDED, [name, *present, *below]))
            taken.update([name, *present])
        for name in names:
            if name in taken or name.startswith("."):
                continue
            path = os.path.join(folder, name)
            if is_checkpoint_file(path):
                size, mtime = _stat(path)
                found.append(Item(_join(rel_folder, name), path, FILE, size, mtime))
        for item in found:
            if not patterns or any(p.match(name) for p in patterns for name in (item.name, *item.members)):
                items.append(item)
    return sorted(items, key=lambda item: item.name)
