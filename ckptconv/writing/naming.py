"""Output naming: which format a destination gets, from its suffix or --to, and when it is a folder."""

from __future__ import annotations

import os

from ckptconv._paths import PathLike, as_path
from ckptconv.errors import DestinationError, WriteError
from ckptconv.suffixes import SAFETENSORS_SUFFIX, TAR_SUFFIX, TORCH_SUFFIXES

_FORMAT_NAMES = {
    "pt": "pt",
    "torch": "pt",
    "pth": "pt",
    "bin": "pt",
    "safetensors": "safetensors",
    "st": "safetensors",
    "dcp": "dcp",
    "megatron": "megatron",
}

#: The outputs that are folders whatever their name: a DCP folder and Megatron-Core's torch_dist folder.
FOLDER_FORMATS = ("dcp", "megatron")


def _suffix_format(name: str) -> tuple[str, str] | None:
    """The format a file name's suffix names, and the suffix; None for a name without one."""
    lowered = name.lower()
    if lowered.endswith(SAFETENSORS_SUFFIX):
        return "safetensors", name[-len(SAFETENSORS_SUFFIX) :]
    for suffix in (*TORCH_SUFFIXES, TAR_SUFFIX):  # longest first
        if lowered.endswith(suffix):
            return "pt", name[-len(suffix) :]
    return None


def output_format(path: PathLike, to: str | None = None, *, folder: bool = False) -> str:
    """``"pt"``, ``"safetensors"``, ``"dcp"`` or ``"megatron"``: ``to`` if given, else from the destination's suffix.

    Folder outputs default to safetensors, as Hugging Face checkpoints are.

    Raises:
        DestinationError: ``to`` contradicts the destination's suffix (``o.safetensors`` with ``pt``).
        WriteError: neither ``to`` nor the suffix says which format to write.
    """
    text = as_path(path)
    named = None if folder or not text else _suffix_format(os.path.basename(text))
    if to is not None:
        name = _FORMAT_NAMES.get(to.lower())
        if name is None:
            raise WriteError(f"unknown output format {to!r}; use 'pt', 'safetensors', 'dcp' or 'megatron'")
        if name in FOLDER_FORMATS and not folder:
            raise WriteError(f"a {_FORMAT_TITLES[name]} checkpoint is a folder; give a folder as the destination")
        if named is not None and named[0] != name:
            stem = text[: -len(named[1])]
            instead = stem + (".safetensors" if name == "safetensors" else ".pt")
            raise DestinationError(
                f"{text!r} is named as a {_FORMAT_TITLES[named[0]]} file but --to {to} writes a "
                f"{_FORMAT_TITLES[name]} file; write {instead!r} instead, or leave out --to",
                path=text,
            )
        return name
    if folder:
        return "safetensors"
    if named is not None:
        return named[0]
    torch_names = ", ".join(sorted({*TORCH_SUFFIXES, TAR_SUFFIX}, key=len))
    raise DestinationError(
        f"cannot tell the output format from {text!r}: end it in {SAFETENSORS_SUFFIX} or a torch file's "
        f"suffix ({torch_names}), end it in '/' for a folder of shards, or pass --to",
        path=text,
    )


def is_folder_destination(path: PathLike, format: str | None, max_shard_size: int | None) -> bool:
    """True when ``save`` writes a folder layout to ``path``.

    Raises:
        DestinationError: a folder would be created under a file's name (``m5.safetensors``
            with ``max_shard_size``, or with ``format="dcp"``).
    """
    text = as_path(path)
    if os.path.isdir(text) or text.endswith(("/", os.sep)):
        return True
    dcp = (format or "").lower() in FOLDER_FORMATS
    if max_shard_size is None and not dcp:
        return False
    named = _suffix_format(os.path.basename(text))
    if named is not None and not os.path.exists(text):  # an existing file is refused when writing
        cause = f"--to {format} writes a folder" if dcp else "--max-shard-size writes a folder of shards and an index"
        folder = text[: -len(named[1])] + "/"
        one_file = f"leave out --to {format}" if dcp else "leave out --max-shard-size"
        raise DestinationError(
            f"{text!r} is named like a file, but {cause}; write {folder!r} instead, "
            f"or {one_file} to write the one file {text!r}",
            path=text,
        )
    return True


_FORMAT_TITLES = {"pt": "torch", "safetensors": "safetensors", "dcp": "DCP", "megatron": "Megatron-Core torch_dist"}
