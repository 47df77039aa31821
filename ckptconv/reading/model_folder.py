"""Model folders: the folder a checkpoint's weights came in, and the configuration it declares.

A Hugging Face model folder holds its weights (one file, or an index and shards) beside a
``config.json`` that says what model they are, and how they were quantized. The configuration
is read only where the checkpoint *is* the folder (a folder or its ``*.index.json`` was given):
a single file given on its own is converted for what it holds, and never looks beside itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ckptconv._text import short_repr
from ckptconv.errors import MalformedCheckpointError
from ckptconv.reading import read_policy
from ckptconv.reading.formats._base import json_object
from ckptconv.suffixes import INDEX_SUFFIXES

__all__ = ["CONFIG_NAME", "MAX_CONFIG_BYTES", "model_folder", "read_config"]

CONFIG_NAME = "config.json"
#: A model's config.json is kilobytes; a hundred times the largest real one is still refused past this.
MAX_CONFIG_BYTES = 16 << 20


def model_folder(source: str) -> str | None:
    """The model folder ``source`` names: itself when it is a folder, the folder of an index given by its
    file; None for a single weights file (whose folder is not part of what was given)."""
    if os.path.isdir(source):
        return source
    if source.endswith(INDEX_SUFFIXES):
        return os.path.dirname(source) or "."
    return None


def read_config(folder: str) -> Mapping[str, Any] | None:
    """``folder``'s ``config.json`` as a JSON object, or None when the folder has none.

    Raises:
        LoadError: the file is a link out of the folder, not a regular file, or unreadable.
        MalformedCheckpointError: it is not a JSON object, or is larger than :data:`MAX_CONFIG_BYTES`.
    """
    path = os.path.join(folder, CONFIG_NAME)
    if not os.path.lexists(path):
        return None
    data = read_policy.read_limited(path, limit=MAX_CONFIG_BYTES, folder=folder, what="model config")
    try:
        config = json_object(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise MalformedCheckpointError(
            f"{path!r} is not a model config: it is not JSON ({type(error).__name__}); fix or remove it", path=path
        ) from None
    if not isinstance(config, dict):
        raise MalformedCheckpointError(
            f"{path!r} is not a model config: it holds {short_repr(config)}, not a JSON object", path=path
        )
    return config
