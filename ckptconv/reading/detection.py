"""One module per file format, each with the same small interface.

``read(path) -> ReadResult`` for every format; ``write(entries, file, ...)`` for
the formats ckptconv writes. :func:`detect` decides the format from the
file's first bytes, never from its name: ``.pth.tar`` files are usually zip
checkpoints and ``pytorch_model.bin`` is sometimes a Lightning checkpoint.
"""

from __future__ import annotations

import importlib
import os
import re
import zipfile
from types import ModuleType
from typing import Callable

from ckptconv._paths import PathLike, as_path
from ckptconv.errors import LoadError, UnsafeCheckpointError, UnsupportedFormatError
from ckptconv.reading import read_policy
from ckptconv.reading.formats import safetensors
from ckptconv.reading.formats._base import ReadResult
from ckptconv.reading.formats._other_files import TEXT_PROBE_BYTES, not_a_checkpoint
from ckptconv.selection.training_state import training_state
from ckptconv.suffixes import CHECKPOINT_SUFFIXES, INDEX_SUFFIXES

__all__ = [
    "READERS",
    "ReadResult",
    "checkpoint_files",
    "detect",
    "is_checkpoint_file",
    "is_unsafe",
    "resolve",
    "training_state_of",
]

# Each format's module (its FORMAT), imported when first needed: a safetensors load never imports the
# pickle machinery nor the training-run formats, a third of ckptconv's import time in a fresh process
# (bench/results/bench_gpu_load_h200.md, round 6). tests/test_load.py checks the names against FORMAT.
_MODULES = {
    "torch-zip": "torch_zip",
    "torch-legacy": "torch_legacy",
    "safetensors": "safetensors",
    "pickle": "raw_pickle",
    "sharded": "sharded",
    "dcp": "dcp",
    "deepspeed": "deepspeed",
    "rank-shards": "rank_shards",
    "megatron-torch-dist": "megatron",
    "megatron-legacy": "megatron_legacy",
    "hf-distributed": "hf_distributed",
}


def _module(kind: str) -> ModuleType:
    return importlib.import_module(f"ckptconv.reading.formats.{_MODULES[kind]}")


def _reader(kind: str) -> Callable[[str], ReadResult]:
    def read(path: str) -> ReadResult:
        result: ReadResult = _module(kind).read(path)
        return result

    return read


READERS: dict[str, Callable[[str], ReadResult]] = {kind: _reader(kind) for kind in _MODULES}


def resolve(path: PathLike) -> tuple[str, str]:
    """``(format, path to read)`` for a file or a checkpoint folder (``path`` as :func:`ckptconv._paths.as_path`
    takes it: every reader's entry, ``ckptconv.open``, comes through here).

    A folder is a DCP checkpoint (it has ``.metadata``), a sharded checkpoint
    (it has one ``*.index.json``), or a folder holding a single checkpoint file
    (one :func:`is_checkpoint_file` accepts, as ``ckptconv batch`` finds them).

    Raises:
        LoadError: see :func:`detect`; or the folder holds no checkpoint, or several.
    """
    path = as_path(path)
    if os.path.isdir(path):
        if _module("megatron-torch-dist").is_torch_dist_folder(path):
            return "megatron-torch-dist", path
        if _module("dcp").is_dcp_folder(path):
            return "dcp", path
        run = _module("deepspeed").find_checkpoint(path)
        if run is not None:
            return "deepspeed", run
        legacy = _module("megatron-legacy").find_checkpoint(path)
        if legacy is not None:
            return "megatron-legacy", legacy
        if _module("rank-shards").find_files(path) is not None:
            return "rank-shards", path
        hub = _hub_safetensors(path)
        if hub is not None:
            read_policy.check_file(hub, folder=path)
            return safetensors.FORMAT, hub
        index = _module("sharded").find_index(path)
        if _module("hf-distributed").find_files(path) is not None:
            if index is not None:  # consolidated in place beside its rank files: two sets of the same weights
                raise UnsupportedFormatError(
                    f"{path!r} holds rank-local shards (shard-NNNNN-model-...safetensors) and an index "
                    f"({os.path.basename(index)}); give the index to read the consolidated weights, or move one set",
                    path=path,
                )
            return "hf-distributed", path
        if index is not None:
            read_policy.check_file(index, folder=path)
            return "sharded", index
        candidates = sorted(
            name
            for name in os.listdir(path)
            if not name.startswith(".")
            and os.path.isfile(os.path.join(path, name))
            and is_checkpoint_file(os.path.join(path, name))
        )
        if len(candidates) > 1:
            # A training run's folder: the model beside optimizer.pt, scheduler.pt, rng_state.pth ... An unsafe
            # file is never the weights (its conversion is refused): the model beside it is, and a note names it.
            weights = [
                name
                for name in candidates
                if training_state_of(os.path.join(path, name)) is None and not is_unsafe(os.path.join(path, name))
            ]
            candidates = weights if weights else candidates
        if len(candidates) == 1:
            single = os.path.join(path, candidates[0])
            read_policy.check_file(single, folder=path)
            return detect(single), single
        found = f" it holds {', '.join(candidates[:6])}" if candidates else " it holds no checkpoint files"
        raise UnsupportedFormatError(
            f"{path!r} is a folder but neither a sharded checkpoint (*.index.json) nor a DCP checkpoint "
            f"(.metadata), and{found}; give the file to read, or convert them all with `ckptconv batch`",
            path=path,
        )
    kind = detect(path)
    return kind, path


