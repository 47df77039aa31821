"""Writing DCP folders that ``torch.distributed.checkpoint.load`` reads on any number of ranks (torch writes the
data records). The reading side is :mod:`ckptconv.reading.formats.dcp`."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any, Callable

from ckptconv.errors import CastOverflowError
from ckptconv.reading.formats.dcp import DATA_FILE, METADATA_FILE
from ckptconv.values.tensor import TensorRef
from ckptconv.writing.copying import overflow_named


def write(
    entries: Sequence[tuple[str, TensorRef]],
    folder: str,
    *,
    open_output: Callable[[str], Any],
    on_bytes: Callable[[int], None],
) -> int:
    """Write ``entries`` as a DCP folder that ``torch.distributed.checkpoint.load`` reads on any number of ranks.

    Each tensor is saved whole (one chunk, at offset 0) into one data file,
    one tensor in memory at a time; keys are the fully qualified names.

    Args:
        entries: ``(key, tensor)`` pairs.
        folder: the destination folder.
        open_output: opens a file of the folder for writing atomically (a context manager).
        on_bytes: called with tensor byte counts, for progress.

    Returns:
        The number of tensor bytes written.
    """
    import torch
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint import metadata as dcp

    from ckptconv.gpu.torch_tensors import to_torch
    from ckptconv.runtime.signals import signals_deferred

    state_dict_metadata: dict[str, Any] = {}
    storage_data: dict[Any, Any] = {}
    total = 0
    with open_output(DATA_FILE) as data_file:
        for key, ref in entries:
            try:
                tensor = to_torch({key: ref})[key]
            except CastOverflowError as error:  # named as every other format's writer names it
                raise overflow_named(error, key) from None
            start = data_file.tell()
            try:
                with signals_deferred():  # torch.save calls back into Python to write: see _signals
                    torch.save(tensor, data_file)
            except RuntimeError as error:
                # An interruption (Ctrl-C, SIGTERM) or a failed write inside torch.save is replaced by
                # the RuntimeError its zip writer raises while closing ("unexpected pos"): report the cause.
                cause = error.__context__
                if isinstance(cause, (KeyboardInterrupt, OSError)):
                    raise cause from None
                raise
            length = data_file.tell() - start
            origin = torch.Size([0] * tensor.dim())
            state_dict_metadata[key] = dcp.TensorStorageMetadata(
                properties=dcp.TensorProperties(dtype=tensor.dtype),
                size=tensor.size(),
                chunks=[dcp.ChunkStorageMetadata(offsets=origin, sizes=tensor.size())],
            )
            storage_data[dcp.MetadataIndex(key, origin, 0)] = filesystem._StorageInfo(DATA_FILE, start, length)
            total += ref.nbytes
            on_bytes(ref.nbytes)
    fields: dict[str, Any] = {
        "state_dict_metadata": state_dict_metadata,
        "planner_data": {key: (key,) for key, _ in entries},
        "storage_data": storage_data,
    }
    if "version" in dcp.Metadata.__dataclass_fields__:
        fields["version"] = getattr(filesystem, "CURRENT_DCP_VERSION", None)
    with open_output(METADATA_FILE) as metadata_file:
        pickle.dump(dcp.Metadata(**fields), metadata_file)
    return total
