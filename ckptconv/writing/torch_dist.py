"""Writing Megatron-Core ``torch_dist`` folders: what ``dist_checkpointing.save`` writes for a ``GPTModel``.

A ``torch_dist`` folder is a DCP folder (:mod:`ckptconv.writing.dcp` writes its ``__0_0.distcp`` and ``.metadata``)
whose decoder layers are stacked, one key per kind of weight (``decoder.layers.mlp.linear_fc1.weight``
``[num_layers, …]``: :func:`ckptconv.architectures.mapping.torch_dist_names`, the inverse of the split that
:mod:`ckptconv.reading.formats.megatron` makes), plus the two files megatron-core reads before it:

- ``metadata.json``: ``{"sharded_backend": "torch_dist", "sharded_backend_version": 1}``, byte for byte what
  megatron-core 0.19.2 wrote in the fixtures (``dist_checkpointing.core.save_config``);
- ``common.pt``: the common (not sharded) state, ``torch.save({})`` (a model's state has none), which
  ``dist_checkpointing.load`` and ``load_plain_tensors`` open first (megatron-core 0.16 refuses a folder without
  it; 0.19 also keeps a copy inside the DCP data as ``common_state``, which this writer leaves out).

Each tensor is stored whole, one chunk, so the folder loads on any number of ranks and parallel layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

from ckptconv.architectures.mapping import torch_dist_names
from ckptconv.values.tensor import Storage, TensorRef
from ckptconv.writing import dcp as dcp_writer
from ckptconv.writing import torch_zip

__all__ = ["COMMON_FILE", "CONFIG_FILE", "CONFIG_TEXT", "write"]

CONFIG_FILE = "metadata.json"
COMMON_FILE = "common.pt"
#: megatron-core's ``CheckpointingConfig`` for the torch_dist backend, as its ``save_config`` writes it
CONFIG_TEXT = b'{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'


def write(
    entries: Sequence[tuple[str, TensorRef]],
    folder: str,
    *,
    open_output: Callable[[str], Any],
    on_bytes: Callable[[int], None],
    record_crcs: dict[Storage, int] | None = None,
) -> int:
    """Write ``entries`` (Megatron-Core names, one per layer: ``decoder.layers.{L}.…``) as a ``torch_dist`` folder.

    Returns:
        The number of tensor bytes written.

    Raises:
        TransformError: a layer lacks a weight its other layers have (Megatron stacks them all).
        CastOverflowError: see :func:`ckptconv.writing.dcp.write`.
    """
    stacked = list(torch_dist_names(dict(entries)).items())
    total = dcp_writer.write(stacked, folder, open_output=open_output, on_bytes=on_bytes, record_crcs=record_crcs)
    with open_output(COMMON_FILE) as common:
        torch_zip.write([], common, write_storage=lambda storage, out: 0)
    with open_output(CONFIG_FILE) as config:
        config.write(CONFIG_TEXT)
    return total
