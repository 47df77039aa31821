"""Single-file outputs: one .pt or safetensors file, written atomically, and what a write reports."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable

from ckptconv._text import plural
from ckptconv.errors import CastOverflowError
from ckptconv.reading.formats._base import MetadataValue, split_aliases
from ckptconv.values.tensor import Storage, TensorRef
from ckptconv.writing import copying, write_policy
from ckptconv.writing import safetensors as safetensors_writer
from ckptconv.writing import torch_zip as zip_writer
from ckptconv.writing.atomic import atomic_output
from ckptconv.writing.copying import naming_overflows, overflow_named
from ckptconv.writing.room import planned_bytes
from ckptconv.writing.torch_zip import PlannedStorage


@dataclass(frozen=True)
class WriteReport:
    """What :func:`save` wrote.

    Attributes:
        path: the output file, or folder.
        format: ``"pt"``, ``"safetensors"`` or ``"dcp"``.
        tensors: keys written (aliases included).
        bytes: tensor bytes written.
        aliases: for safetensors, keys stored as references to another key's data.
        files: every file written (one, or the shards and the index).
        kept: the files a folder output's destination held that the new output does not use and ckptconv
            left where they are, since it cannot tell it wrote them: an earlier output's shards without
            ckptconv's provenance, a file of the user's, a config an earlier conversion carried.
        pending: for one part of a folder (``--part``), the parts still to finish before the folder is
            published (0: published, by this part or before it).
    """

    path: str
    format: str
    tensors: int
    bytes: int
    aliases: Mapping[str, str] = field(default_factory=dict)
    files: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    pending: int = 0

    @property
    def notes(self) -> tuple[str, ...]:
        """What the user should know of the write: the files it kept, named; the parts still to come."""
        if self.pending:
            waiting = plural(self.pending, "other part")
            verb = "finishes" if self.pending == 1 else "finish"
            return (f"this part's shards are written; {self.path!r} is published when {waiting} {verb}",)
        if not self.kept:
            return ()
        inside = os.path.join(self.path, "")
        names = [path[len(inside) :] if path.startswith(inside) else path for path in self.kept[:_KEPT_NAMED]]
        more = f" and {len(self.kept) - _KEPT_NAMED} more" if len(self.kept) > _KEPT_NAMED else ""
        return (
            f"kept {plural(len(self.kept), 'file')} in {self.path!r} that the new output does not use and ckptconv "
            f"cannot tell it wrote: {', '.join(names)}{more}; remove them if they do not belong with the new output",
        )


#: Files a note names; the rest it counts.
_KEPT_NAMED = 8


def save_file(
    entries: list[tuple[str, TensorRef]],
    target: str,
    kind: str,
    *,
    overwrite: bool,
    metadata: Mapping[str, MetadataValue] | None,
    extra: Mapping[str, Any] | None,
    update: Callable[[int], None],
    check: Callable[[str], None] | None,
    fsync: bool,
    dedupe: bool = True,
    record_crcs: dict[Storage, int] | None = None,
    inputs: write_policy.Inputs | None = None,
    zip_plan: zip_writer.Plan | None = None,
) -> WriteReport:
    aliases: dict[str, str] = {}
    if kind == "pt" and zip_plan is None:
        zip_plan = zip_writer.plan_storages(entries)
    reserve = planned_bytes(entries, kind, zip_plan=zip_plan, dedupe=dedupe)
    with atomic_output(target, overwrite=overwrite, fsync=fsync, reserve=reserve, inputs=inputs) as file:
        if kind == "safetensors":

            def write_tensor(ref: TensorRef, out: BinaryIO) -> Iterator[int]:
                for count in naming_overflows(entries, ref, copying.stream_tensor(ref, out, record_crcs)):
                    update(count)
                    yield count

            written = safetensors_writer.write(
                entries, file, metadata=metadata, write_tensor=write_tensor, dedupe=dedupe
            )
            aliases = split_aliases(entries)[1] if dedupe else {}
        else:

            def write_storage(storage: PlannedStorage, out: BinaryIO) -> int:
                try:
                    return copying.write_planned_storage(storage, out, update, record_crcs)
                except CastOverflowError as error:  # named by the first tensor stored in that storage
                    key = next((k for k, r in entries if r.storage is storage.tensor.storage), "?")
                    raise overflow_named(error, key) from None

            written = zip_writer.write(
                entries,
                file,
                write_storage=write_storage,
                plan=zip_plan,
                metadata=metadata,
                extra=extra,
            )
        if check is not None:
            file.flush()
            check(file.name)
    return WriteReport(target, kind, len(entries), written, aliases, (target,))
