"""A PEFT adapter folder (``adapter_config.json`` and ``adapter_model.safetensors`` or ``.bin``), opened and parsed."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckptconv._paths import PathLike, as_path
from ckptconv.adapters.plan import AdapterTensors, group_tensors
from ckptconv.errors import LoadError
from ckptconv.loading import open as open_checkpoint
from ckptconv.reading import read_policy
from ckptconv.reading.adapter_config import CONFIG_NAME, WEIGHTS_NAMES, AdapterConfig, read_config
from ckptconv.writing.provenance import file_sha256

__all__ = ["Adapter", "open_adapter"]


@dataclass(frozen=True)
class Adapter:
    """A PEFT adapter folder, parsed.

    Attributes:
        folder: the folder.
        weights: its weights file.
        config: its ``adapter_config.json``.
        tensors: its tensors, by module and role.
        sha256: the weights file's sha256 (for the provenance).
    """

    folder: str
    weights: str
    config: AdapterConfig
    tensors: AdapterTensors
    sha256: str

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.folder))


def open_adapter(path: PathLike) -> Adapter:
    """Read a PEFT adapter folder (``adapter_config.json`` and ``adapter_model.safetensors`` or ``.bin``).

    Raises:
        LoadError: the folder, its config or its weights are missing, unreadable or a link out of the folder.
        TransformError: see :func:`ckptconv.reading.adapter_config.parse_config` and
            :func:`ckptconv.adapters.plan.group_tensors`.
    """
    folder = as_path(path)
    if not os.path.isdir(folder) and os.path.basename(folder) in (*WEIGHTS_NAMES, CONFIG_NAME):
        folder = os.path.dirname(folder) or "."
    if not os.path.lexists(folder):
        raise LoadError(f"adapter {folder!r} does not exist", path=folder)
    if not os.path.isdir(folder):
        raise LoadError(
            f"{folder!r} is not an adapter folder (adapter_config.json and adapter_model.safetensors)", path=folder
        )
    if not os.path.lexists(os.path.join(folder, CONFIG_NAME)):
        raise LoadError(f"{folder!r} has no {CONFIG_NAME}; is it a PEFT adapter folder?", path=folder)
    config = read_config(folder)
    weights = next((os.path.join(folder, n) for n in WEIGHTS_NAMES if os.path.lexists(os.path.join(folder, n))), None)
    if weights is None:
        raise LoadError(f"{folder!r} has no {' or '.join(WEIGHTS_NAMES)}", path=folder)
    read_policy.check_file(weights, folder=folder)  # a link out of the folder is refused, as its config's is
    tensors = open_checkpoint(weights).select().weights
    grouped = group_tensors(tensors, config, repr(folder))
    return Adapter(folder, weights, config, grouped, file_sha256(weights))
