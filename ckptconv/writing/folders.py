"""Folder outputs: a sharded Hugging Face folder or a DCP folder, its shards planned, checked for room and written."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, Callable

from ckptconv.errors import OutputExistsError, WriteError
from ckptconv.reading.formats import dcp
from ckptconv.reading.formats._base import MetadataValue, metadata_text
from ckptconv.values.tensor import Storage, TensorRef
from ckptconv.writing import dcp as dcp_writer
from ckptconv.writing import shards, torch_dist, write_policy
from ckptconv.writing.atomic import atomic_output
from ckptconv.writing.files import WriteReport, save_file
from ckptconv.writing.provenance import written_by_ckptconv
from ckptconv.writing.transaction import FolderTransaction, _Part


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
    transaction: FolderTransaction | _Part,
    written_before: Callable[[Any, str, str], WriteReport] | None = None,
) -> WriteReport:
    """Write a sharded or DCP folder as a whole or not at all (:mod:`.transaction`).

    The new files are written and checked in ``transaction``'s staging folder, which the caller publishes
    once the rest of the output (a model folder's configs) is there too. The previous output's files
    ckptconv wrote that the new one lacks are removed only with ``overwrite``, as the new folder is
    published, and files it did not write never. On any failure the previous output stays as it was.
    ``written_before(shard, name, path)``: put the shard ``name`` that a part wrote (``convert --part``, verified
    by :mod:`.parts`) at ``path`` in the staging folder instead of writing it.
    """
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise WriteError(f"{folder!r} is a file; give a folder for a sharded or DCP output", path=folder)
    inputs.check_folder(folder)
    if kind == "dcp":
        plan = None
        names = [dcp.DATA_FILE, dcp.METADATA_FILE]
        family = re.compile(r"^(__\d+_\d+\.distcp|\.metadata)$")
    elif kind == "megatron":
        plan = None
        names = [dcp.DATA_FILE, dcp.METADATA_FILE, torch_dist.COMMON_FILE, torch_dist.CONFIG_FILE]
        family = re.compile(r"^(__\d+_\d+\.distcp|\.metadata|common\.pt|metadata\.json)$")
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
    # Only the old output's files ckptconv wrote are removed; a file of the same family that carries no
    # provenance (the user's own, or a --no-provenance output) stays where it is.
    removed = [name for name in stale if written_by_ckptconv(os.path.join(folder, name))]
    transaction.drop_old(removed)
    staging = transaction.path
    staged: list[str] = []  # names, in the order they were written: the index or .metadata last
    aliases: dict[str, str] = {}
    if plan is None:

        def open_output(name: str) -> Any:
            staged.append(name)
            return atomic_output(os.path.join(staging, name), overwrite=True, fsync=fsync, inputs=inputs)

        writer = torch_dist.write if kind == "megatron" else dcp_writer.write
        total = writer(entries, staging, open_output=open_output, on_bytes=update, record_crcs=record_crcs)
    else:
        total = 0
        weight_map: dict[str, str] = {}
        for shard, name in zip(plan.shards, shard_files):
            # Shards are plain state dicts (what transformers loads); `extra` is for single files.
            if written_before is not None:
                report = written_before(shard, name, os.path.join(staging, name))
            else:
                report = save_file(
                    list(shard),
                    os.path.join(staging, name),
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
            staged.append(name)
            total += report.bytes
            aliases.update(report.aliases)
            weight_map.update({key: name for key, _ in shard if key not in report.aliases})
        if len(shard_files) > 1:
            index_metadata = {k: metadata_text(v) for k, v in (metadata or {}).items() if k.startswith("ckptconv.")}
            document = shards.index_document(weight_map, total, index_metadata)
            target = os.path.join(staging, index_file)
            with atomic_output(target, overwrite=True, fsync=fsync, inputs=inputs) as file:
                file.write(document)
            staged.append(index_file)
    if check is not None:
        # The files this write made, where they are staged, before they replace anything.
        check(staging if plan is None else os.path.join(staging, staged[-1]))
    written_files = tuple(os.path.join(folder, name) for name in staged)
    kept = tuple(os.path.join(folder, name) for name in stale if name not in removed)
    return WriteReport(folder, kind, len(entries), total, aliases, written_files, kept)
