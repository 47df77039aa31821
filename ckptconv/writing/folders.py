"""Folder outputs: a sharded Hugging Face folder or a DCP folder, its shards planned, checked for room and written."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from typing import Any, Callable

from ckptconv.errors import OutputExistsError, WriteError
from ckptconv.reading.formats import dcp
from ckptconv.reading.formats._base import MetadataValue, metadata_text
from ckptconv.values.tensor import Storage, TensorRef
from ckptconv.writing import dcp as dcp_writer
from ckptconv.writing import shards, write_policy
from ckptconv.writing.atomic import atomic_output
from ckptconv.writing.files import WriteReport, save_file


def save_folder(
    entries: list[tuple[str, TensorRef]],
    folder: str,
    kind: str,
    *,
    overwrite: bool,
    metadata: Mapping[str, MetadataValue] | None,
    extra: Mapping[str, Any] | None,
    max_shard_size: int | None,
    update: Callable[[int], None],
    inputs: write_policy.Inputs,
    check: Callable[[str], None] | None,
    fsync: bool,
    dedupe: bool = True,
    record_crcs: dict[Storage, int] | None = None,
    stem: str | None = None,
) -> WriteReport:
    """Write a sharded or DCP folder: each file atomically, the index last, stale shards only with overwrite."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise WriteError(f"{folder!r} is a file; give a folder for a sharded or DCP output", path=folder)
    inputs.check_folder(folder)
    if kind == "dcp":
        plan = None
        names = [dcp.DATA_FILE, dcp.METADATA_FILE]
        family = re.compile(r"^(__\d+_\d+\.distcp|\.metadata)$")
    else:
        plan = shards.plan_shards(entries, max_shard_size)
        shard_files, index_file = shards.shard_names(kind, len(plan.shards), stem)
        names = shard_files + ([index_file] if len(shard_files) > 1 else [])
        family = shards.family_pattern(kind, stem)
    existing = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    clashes = sorted(name for name in existing if name in names)
    stale = sorted(name for name in existing if family.match(name) and name not in names)
    if (clashes or stale) and not overwrite:
        described = ", ".join((clashes + stale)[:4]) + (" ..." if len(clashes + stale) > 4 else "")
        raise OutputExistsError(
            f"{folder!r} already holds {described}"
            + (" (left by an earlier run)" if stale and not clashes else "")
            + "; pass --overwrite to replace them",
            path=folder,
        )
    for name in names:
        inputs.check_file(os.path.join(folder, name), action="replace")
    for name in stale:
        inputs.check_file(os.path.join(folder, name), action="delete")
    created = write_policy.make_folders(folder)
    written_files: list[str] = []
    aliases: dict[str, str] = {}
    try:
        if plan is None:

            def open_output(name: str) -> Any:
                written_files.append(os.path.join(folder, name))
                return atomic_output(os.path.join(folder, name), overwrite=True, fsync=fsync, inputs=inputs)

            total = dcp_writer.write(entries, folder, open_output=open_output, on_bytes=update)
        else:
            total = 0
            weight_map: dict[str, str] = {}
            for shard, name in zip(plan.shards, shard_files):
                # Shards are plain state dicts (what transformers loads); `extra` is for single files.
                report = save_file(
                    list(shard),
                    os.path.join(folder, name),
                    kind,
                    inputs=inputs,
                    overwrite=True,
                    metadata=metadata,
                    extra=None,
                    update=update,
                    check=None,
                    fsync=fsync,
                    dedupe=dedupe,
                    record_crcs=record_crcs,
                )
                written_files.append(report.path)
                total += report.bytes
                aliases.update(report.aliases)
                weight_map.update({key: name for key, _ in shard if key not in report.aliases})
            if len(shard_files) > 1:
                index_metadata = {k: metadata_text(v) for k, v in (metadata or {}).items() if k.startswith("ckptconv.")}
                document = shards.index_document(weight_map, total, index_metadata)
                index_path = os.path.join(folder, index_file)
                with atomic_output(index_path, overwrite=True, fsync=fsync, inputs=inputs) as file:
                    file.write(document)
                written_files.append(os.path.join(folder, index_file))
        if check is not None:
            # The files this write made, not whatever else the folder holds.
            check(folder if plan is None else written_files[-1])
    except BaseException:
        for path in written_files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        write_policy.remove_folders(created)
        raise
    for name in stale:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(folder, name))
    return WriteReport(folder, kind, len(entries), total, aliases, tuple(written_files))
