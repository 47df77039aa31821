"""Load: open any checkpoint safely on the CPU, lazily.

:func:`open` detects the format from the file's content, reads only its
structure (the pickle, or the safetensors header) and returns a
:class:`Checkpoint` whose tensors are :class:`~ckptconv.values.tensor.TensorRef`
references into the file. No code from the file runs: see
:mod:`ckptconv.reading.unpickling.unpickler`. :func:`load` is the drop-in for
``torch.load(path, map_location="cpu")`` that users want most: the model
weights as real torch tensors.
"""

from __future__ import annotations

import os
import struct
import zipfile
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptconv._paths import PathLike, as_path
from ckptconv.errors import CkptconvError, LoadError, MalformedCheckpointError
from ckptconv.reading import detection as formats
from ckptconv.reading.formats._base import ReadResult
from ckptconv.runtime.collector import collector_paused
from ckptconv.selection.state_dicts import branches, part_text
from ckptconv.selection.weights import Selection, select_weights
from ckptconv.values.standins import NumpyArray
from ckptconv.values.tensor import Storage, TensorRef

if TYPE_CHECKING:
    import torch

__all__ = ["Checkpoint", "load", "open"]


# What parsing a hostile file can raise from the standard library's zip, json
# and struct code; each becomes a MalformedCheckpointError.
_PARSE_FAILURES = (
    ValueError,
    TypeError,
    IndexError,
    KeyError,
    AttributeError,
    struct.error,
    OverflowError,
    RecursionError,
    MemoryError,
    UnicodeError,
    EOFError,
    zipfile.BadZipFile,
    NotImplementedError,
)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint file, opened lazily: its structure is in memory, its tensor bytes are not.

    Attributes:
        path: the file.
        format: ``"torch-zip"``, ``"torch-legacy"``, ``"safetensors"``, ``"pickle"``, ``"sharded"`` or ``"dcp"``.
        tree: the object the file holds. Tensors are :class:`TensorRef`; objects of
            classes ckptconv does not resolve are inert
            :class:`~ckptconv.values.standins.ForeignObject` stand-ins.
        foreign_globals: the classes and functions that became stand-ins, with
            how many objects each built. Nothing named here was imported or called.
        saved_devices: devices the tensors were saved from (``{"cuda:1"}``); they
            are always loaded on the CPU.
        metadata: the file's string metadata (safetensors ``__metadata__``).
        size: the file's size in bytes.
        trusted: True when the file was unpickled by torch with ``trust=True``.
        files: every file the checkpoint consists of: the file itself, or the index
            and all its shards, or ``.metadata`` and the chunk files. Writers never
            replace or delete any of them.
        notes: what the reader found the user should know, as sentences (a file saved under
            ``torch.serialization.skip_data``, whose tensors are zeros).
    """

    path: str
    format: str
    tree: Any = field(repr=False)
    foreign_globals: Mapping[str, int] = field(default_factory=dict)
    saved_devices: frozenset[str] = frozenset()
    metadata: Mapping[str, str] = field(default_factory=dict)
    size: int = 0
    trusted: bool = False
    files: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def select(self, select: str | None = None) -> Selection:
        """The model weights in this checkpoint; see :func:`ckptconv.selection.weights.select_weights`."""
        return select_weights(self.tree, select, source=repr(self.path))

    def tensors(self) -> Iterator[tuple[str, TensorRef]]:
        """Every tensor anywhere in the file, with its dotted path, depth first."""
        seen: set[int] = set()
        stack: list[tuple[str, Any]] = [("", self.tree)]
        while stack:
            path, value = stack.pop()
            if isinstance(value, TensorRef):
                yield path, value
                continue
            if isinstance(value, NumpyArray):
                if value.tensor is not None:
                    yield path, value.tensor
                continue
            if id(value) in seen:
                continue
            seen.add(id(value))
            # Leaves (None, numbers, text) hold no tensor: no path text is made for them (a list of
            # ten million small ints made ten million strings here).
            for key, child in reversed(list(branches(value, any_key=True))):
                stack.append((f"{path}.{part_text(key)}" if path else part_text(key), child))


def open(path: PathLike, *, trust: bool = False) -> Checkpoint:
    """Open a checkpoint lazily and safely, whatever device it was saved on.

    Args:
        path: a ``torch.save`` file (zip or legacy format), a pickle, a safetensors
            file, a sharded checkpoint (its folder or ``*.index.json``), or a
            torch.distributed.checkpoint (DCP) folder.
        trust: **dangerous**: unpickle with ``torch.load(weights_only=False)``, which
            runs whatever code the file contains. Only for files you made yourself
            whose objects need their real classes.

    Returns:
        A :class:`Checkpoint` holding the file's structure and lazy tensors.

    Raises:
        LoadError: the file is missing, not a checkpoint, damaged, or unsafe.

    Example:
        >>> ckpt = ckptconv.open("train.pth")            # doctest: +SKIP
        >>> ckpt.select().weights["conv1.weight"].shape  # doctest: +SKIP
        (64, 3, 7, 7)
    """
    path = as_path(path)
    kind, path = formats.resolve(path)
    if trust:
        result = _read_trusted(path, kind)
    else:
        try:
            with collector_paused():
                result = formats.READERS[kind](path)
        except CkptconvError:
            raise
        except _PARSE_FAILURES as error:
            # Hostile or damaged input must not end in a traceback; the cause stays
            # chained for CKPTCONV_DEBUG=1.
            raise MalformedCheckpointError(
                f"{path!r} could not be parsed as {kind} ({type(error).__name__}: {error}); "
                "the file is damaged or not a checkpoint",
                path=path,
            ) from error
        except OSError as error:
            raise LoadError(f"{path!r} cannot be read: {error.strerror or error}", path=path) from error
    files = result.files or (path,)
    return Checkpoint(
        path=path,
        format=result.format,
        tree=result.tree,
        foreign_globals=dict(sorted(result.foreign_globals.items())),
        saved_devices=result.saved_devices,
        metadata=result.metadata,
        size=_size(files),
        trusted=trust,
        files=files,
        notes=result.notes,
    )


def _size(files: tuple[str, ...]) -> int:
    """Bytes on disk of every file of the checkpoint."""
    total = 0
    for file in files:
        try:
            if os.path.isdir(file):  # a training run's folder (its reader names no files): the files in it
                total += sum(
                    os.lstat(os.path.join(top, name)).st_size for top, _, names in os.walk(file) for name in names
                )
                continue
            total += os.stat(file).st_size
        except OSError as error:
            raise LoadError(f"{file!r} cannot be read: {error.strerror or error}", path=file) from None
    return total


def load(
    path: PathLike,
    *,
    select: str | None = None,
    trust: bool = False,
    device: Any = None,
    check_crc: bool = True,
) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint as torch tensors: a safe ``torch.load``.

    Finds the weights inside training checkpoints (see :mod:`ckptconv.selection.weights`),
    loads GPU-saved files on a CPU-only machine, and never runs code from the
    file. Tensors that shared memory in the file share it in the result.

    Args:
        path: the checkpoint.
        select: where the weights are (``"state_dict_ema"``); searched when None.
        trust: see :func:`open`. Dangerous.
        device: where to put the tensors: the CPU when None, a device such as
            ``"cuda:1"`` (bytes stream from the file to the GPU through a small
            pinned buffer, so host memory stays bounded), or ``"auto"``: the
            visible GPU with the most free memory, else the CPU (with a
            :class:`~ckptconv.gpu.devices.DeviceFallbackWarning`).
        check_crc: compare every zip record read with the CRC-32 the archive
            records (torch.load does not): taken from the bytes as they are
            read, or on the GPU once they are there (``device="cuda"``); False
            loads a damaged file's bytes as they are.

    Returns:
        A dict of names to tensors, ready for ``model.load_state_dict``.

    Raises:
        MissingDependencyError: torch is not installed (``pip install 'ckptconv[torch]'``).
        DeviceError: ``device`` is not ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"auto"`` or None, or names a
            GPU this process does not have.

    Example:
        >>> model.load_state_dict(ckptconv.load("dp_model.pkl"))  # doctest: +SKIP
    """
    from ckptconv.gpu.devices import pick_device
    from ckptconv.gpu.torch_tensors import to_torch
    from ckptconv.reading.integrity import check_record_crcs
    from ckptconv.runtime.extras import require_torch

    require_torch("ckptconv.load() (torch tensors)")  # before the file is read: one line, nothing done
    target = pick_device(device)
    with collector_paused():  # an object or more per tensor: see ckptconv.runtime.collector
        weights = open(path, trust=trust).select(select).weights
        # The readers take each whole record's CRC-32 from the bytes as they pass (no second
        # read of the file); what they did not see (compressed records, partly read ones) is
        # read again and checked after.
        crcs: dict[Storage, int] | None = {} if check_crc else None
        tensors = to_torch(weights, device=target, crcs=crcs)
        if crcs is not None:
            check_record_crcs(list(weights.items()), computed=crcs)
        return tensors