# The names transformers saves a model under, safetensors and pickled; its from_pretrained loads a folder's
# model.safetensors before any pytorch_model.bin (modeling_utils' _get_resolved_checkpoint_files).
_HUB_SAFETENSORS = "model.safetensors"
_HUB_BIN = re.compile(r"^pytorch_model(-\d{5}-of-\d{5})?\.bin$|^pytorch_model\.bin\.index\.json$")


def _hub_safetensors(folder: str) -> str | None:
    """``model.safetensors`` of a Hub folder that holds the model in both formats (``pytorch_model.bin`` or its
    index and shards beside it, and no other checkpoint): the file transformers loads. The ``.bin`` files are left
    out, and named in the note on weights not converted (:func:`ckptconv.reading.model_folder.inventory`). Any
    other second checkpoint (``other.safetensors``, a safetensors index) leaves the folder ambiguous."""
    chosen = os.path.join(folder, _HUB_SAFETENSORS)
    names = os.listdir(folder)
    if not os.path.isfile(chosen) or not any(_HUB_BIN.match(name) for name in names):
        return None
    for name in names:  # any other checkpoint beside them leaves the folder ambiguous (pickles opened only now)
        path = os.path.join(folder, name)
        if name == _HUB_SAFETENSORS or _HUB_BIN.match(name) or name.startswith(".") or not os.path.isfile(path):
            continue
        if name.endswith(INDEX_SUFFIXES) or (is_checkpoint_file(path) and training_state_of(path) is None):
            return None
    return chosen


def training_state_of(path: str) -> str | None:
    """What training state the file at ``path`` holds (``"optimizer state (Adam moments)"``), read by its content
    (:func:`ckptconv.selection.training_state.training_state`); None for weights, and for a file that cannot be
    read (its own conversion says why). safetensors files hold tensors only, and are never opened for this."""
    try:
        kind = detect(path)
        if kind in (safetensors.FORMAT, "sharded"):
            return None
        return training_state(READERS[kind](path).tree)
    except (LoadError, OSError, ValueError):
        return None


def is_unsafe(path: str) -> bool:
    """True when reading the file at ``path`` is refused as unsafe (its pickle names code-running callables,
    an :class:`~ckptconv.errors.UnsafeCheckpointError`): a file beside a model that must never be offered as
    weights to convert. Its structure is read by ckptconv's own readers, which run nothing."""
    try:
        kind = detect(path)
        if kind in (safetensors.FORMAT, "sharded"):
            return False
        READERS[kind](path)
    except UnsafeCheckpointError:
        return True
    except (LoadError, OSError, ValueError):
        return False
    return False


def is_checkpoint_file(path: str) -> bool:
    """True for a file named like a checkpoint (whatever it holds, so a broken one is reported),
    and for any file whose content is a torch zip checkpoint, a legacy torch file or safetensors.
    (Plain pickles count by name only: too many other things are pickles.)"""
    if os.path.basename(path).lower().endswith(CHECKPOINT_SUFFIXES):
        return True
    try:
        with read_policy.open_file(path) as file:  # regular files only: never block on a FIFO
            head = file.read(_HEAD_BYTES)
            size = os.fstat(file.fileno()).st_size
            if safetensors.looks_safetensors(head, size) or _module("torch-legacy").looks_legacy(head):
                return True
            torch_zip = _module("torch-zip")
            if torch_zip.is_zip(head):
                with zipfile.ZipFile(file) as archive:
                    return any(
                        torch_zip.fold_case(member).endswith("/data.pkl") or torch_zip.fold_case(member) == "data.pkl"
                        for member in archive.namelist()
                    )
    except (OSError, LoadError, zipfile.BadZipFile, ValueError):
        return False
    return False


def checkpoint_files(path: str) -> list[str]:
    """The files a checkpoint is made of: the file itself, a sharded checkpoint's index and every
    shard it names, a DCP folder's ``.metadata`` and data files, a DeepSpeed tag folder's model and
    optimizer states, or the per-rank model files.

    Raises:
        LoadError: see :func:`resolve`; a sharded index is damaged or names a missing shard.
    """
    kind, path = resolve(path)
    if kind in ("dcp", "megatron-torch-dist"):
        files: list[str] = _module("dcp").checkpoint_files(path)
        return files
    if kind == "sharded":
        files = _module("sharded").checkpoint_files(path)
        return files
    if kind == "deepspeed":
        return _module("deepspeed").checkpoint_files(path) or []
    if kind in ("rank-shards", "hf-distributed"):
        return _module(kind).find_files(path) or []
    if kind == "megatron-legacy":
        return _module("megatron-legacy").checkpoint_files(path) or []
    return [path]


