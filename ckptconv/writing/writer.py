"""Write: stream a state dict to ``.pt``, safetensors, a sharded folder or a DCP folder, atomically.

Bytes go from the input file to the output tensor by tensor, in bounded
chunks, so memory stays bounded by the largest tensor. The output is written to
a temporary file beside the destination and renamed into place only when it is
complete: an interrupted or failed write leaves the old file (or nothing),
never a truncated one (huggingface/safetensors#762).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Callable, Union

from ckptconv._paths import PathLike, as_path
from ckptconv._text import shown
from ckptconv.errors import CkptconvError, WriteError
from ckptconv.options import TIED
from ckptconv.quantization import output_check
from ckptconv.reading.formats._base import MetadataValue
from ckptconv.reading.read_policy import keeping_open
from ckptconv.reading.streaming import keeping_workers
from ckptconv.values.tensor import Storage, TensorRef
from ckptconv.writing import model_files, parts, shards, write_policy
from ckptconv.writing import torch_zip as zip_writer
from ckptconv.writing.files import WriteReport, save_file
from ckptconv.writing.folders import save_folder
from ckptconv.writing.locks import OutputLock
from ckptconv.writing.model_files import ModelFiles
from ckptconv.writing.naming import is_folder_destination, output_format
from ckptconv.writing.room import check_room, planned_bytes
from ckptconv.writing.transaction import FolderTransaction, _Part, enclosing_part

__all__ = ["WriteReport", "output_format", "save", "tied_note", "write_state"]

Progress = Union[bool, Callable[[int], None]]


def _source_paths(entries: Iterable[tuple[str, TensorRef]]) -> set[str]:
    """Every file the tensors are read from (a DCP tensor's chunks included)."""
    paths: set[str] = set()
    for _, ref in entries:
        paths |= ref.storage.source.paths()
    return paths


def _progress_callback(progress: Progress, total: int, path: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    if callable(progress):
        return progress, lambda: None
    if not progress:
        return (lambda n: None), (lambda: None)
    from tqdm.auto import tqdm

    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=shown(os.path.basename(path)),  # a file name could hold terminal escape sequences
        leave=False,
        dynamic_ncols=True,
    )

    def update(count: int) -> None:
        bar.update(count)

    return update, bar.close


def save(
    state: Mapping[str, Any],
    path: PathLike,
    *,
    to: str | None = None,
    overwrite: bool = False,
    metadata: Mapping[str, MetadataValue] | None = None,
    extra: Mapping[str, Any] | None = None,
    max_shard_size: int | None = None,
    progress: Progress = False,
    inputs: Iterable[str] = (),
    check: Callable[[str], None] | None = None,
    fsync: bool = True,
    tied: str = "dedupe",
    format: str | None = None,
    record_crcs: dict[Storage, int] | None = None,
) -> WriteReport:
    """Write a state dict to ``.pt``, safetensors, shards or a DCP folder, streaming, atomically.

    A destination that is a folder (it exists, or ends in ``/``), or any
    destination with ``max_shard_size`` or ``to="dcp"``, gets a folder
    layout: ``model.safetensors`` or ``model-0000k-of-0000N.safetensors`` plus
    ``model.safetensors.index.json`` (``pytorch_model*.bin`` for ``pt``), or a
    DCP folder (``.metadata`` and ``__0_0.distcp``).

    Args:
        state: names to tensors: lazy :class:`~ckptconv.values.tensor.TensorRef` from
            :func:`ckptconv.open`, or torch tensors.
        path: the output file or folder.
        to: ``"pt"``, ``"safetensors"`` or ``"dcp"``; from the suffix of
            ``path`` when None (safetensors for folders). The same word as
            :func:`ckptconv.convert` and :func:`ckptconv.batch` use.
        overwrite: replace existing outputs, and remove shards an earlier run
            left that this one does not write.
        metadata: string metadata: safetensors ``__metadata__``, or the
            ``ckptconv.json`` record of a ``.pt`` file (also in a shard index).
        extra: ``.pt`` only: plain data (numbers, strings, tuples, lists, sets, dicts) to keep
            beside the weights, which then sit under ``"state_dict"``.
        max_shard_size: split into shards of at most this many bytes (a tensor
            larger than that gets a shard of its own).
        progress: show a progress bar on stderr, or a callable given byte counts.
        inputs: other files that must never be written, replaced or deleted (every
            file of the checkpoint read, :attr:`ckptconv.Checkpoint.files`); a folder
            output may not be a folder that holds one of them.
        check: called with the finished output's path (the temporary file, or
            the folder once written); an exception from it leaves no output behind.
        fsync: flush the output to disk before it appears under its name
            (durable across power loss); False is faster for scratch files.
        tied: for safetensors, keys that share one tensor (tied weights):
            ``"dedupe"`` stores it once and lists the other names in the file's
            ``ckptconv.aliases`` metadata, as Hugging Face files do (load with
            ``safetensors.torch.load_model(model, path)`` or :func:`ckptconv.load`);
            ``"copy"`` writes it under every name, so that
            ``model.load_state_dict(safetensors.torch.load_file(path), strict=True)``
            accepts the file. ``.pt`` files always keep tied tensors shared.
        format: deprecated spelling of ``to``.
        record_crcs: a dict that receives the CRC-32 of each whole source
            record a cast reads, taken from the bytes it cast (see
            :func:`ckptconv.reading.streaming.iter_bytes`); a converter checks them
            with :func:`ckptconv.reading.integrity.check_record_crcs` (``computed=``)
            instead of reading those records again.

    Returns:
        A :class:`WriteReport`.

    Raises:
        OutputExistsError: an output exists and ``overwrite`` is False.
        WriteError: the output cannot be written, or is one of the inputs.
        CastOverflowError: a pending fp16/bf16 cast would create infinities.

    Example:
        >>> ckptconv.save(model.state_dict(), "model.safetensors")  # doctest: +SKIP
        >>> ckptconv.save(state, "out/", max_shard_size=5 * 10**9)   # doctest: +SKIP
    """
    if format is not None:
        warnings.warn(
            "ckptconv.save(format=...) is deprecated; use to=..., as convert() and batch() do",
            DeprecationWarning,
            stacklevel=2,
        )
        if to is not None and to != format:
            raise ValueError(f"save() got to={to!r} and its deprecated spelling format={format!r}; pass only to")
        to = format
    return write_state(
        state,
        path,
        to=to,
        overwrite=overwrite,
        metadata=metadata,
        extra=extra,
        max_shard_size=max_shard_size,
        progress=progress,
        inputs=inputs,
        check=check,
        fsync=fsync,
        tied=tied,
        record_crcs=record_crcs,
    )


def write_state(
    state: Mapping[str, Any],
    path: PathLike,
    *,
    to: str | None = None,
    overwrite: bool = False,
    metadata: Mapping[str, MetadataValue] | None = None,
    extra: Mapping[str, Any] | None = None,
    max_shard_size: int | None = None,
    progress: Progress = False,
    inputs: Iterable[str] = (),
    check: Callable[[str], None] | None = None,
    fsync: bool = True,
    tied: str = "dedupe",
    record_crcs: dict[Storage, int] | None = None,
    carried: ModelFiles | None = None,
    lock: OutputLock | None = None,
    output_part: str | None = None,
) -> WriteReport:
    """:func:`save`, whose folder output may be a model folder: the files ``carried`` written beside the weights
    (named after their stem, ``adapter_model.safetensors``), all in one transaction; ``lock``: the output's lock,
    when the caller holds it already; ``output_part``: ``"i/N"``, write part i of N of the folder's shards
    (:mod:`.parts`), the last part to finish publishing the folder."""
    if tied not in TIED:
        raise ValueError(f"tied must be one of {', '.join(TIED)}, not {tied!r}")
    path = as_path(path)
    entries = _entries(state)
    output_check.check_state(dict(entries))  # the last check: no orphan scale, whatever wrote the state
    target = os.path.abspath(path)
    protected = write_policy.Inputs([*_source_paths(entries), *inputs])
    folder_output = is_folder_destination(path, to, max_shard_size)
    kind = output_format(path, to, folder=folder_output)
    # One plan of a .pt file's storages serves the room check and the write: with 10^5 tensors
    # planning costs seconds.
    zip_plan = zip_writer.plan_storages(entries) if kind == "pt" and not folder_output else None
    # What the writer copies: tied tensors once (or once per name with tied="copy"), so the bar ends at its total.
    total = planned_bytes(entries, kind, zip_plan=zip_plan, dedupe=tied == "dedupe")
    check_room(entries, target, kind, total)
    # A missing parent folder is created, as save_pretrained does, below the part of the path that exists
    # (write_policy.make_folders says how far); removed again when the write fails.
    parent = os.path.dirname(path.rstrip("/" + os.sep))
    part = enclosing_part(target) if folder_output else None  # a part of a folder of models: made where staged
    with contextlib.ExitStack() as cleanup:
        made = parent and not os.path.isdir(parent) and part is None
        created = write_policy.make_folders(parent) if made else []
        cleanup.push(lambda *error: write_policy.remove_folders(created) if error[0] is not None else None)
        update, close = _progress_callback(progress, total, target)
        cleanup.callback(close)
        cleanup.enter_context(keeping_open())  # each source file opened once for all its tensors
        cleanup.enter_context(keeping_workers())  # one pool of cast threads for all the tensors
        if output_part is not None:
            parts.refuse_parts(kind, folder_output and part is None)
        if folder_output:

            def write_folder(written_before: parts.WrittenBefore | None = None) -> WriteReport:
                """The folder as one transaction (its shards written now, or by the parts: ``written_before``)."""
                with contextlib.ExitStack() as held_here:
                    transaction: FolderTransaction | _Part | None = part
                    if transaction is None:
                        held = held_here.enter_context(
                            contextlib.nullcontext(lock) if lock is not None else OutputLock(target)
                        )
                        transaction = FolderTransaction(held, inputs=protected, fsync=fsync)
                    with transaction.undone_on_failure():
                        report = save_folder(
                            entries,
                            target,
                            kind,
                            overwrite=overwrite,
                            metadata=metadata,
                            extra=extra,
                            max_shard_size=max_shard_size,
                            update=update,
                            inputs=protected,
                            check=check,
                            fsync=fsync,
                            dedupe=tied == "dedupe",
                            record_crcs=record_crcs,
                            stem=carried.stem if carried is not None else None,
                            transaction=transaction,
                            written_before=written_before,
                        )
                        staged = (
                            model_files.write(carried, transaction.path, inputs=protected, fsync=fsync)
                            if carried
                            else ()
                        )
                        return _publish(transaction, report, tuple(transaction.final(path) for path in staged))

            if output_part is None:
                return write_folder()

            def write_shard(shard: Any, path: str) -> WriteReport:
                return save_file(
                    list(shard), path, kind, inputs=protected, overwrite=True, metadata=metadata, extra=None,
                    update=update, check=None, fsync=fsync, dedupe=tied == "dedupe", record_crcs=record_crcs,
                )  # fmt: skip

            plan = shards.plan_shards(entries, max_shard_size)
            names, index = shards.shard_names(kind, len(plan.shards), carried.stem if carried is not None else None)
            return parts.write_part(
                plan, names, index, target, parts.parse_part(output_part), kind=kind, metadata=metadata,
                write_shard=write_shard, publish=write_folder, inputs=protected, fsync=fsync,
            )  # fmt: skip
        protected.check_file(target)
        return save_file(
            entries,
            target,
            kind,
            zip_plan=zip_plan,
            inputs=protected,
            overwrite=overwrite,
            metadata=metadata,
            extra=extra,
            update=update,
            check=check,
            fsync=fsync,
            dedupe=tied == "dedupe",
            record_crcs=record_crcs,
        )


def _publish(transaction: FolderTransaction | _Part, report: WriteReport, carried: tuple[str, ...]) -> WriteReport:
    """Publish a folder output, all of it staged (weights, index, the model files ``carried``), in one step. A check
    of the whole staged output (:attr:`FolderTransaction.path`) before it is published belongs here."""
    kept = transaction.publish()
    noted = set(report.kept)
    others = [path for path in (os.path.join(report.path, *name.split("/")) for name in kept) if path not in noted]
    if transaction.leftover is not None:
        others.append(transaction.leftover)
    return dataclasses.replace(report, files=report.files + carried, kept=report.kept + tuple(others))


def _entries(state: Mapping[str, Any]) -> list[tuple[str, TensorRef]]:
    entries: list[tuple[str, TensorRef]] = []
    cache: dict[Any, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise WriteError(f"state dict key {key!r} is not a string")
        if isinstance(value, TensorRef):
            entries.append((key, value))
        else:
            from ckptconv.gpu.torch_tensors import from_torch

            try:
                entries.append((key, from_torch(value, cache)))
            except TypeError:
                raise WriteError(
                    f"{key!r} holds a {type(value).__name__}, not a tensor; only tensors can be written"
                ) from None
            except CkptconvError as error:
                raise WriteError(f"{key!r} cannot be written: {error}") from None
    return entries


def tied_note(aliases: Mapping[str, str], path: str, sharded: bool) -> str:
    """How to load a file whose tied tensors were stored once: the exact calls (issue 14)."""
    count = len(aliases)
    shown = ", ".join(f"{alias} = {kept}" for alias, kept in list(aliases.items())[:2])
    shown += f" and {count - 2} more" if count > 2 else ""
    if sharded:
        how = "transformers' from_pretrained or ckptconv.load() restore them"
    else:
        how = f"load with safetensors.torch.load_model(model, {path!r}) or ckptconv.load({path!r}), which restore them"
    return (
        f"{count} tied tensor{'s are' if count != 1 else ' is'} stored once, as Hugging Face does ({shown}); {how}; "
        "plain model.load_state_dict(safetensors.torch.load_file(...), strict=True) needs --tied copy"
    )
