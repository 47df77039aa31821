"""Megatron-Core ``torch_dist`` checkpoints: a DCP folder whose layers are stacked, read per layer.

Megatron-Core's distributed checkpointing (``dist_checkpointing.save`` with
the default ``torch_dist`` backend) writes a torch.distributed.checkpoint
folder plus ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``)
and, in Megatron-LM training runs, ``common.pt``. Every tensor is stored at
its global size, whatever the tensor- and pipeline-parallel layout was, with
each rank's piece at its global offset: the DCP reader
(:mod:`ckptconv.reading.formats.dcp`) already puts them back together.

What is left is Megatron's own naming: the transformer layers of the decoder
(``decoder.layers``) are saved **stacked** along a new leading axis, one key
per kind of weight (``decoder.layers.self_attention.linear_qkv.weight`` of
shape ``[num_layers, 3 * hidden, hidden]``). :func:`read` splits them into
``decoder.layers.{i}.self_attention.linear_qkv.weight``, as a model's
``state_dict()`` names them; each layer reads its own bytes of the stacked
tensor. Names are otherwise the checkpoint's (Transformer Engine's layer
spec: the layer norms fused into the next linear layer are
``self_attention.linear_qkv.layer_norm_weight`` and
``mlp.linear_fc1.layer_norm_weight``; for a model built with the local spec
rename them to ``input_layernorm.weight`` and ``pre_mlp_layernorm.weight``
with ``--rename``). Optimizer and RNG state saved beside the model
(``optimizer.*``, ``rng_state``) are kept apart under ``optimizer``, which the
selection never picks. ``_extra_state`` entries (Transformer Engine's fp8
metadata, pickled bytes) are not weights and are left out.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ckptconv.errors import MalformedCheckpointError
from ckptconv.reading import read_policy
from ckptconv.reading.formats import dcp
from ckptconv.reading.formats._base import ReadResult
from ckptconv.reading.model_config import parse_config_text
from ckptconv.reading.sources import Source
from ckptconv.values.tensor import ReadInto, Storage, TensorRef, contiguous_strides

__all__ = ["FORMAT", "is_torch_dist_folder", "read"]

FORMAT = "megatron-torch-dist"
MARKER = "metadata.json"

# Megatron-LM training checkpoints keep optimizer state and RNG state in the same folder.
_NOT_MODEL = frozenset({"optimizer", "rng_state", "rerun_state_machine_state"})

# A stacked key: "<prefix>layers.<name>" where <name> does not start with a layer number.
_STACKED = re.compile(r"^(?P<prefix>(?:.*\.)?layers)\.(?P<rest>(?!\d+(?:\.|$)).+)$")


def is_torch_dist_folder(path: str) -> bool:
    """True for a DCP folder that Megatron-Core's ``torch_dist`` backend wrote.

    Raises:
        InvalidConfigError: the DCP folder's ``metadata.json`` (Megatron's record of its backend) is not one JSON
            object (not JSON, a key named twice, nested too deep): which backend wrote it cannot be told.
    """
    marker = os.path.join(path, MARKER)
    if not dcp.is_dcp_folder(path) or not os.path.isfile(marker):
        return False
    data = read_policy.read_limited(marker, limit=65536, folder=path, what="metadata.json")
    config = parse_config_text(data, marker, what="Megatron's checkpoint metadata")
    return config.get("sharded_backend") == "torch_dist"


@dataclass(frozen=True)
class _Slice(Source):
    """Bytes ``[start, start + length)`` of another storage: one layer of a stacked tensor."""

    storage: Storage
    start: int

    @contextlib.contextmanager
    def opened(self) -> Iterator[ReadInto]:
        with self.storage.reader() as read_into:

            def read_slice(start: int, out: memoryview) -> None:
                read_into(self.start + start, out)

            yield read_slice

    def paths(self) -> frozenset[str]:
        return self.storage.source.paths()


def _layer(ref: TensorRef, index: int, name: str) -> TensorRef:
    """Layer ``index`` of a contiguous stacked tensor, as a tensor with a storage of its own.

    When the stacked tensor was assembled from chunks (each rank's piece of each layer), the
    layer is assembled from its own chunks, so reading it never pastes the whole stack
    together (a row-parallel weight split along its last dimension would otherwise be).
    """
    shape = ref.shape[1:]
    nbytes = math.prod(shape) * ref.dtype.itemsize
    source = ref.storage.source
    if isinstance(source, dcp.Assembled) and ref.offset == 0 and ref.shape == source.shape:
        pieces = []
        for offsets, chunk in source.chunks:
            first = offsets[0]
            if first <= index < first + chunk.shape[0]:
                view = TensorRef(
                    chunk.storage,
                    chunk.dtype,
                    chunk.shape[1:],
                    chunk.stride[1:],
                    chunk.offset + (index - first) * chunk.stride[0],
                )
                pieces.append((tuple(offsets[1:]), view))
        if sum(piece.numel for _, piece in pieces) == math.prod(shape):
            layer = dcp.Assembled(tuple(pieces), shape, ref.dtype.itemsize)
            storage = Storage(nbytes, layer, location=ref.storage.location, name=name)
            return TensorRef(storage, ref.dtype, shape, contiguous_strides(shape))
    start = ref.byte_span[0] + index * nbytes
    storage = Storage(nbytes, _Slice(ref.storage, start), location=ref.storage.location, name=name)
    return TensorRef(storage, ref.dtype, shape, ref.stride[1:])


def read(folder: str, *, max_items: int | None = None) -> ReadResult:
    """Read a Megatron-Core ``torch_dist`` folder with its stacked layers split; see the module docstring.

    Raises:
        MalformedCheckpointError: stacked tensors disagree on the number of layers.
    """
    result = dcp.read(folder, max_items=max_items)
    tree = result.tree
    if not isinstance(tree, Mapping):
        raise MalformedCheckpointError(f"{folder!r} is a damaged torch_dist checkpoint: it holds no tensors")
    layers: dict[str, int] = {}
    others: dict[str, TensorRef] = {}
    stacked: dict[str, list[tuple[str, TensorRef]]] = {}
    order: list[tuple[str, Any]] = []  # plain keys, and each stack of layers where it first appears
    for key, value in tree.items():
        if not isinstance(value, TensorRef) or not isinstance(key, str):
            continue  # _extra_state and common state: not weights
        if key.split(".", 1)[0] in _NOT_MODEL:
            others[key] = value
            continue
        match = _STACKED.match(key)
        if match is None:
            order.append((key, value))
            continue
        if not value.shape or not value.is_contiguous:
            raise MalformedCheckpointError(
                f"{folder!r} is a damaged torch_dist checkpoint: stacked {key!r} has shape {list(value.shape)}",
                path=folder,
            )
        prefix = match["prefix"]
        if layers.setdefault(prefix, value.shape[0]) != value.shape[0]:
            raise MalformedCheckpointError(
                f"{folder!r} is a damaged torch_dist checkpoint: {key!r} stacks {value.shape[0]} layers, "
                f"other {prefix} keys {layers[prefix]}",
                path=folder,
            )
        if prefix not in stacked:
            stacked[prefix] = []
            order.append((prefix, None))
        stacked[prefix].append((match["rest"], value))
    weights: dict[str, TensorRef] = {}
    for key, value in order:
        if value is not None:
            weights[key] = value
            continue
        for index in range(layers[key]):  # layer by layer, as a model's state_dict() lists them
            for rest, ref in stacked[key]:
                name = f"{key}.{index}.{rest}"
                if name in tree or name in weights:
                    raise MalformedCheckpointError(
                        f"{folder!r} is a damaged torch_dist checkpoint: layer {index} of the stacked "
                        f"'{key}.{rest}' would be named {name!r}, which the checkpoint also holds as a tensor of "
                        "its own; it reads two ways",
                        path=folder,
                    )
                weights[name] = _layer(ref, index, name)
    metadata = {
        "framework": "Megatron-Core dist_checkpointing (torch_dist)",
        "layers": ", ".join(f"{prefix}: {count} (saved stacked, split per layer)" for prefix, count in layers.items())
        or "none stacked",
    }
    return ReadResult(
        FORMAT,
        {"model": weights, "optimizer": others} if others else weights,
        foreign_globals=result.foreign_globals,
        saved_devices=result.saved_devices,
        metadata=metadata,
    )