_HEAD_BYTES = 512

# Formats people mistake for PyTorch checkpoints, by their magic bytes.
_NOT_CHECKPOINTS: tuple[tuple[bytes, str], ...] = (
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (Keras or TensorFlow weights?), not a PyTorch checkpoint"),
    (b"\x93NUMPY", "a numpy .npy file, not a PyTorch checkpoint; load it with numpy.load"),
    (b"GGUF", "a GGUF file (llama.cpp), not a PyTorch checkpoint"),
    (b"\x1f\x8b", "gzip-compressed; decompress it first (gunzip) and convert the result"),
    (b"BZh", "bzip2-compressed; decompress it first (bunzip2) and convert the result"),
    (b"\xfd7zXZ\x00", "xz-compressed; decompress it first (unxz) and convert the result"),
    (b"(\xb5/\xfd", "zstd-compressed; decompress it first (unzstd) and convert the result"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive; extract it first"),
    (b"version https://git-lfs", "a Git LFS pointer, not the checkpoint itself; run `git lfs pull` to fetch it"),
)

# Opcodes a pickle without a PROTO header may start with (MARK, EMPTY_DICT, EMPTY_LIST, GLOBAL, NONE, ...):
# CPython's unpickler reads any opcode of any protocol without the header, so a pickle that starts
# ``\x8c\x08builtins...`` (protocol 4's SHORT_BINUNICODE) runs under torch.load as well as ``cos\n...``.
_OLD_PICKLE_STARTS = frozenset(b"(}]cNIJKLSVXFGUT)BCM\x88\x89\x8a\x8b\x8c\x8d\x8e\x8f\x95\x96")


def _is_whole_pickle(data: bytes) -> bool:
    """True when ``data`` is one complete pickle, STOP included (parsed by ``pickletools``, never run)."""
    import pickletools

    try:
        last = [opcode.name for opcode, _arg, _pos in pickletools.genops(data)][-1:]
    except Exception:  # any parse failure means "not a pickle"
        return False
    return last == ["STOP"]


def detect(path: str) -> str:
    """The format of the file at ``path``, from its content.

    Raises:
        LoadError: the path is missing, unreadable or a folder.
        UnsupportedFormatError: the file is empty, a placeholder, or another kind of file.
    """
    if path.endswith(INDEX_SUFFIXES):
        read_policy.check_file(path)
        return "sharded"
    with read_policy.open_file(path) as file:
        try:
            head = file.read(_HEAD_BYTES)
            size = os.fstat(file.fileno()).st_size
        except OSError as error:
            raise LoadError(f"{path!r} cannot be read: {error.strerror or error}", path=path) from None
    if size == 0:
        raise UnsupportedFormatError(f"{path!r} is empty (0 bytes); the download or save did not finish", path=path)
    # safetensors first, so that its files never import the zip reader; no zip looks like one (a zip's
    # ninth byte is its first record's compression method, 0 or 8, where safetensors has its JSON's "{").
    if safetensors.looks_safetensors(head, size):
        return safetensors.FORMAT
    if _module("torch-zip").is_zip(head):
        return "torch-zip"
    if _module("torch-legacy").looks_legacy(head):
        return "torch-legacy"
    for magic, description in _NOT_CHECKPOINTS:
        if head.startswith(magic):
            raise UnsupportedFormatError(f"{path!r} is {description}", path=path)
    if len(head) >= 262 and head[257:262] == b"ustar":
        raise UnsupportedFormatError(
            f"{path!r} is a tar archive (torch's pre-0.4 tar checkpoints are not supported); "
            "extract it, or re-save it with a recent torch",
            path=path,
        )
    lowered = head[:64].lstrip().lower()
    if lowered.startswith((b"<!doctype html", b"<html", b"<?xml", b"<head")):
        raise UnsupportedFormatError(f"{path!r} is an HTML/XML page, not a checkpoint (a failed download?)", path=path)
    if head[0] == 0x80 and size >= 3 and 2 <= head[1] <= 5:
        return "pickle"
    if size < 16 and not (head[0] in _OLD_PICKLE_STARTS and _is_whole_pickle(head)):
        # A few bytes that are a whole protocol 0/1 pickle (``cos\nsystem\n.``) are read as one: a
        # placeholder is never so short a program.
        raise UnsupportedFormatError(
            f"{path!r} is only {size} byte{'s' if size != 1 else ''} long: a placeholder, not a "
            "checkpoint (an unfinished download, or a Git LFS file that was not pulled?)",
            path=path,
        )
    if head[0] in _OLD_PICKLE_STARTS:
        return "pickle"  # no PROTO header; the reader says so if it is not a pickle after all
    if head[8:9] == b"{" and b"\x00" in head[:8]:
        # A safetensors file whose header length is wrong (cut short, or 2**63):
        # its reader says which, instead of "not a format ckptconv knows".
        return safetensors.FORMAT
    if size > len(head):  # enough of it to tell text from other bytes
        with read_policy.open_file(path) as file:
            head = file.read(TEXT_PROBE_BYTES)
    raise not_a_checkpoint(path, head, size)
