"""Room on the destination: the bytes an output will take, checked against the free space before anything is written."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

from ckptconv._text import short_repr
from ckptconv.errors import WriteError
from ckptconv.values.tensor import TensorRef
from ckptconv.writing import torch_zip as zip_writer
from ckptconv.writing.naming import FOLDER_FORMATS


def planned_bytes(
    entries: Sequence[tuple[str, TensorRef]],
    kind: str,
    *,
    zip_plan: zip_writer.Plan | None = None,
    dedupe: bool = True,
) -> int:
    """Tensor bytes an output of ``kind`` will hold, which are the bytes its writer copies (the
    progress bar's total): ``.pt`` keeps views and ties as torch.save does (``zip_plan``, when
    already made, says how); safetensors stores each distinct tensor once, contiguous, or under
    every name without ``dedupe`` (``--tied copy``); DCP saves every key's tensor apart."""
    if kind == "pt":
        storages, _ = zip_plan or zip_writer.plan_storages(entries)
        return sum(storage.nbytes for storage in storages)
    if kind in FOLDER_FORMATS or not dedupe:
        return sum(ref.nbytes for _, ref in entries)
    return sum(ref.nbytes for ref in {ref: None for _, ref in entries})


def check_room(entries: Sequence[tuple[str, TensorRef]], target: str, kind: str, needed: int) -> None:
    """Refuse, before anything is allocated or written, an output larger than the free space.

    A view can repeat a few stored bytes (stride 0) into terabytes: a 600-byte
    ``.pt`` can ask for more than any disk holds once written contiguously.
    """
    from ckptconv._text import human_bytes

    folder = os.path.dirname(target)
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        usage = shutil.disk_usage(folder or ".")
    except OSError:
        return  # no answer from the file system: the write itself will say
    # A file system of no size (/proc, /sys) answers 0 free: whether a file can be made there at all, the
    # write itself says ("needs 88 B but only 0 B are free" was no answer).
    if needed <= usage.free or usage.total == 0:
        return
    free = usage.free
    key, ref = max(entries, key=lambda entry: entry[1].nbytes)
    start, stop = ref.byte_span
    largest = f"; tensor {short_repr(key)} alone is {human_bytes(ref.nbytes)}"
    if ref.nbytes > 2 * (stop - start):
        largest += f", a view that repeats {human_bytes(stop - start)} of stored bytes"
    raise WriteError(
        f"writing {target!r} as {kind} needs {human_bytes(needed)} but only {human_bytes(free)} "
        f"are free there{largest}",
        path=target,
    )