def _read_trusted(path: str, kind: str) -> ReadResult:
    """Unpickle with torch itself; for trusted files only."""
    if kind in ("safetensors", "sharded", "dcp", "deepspeed", "rank-shards", "megatron-torch-dist", "megatron-legacy"):
        return formats.READERS[kind](path)  # nothing in these runs code: trust changes nothing
    from ckptconv.runtime.extras import require_torch

    require_torch("--trust (torch.load)")
    import torch

    from ckptconv.gpu.torch_tensors import from_torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # torch raises anything from the file's own code
        raise LoadError(f"torch.load failed on {path!r} even with --trust: {error}", path=path) from None
    cache: dict[Any, Any] = {}
    seen: dict[int, Any] = {}

    def convert(value: Any, depth: int = 0) -> Any:
        if depth > 200:
            return value
        if isinstance(value, torch.Tensor):
            try:
                return from_torch(value, cache)
            except CkptconvError as error:
                raise LoadError(f"{path!r} holds a tensor ckptconv cannot convert: {error}", path=path) from None
        if isinstance(value, torch.nn.Module):
            return convert(value.state_dict(), depth + 1)
        if id(value) in seen:
            return seen[id(value)]
        if isinstance(value, dict):
            converted = type(value)() if type(value) in (dict,) else {}
            seen[id(value)] = converted
            for key, item in value.items():
                converted[key] = convert(item, depth + 1)
            return converted
        if isinstance(value, (list, tuple)):
            items = [convert(item, depth + 1) for item in value]
            return items if isinstance(value, list) else tuple(items)
        return value

    return ReadResult(kind, convert(obj), Counter(), frozenset())
