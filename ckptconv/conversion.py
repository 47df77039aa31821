"""The whole flow in one call: load → select → transform → write → verify.

:func:`convert` is what every CLI command runs. It prints nothing: whatever the
user should hear (which weights were picked, keys that had no prefix, devices
the file was saved on) comes back in :class:`ConversionReport.notes`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptconv._paths import PathLike, as_path
from ckptconv._text import plural
from ckptconv._version import __version__
from ckptconv.architectures import arranging, coverage
from ckptconv.errors import DestinationError, FitError, TransformError, VerifyError
from ckptconv.fitting import LikeFolder, cast_like, like_folder
from ckptconv.loading import Checkpoint
from ckptconv.loading import open as open_checkpoint
from ckptconv.options import REFERENCES, ConversionOptions
from ckptconv.quantization import fp8_quantize
from ckptconv.quantization.schemes import DECLARATION_KEYS
from ckptconv.quantization.stage import Dequantization, declared_scheme
from ckptconv.reading.formats._base import Deferred, MetadataValue
from ckptconv.reading.integrity import check_record_crcs
from ckptconv.reading.model_folder import FRAMEWORK_FORMATS, Model, resolve_model
from ckptconv.reading.streaming import reads_whole_record
from ckptconv.reading.unpickling.rebuild import DEQUANTIZED_ORIGIN
from ckptconv.runtime import cores as _cores
from ckptconv.runtime.collector import collector_paused
from ckptconv.selection.weights import Selection
from ckptconv.transforms import keys as key_transforms
from ckptconv.transforms.keys import Canonicalize, Cast, StepReport, StripPrefix, Transform, cast_step, compile_pattern
from ckptconv.values.tensor import Storage, TensorRef
from ckptconv.writing import model_files, write_policy
from ckptconv.writing.locks import OutputLock
from ckptconv.writing.naming import FOLDER_FORMATS, is_folder_destination, output_format
from ckptconv.writing.parts import planned as planned_parts
from ckptconv.writing.provenance import checkpoint_metadata, encode_entries, source_sha256
from ckptconv.writing.transaction import enclosing, locked
from ckptconv.writing.writer import Progress, tied_note, write_state

__all__ = ["ConversionReport", "convert"]


@dataclass(frozen=True)
class ConversionReport:
    """What :func:`convert` did.

    Attributes:
        source: the input file.
        destination: the output file ("" for a dry run).
        source_format: the input's format.
        format: the output's format (``"pt"``, ``"safetensors"`` or ``"dcp"``; a sharded
            folder has the format of its shards).
        selected: where the weights were found (``""`` for the whole file).
        steps: one report per transform step.
        tensors: keys written.
        bytes: tensor bytes written.
        aliases: safetensors keys stored as references to another key's data.
        foreign_globals: classes that became inert stand-ins (nothing was run).
        saved_devices: devices the input's tensors were saved from.
        notes: sentences the user should see, in order (each step's :attr:`StepReport.notes` among them).
        verified: True when the output was verified, None when not asked.
        renames: the first ``(old, new)`` key pairs, for ``--dry-run``.
        files: every file written (one, or the shards and the index of a folder).
        source_sha256: the source's sha256 recorded in the provenance (None with
            ``source_hash=False``; for folders, see :func:`ckptconv.writing.provenance.source_sha256`).
        verified_with: ``"ckptconv"`` or ``"torch"``: whose readers verified the output (``"torch"`` only
            when torch or the safetensors library read both sides; a note says who read what otherwise).
    """

    source: str
    destination: str
    source_format: str
    format: str
    selected: str
    steps: tuple[StepReport, ...]
    tensors: int
    bytes: int
    aliases: Mapping[str, str] = field(default_factory=dict)
    foreign_globals: Mapping[str, int] = field(default_factory=dict)
    saved_devices: frozenset[str] = frozenset()
    notes: tuple[str, ...] = ()
    verified: bool | None = None
    renames: tuple[tuple[str, str], ...] = ()
    files: tuple[str, ...] = ()
    source_sha256: str | None = None
    verified_with: str = ""


def _file_name(path: str) -> str:
    """A path's last part as text: a name that is not UTF-8 (``caf\\xe9.pt``) shows its bytes as ``\\xNN``."""
    name = os.path.basename(path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(name).decode("utf-8", "backslashreplace")
    return name


def _prefix_notes(step: Transform, report: StepReport, keys: Sequence[str]) -> list[str]:
    if isinstance(step, Canonicalize):
        if not report.details:  # unless the step's own notes say which prefix is left, and what to pass
            return [] if report.notes else ["no wrapper prefixes found; the keys are already canonical"]
        removed = ", ".join(f"'{name}.' from {plural(count, 'key')}" for name, count in report.details.items())
        return [f"removed wrappers: {removed}"]
    if not isinstance(step, StripPrefix) or not report.unchanged:
        return []
    prefix = step.component
    if report.changed == 0:
        starts = sorted({start for start in key_transforms.HINTED_PREFIXES for key in keys if key.startswith(start)})
        hint = f"; keys start with {', '.join(repr(s) for s in starts)}" if starts else ""
        return [f"no key starts with {prefix!r}, so none was renamed{hint}"]
    total = report.changed + report.unchanged
    return [f"{report.unchanged} of {total} keys had no {prefix!r} prefix and were left unchanged"]


def _origins(keys: Sequence[str], steps: Sequence[Transform]) -> dict[str, str] | None:
    """Each output key's source key: the key steps run again on the names alone (casts change no name).

    None when a step needs real tensors (a caller's own transform), or the names do not line up.
    """
    origins = {key: key for key in keys}  # current name -> source name
    for step in steps:
        if isinstance(step, Cast):
            continue
        names: dict[str, Any] = {key: key for key in origins}  # the names stand in for the tensors
        try:
            renamed, _ = step.apply(names)
        except Exception:  # a caller's transform that looks at values: no key-by-key answer
            return None
        values: dict[str, Any] = dict(renamed)
        if not all(isinstance(old, str) and old in origins for old in values.values()):
            return None
        origins = {new: origins[old] for new, old in values.items()}
    return origins


def convert(
    source: PathLike,
    destination: PathLike | None,
    *,
    options: ConversionOptions | None = None,
    dry_run: bool = False,
    progress: Progress = False,
    **changes: Any,
) -> ConversionReport:
    """Convert a checkpoint: pick its weights, transform them, write them, optionally verify.

    Args:
        source: any checkpoint :func:`ckptconv.open` reads.
        destination: the output file, or a folder (existing, or ending in ``/``)
            for a sharded or DCP layout; the suffix picks the format unless
            ``options.to`` is given.
        options: how to convert (:class:`~ckptconv.options.ConversionOptions`:
            selection, transforms, output format, overwrite, verify, hashing,
            sharding, ...); defaults when None.
        dry_run: do everything but write; ``renames`` shows the key changes.
        progress: show a progress bar on stderr, or a callable given byte counts.
        **changes: fields of :class:`~ckptconv.options.ConversionOptions` to set
            on ``options`` (``transforms=[...]``, ``to="pt"``, ``overwrite=True``).

    Returns:
        A :class:`ConversionReport`.

    Raises:
        LoadError, SelectionError, TransformError, WriteError, VerifyError.
        TypeError: a keyword that is not an options field.

    Example:
        >>> ckptconv.convert("dp_model.pkl", "model.safetensors",
        ...                  transforms=[ckptconv.StripPrefix("module"), ckptconv.Cast("bf16")])  # doctest: +SKIP
    """
    source, destination = as_path(source), None if destination is None else as_path(destination)
    options = (options or ConversionOptions()).with_changes("convert", **changes)
    # Its bookkeeping builds and walks objects for every tensor: see ckptconv.runtime.collector.
    # One writer per output: the lock on DST comes first (a second writer is refused, named).
    # convert --part: N processes write one folder at once; the part that publishes takes the lock then.
    with collector_paused(), locked(None if dry_run or options.part is not None else destination) as lock:
        model = resolve_model(source)  # what the source is, once: a model folder (or a folder of them), or a file
        if model is not None and model.parts:
            return _convert_parts(model, destination, options, lock, dry_run=dry_run, progress=progress)
        return _convert(source, destination, options, model=model, dry_run=dry_run, progress=progress, lock=lock)


def _convert_parts(
    model: Model, destination: str | None, options: ConversionOptions, lock: OutputLock | None, **how: Any
) -> ConversionReport:
    """A folder of model folders (sentence-transformers' modules, diffusers' components): the model at its top (or
    its files alone), then each part into the folder of its name under ``destination``, converted alike, all in one
    transaction."""
    root, parts = model.folder, model.parts
    if destination is not None and not is_folder_destination(destination, options.to, options.max_shard_size):
        shown = ", ".join(f"{part}/" for part in parts)
        raise DestinationError(f"{root!r} is a folder of models ({shown}); give a folder as DST (out/)", path=root)
    whole = enclosing(lock, source=root, fsync=options.fsync) if lock is not None else contextlib.nullcontext()
    with whole:  # one transaction: the top and every part are published at once, or nothing is
        if model.weights:
            reports = [_convert(root, destination, options, model=model, lock=lock, **how)]
        else:
            carried, files = model_files.write_alone(
                root, None if how["dry_run"] else destination, parts, overwrite=options.overwrite, fsync=options.fsync
            )
            kind = options.to or "safetensors"
            shown = os.path.abspath(destination) if destination is not None and not how["dry_run"] else ""
            notes = carried.notes
            reports = [ConversionReport(root, shown, "model folders", kind, "", (), 0, 0, notes=notes, files=files)]
        for part in parts:
            target = None if destination is None else os.path.join(destination, part, "")
            reports.append(convert(os.path.join(root, part), target, options=options, **how))
    named = list(zip(("", *(f"{part}/: " for part in parts)), reports))
    return dataclasses.replace(
        reports[0],
        steps=tuple(dataclasses.replace(step, step=name + step.step) for name, r in named for step in r.steps),
        notes=tuple(name + note for name, report in named for note in report.notes),
        tensors=sum(report.tensors for report in reports),
        bytes=sum(report.bytes for report in reports),
        files=tuple(path for report in reports for path in report.files),
    )


def _convert(
    source: PathLike,
    destination: PathLike | None,
    options: ConversionOptions,
    *,
    dry_run: bool,
    progress: Progress,
    model: Model | None = None,
    lock: OutputLock | None = None,
) -> ConversionReport:
    """The pipeline: load, select, transform, then (unless a dry run) write, verifying as it writes (``model``: the
    model folder the source is, whose parts are converted apart)."""
    reference = _verify_reference(options)
    like = like_folder(options.fit_to)  # --like base_model/: the output takes after a model folder
    folder_out = destination is not None and is_folder_destination(destination, options.to, None)
    if like is not None and like.max_shard_size and options.max_shard_size is None and folder_out:
        options = dataclasses.replace(options, max_shard_size=like.max_shard_size)  # sharded like it
    checkpoint = open_checkpoint(source, trust=options.trust)
    selection = checkpoint.select(options.select)
    options = arranging.arranged(options, selection, checkpoint.format, as_path(source), like)  # names of the model out
    dequantization = _dequantization(source, checkpoint, selection, options)
    transformed = _transform(dequantization.apply(selection) if dequantization else selection, options)
    if dequantization is not None:
        transformed.notes.append(dequantization.note(selection, transformed.state))
        transformed.dequantization = dequantization
    if like is not None and cast_step(options.transforms) is None:
        transformed.state, transformed.like = cast_like(transformed.state, like), like
    if options.quantize != "none":
        _quantize(transformed, options, already=dequantization)
    ao = sum(ref.origin == DEQUANTIZED_ORIGIN for ref in selection.weights.values())
    if ao:
        transformed.notes.append(
            f"read {plural(ao, 'torch.ao quantized tensor')} as float32, exactly as tensor.dequantize() gives them"
        )
    folder = like.folder if like is not None else model.folder if model is not None else None
    # The weights feed the config's model, all of it (a DCP or Megatron folder out is no Hugging Face model).
    if folder_out and folder is not None and options.to not in FOLDER_FORMATS:
        transformed.coverage = coverage.check(transformed.state, like or folder, allow_missing=options.allow_missing)
    summary = _summary(checkpoint, selection, transformed, destination, options)
    # A model folder in (or --like's) carries its configs, tokenizer ... to a folder out, rewritten where the
    # conversion changed what they say; a file out gets a note on what stays behind.
    carried = None
    if (
        folder is not None
        and summary.format not in FOLDER_FORMATS
        and (like or checkpoint.format not in FRAMEWORK_FORMATS)
    ):
        carried = model_files.carry(
            folder,
            like.files if like is not None else (checkpoint.files or (checkpoint.path,)),
            transformed.state,
            source_keys=selection.weights,
            dequantized=transformed.dequantized,
            quantization_config=transformed.quantization_config,
            file_output=destination is not None and not is_folder_destination(destination, summary.format, None),
            parts=model.parts if model is not None else (),
        )
    if carried is not None and (dry_run or destination is None or not carried.files):
        summary = dataclasses.replace(summary, notes=summary.notes + carried.notes)
    if dry_run or destination is None:
        return summary
    return _write(checkpoint, selection, transformed, destination, options, summary, reference, progress, carried, lock)


def _dequantization(
    source: PathLike, checkpoint: Checkpoint, selection: Selection, options: ConversionOptions
) -> Dequantization | None:
    """The guard: the scheme a checkpoint declares (config.json, safetensors metadata) or gives away (weight/scale
    pairs), refused when ckptconv cannot undo it exactly; a quantized weight is never cast without its scales."""
    scheme = declared_scheme(as_path(source), checkpoint.format, checkpoint.metadata, selection.weights)
    if scheme is None:
        return None
    cast = cast_step(options.transforms)
    return Dequantization(scheme, cast.target if cast is not None else None)


def _quantize(transformed: _Transformed, options: ConversionOptions, *, already: Dequantization | None) -> None:
    """``--quantize fp8-block``: the transformed weights as fp8 blocks, scales beside them (the way back)."""
    if already is not None and already.target is None:
        raise TransformError(
            f"the weights are quantized ({already.scheme}) already; pass --dtype bf16 to dequantize them first"
        )
    cast = cast_step(options.transforms)
    keep = [compile_pattern(pattern) for pattern in cast.keep] if cast is not None else []
    transformed.state, transformed.quantization_config, note = fp8_quantize.quantize_state(transformed.state, keep)
    transformed.notes.append(note)


def _verify_reference(options: ConversionOptions) -> str | None:
    """Whose reader ``--verify`` re-reads both sides with (``ckptconv``, ``torch``), or None for no verify."""
    reference = "ckptconv" if options.verify is True else (options.verify or None)
    if reference is not None and reference not in REFERENCES:
        raise ValueError(f"verify must be True, False or one of {', '.join(REFERENCES)}, not {options.verify!r}")
    return reference


@dataclass
class _Transformed:
    """The selected weights after the transforms (and ``--fit``), with what the user should hear of them."""

    state: dict[str, TensorRef]
    reports: list[StepReport]
    notes: list[str]
    origins: dict[str, str] | None
    fit_report: Any = None
    dequantization: Dequantization | None = None
    quantization_config: dict[str, Any] | None = None  # what --quantize wrote, for the model's config.json
    like: LikeFolder | None = None
    coverage: list[str] = field(default_factory=list)  # what the model folder out lacks (--allow-missing)

    @property
    def dequantized(self) -> bool:
        """A quantization scheme's weights were dequantized: its declaration must not travel with them."""
        return self.dequantization is not None and self.dequantization.target is not None


def _selection_notes(selection: Selection) -> list[str]:
    notes: list[str] = []
    if selection.note:
        notes.append(selection.note)
    elif selection.kind == "module":
        notes.append("the file is a whole pickled model; using its parameters and persistent buffers")
    if selection.skipped:
        left_out = plural(len(selection.skipped), "non-tensor entry", "non-tensor entries")
        notes.append(f"left out {left_out} (e.g. {selection.skipped[0]!r})")
    return notes


def _transform(selection: Selection, options: ConversionOptions) -> _Transformed:
    """Run the pipeline's steps over the selected weights, then fit them to ``--fit``'s reference."""
    pipeline, fit_to = options.transforms, options.fit_to
    state = dict(selection.weights)
    reports: list[StepReport] = []
    notes = _selection_notes(selection)
    for step in pipeline.steps:
        keys = list(state)
        state, report = step.apply(state)
        if keys and not state:
            # An output without weights is almost always a pattern that did not match
            # (ckptconv.save({}, path) writes one on purpose).
            shown = ", ".join(repr(key) for key in keys[:3])
            raise TransformError(
                f"{step.describe()} leaves no tensor of the {len(keys):,} it was given (e.g. {shown}); nothing was "
                "written: check the pattern, which is searched in the key names after any renaming"
            )
        reports.append(report)
        notes.extend([*_prefix_notes(step, report, keys), *report.notes])  # the report's notes are all the notes

    if fit_to is None and not any("--canonical" in note for note in notes):  # fit puts wrappers right itself
        notes.extend(filter(None, [key_transforms.wrapper_note(state)]))  # a wrapper on every key: its flag
    origins = _origins(list(selection.weights), pipeline.steps)
    fit_report = None
    if fit_to is not None:
        from ckptconv.fitting import fit

        before = list(state)
        state, fit_report = fit(state, fit_to)
        before = [key for key in before if key not in fit_report.dropped]  # a tied copy fit left out
        notes.extend(fit_report.notes)
        if origins is not None and fit_report.ok:
            origins = {new: origins[old] for old, new in zip(before, state)}
        if not fit_report.ok:
            raise FitError(fit_report.summary(), report=fit_report)
        renamed = sum(old != new for old, new in zip(before, state))
        plan = "; ".join(fit_report.plan) or "no change"
        reports.append(StepReport(f"fit to {fit_report.reference} ({plan})", renamed, len(state) - renamed))
    return _Transformed(state, reports, notes, origins, fit_report)


def _source_notes(checkpoint: Checkpoint) -> list[str]:
    """What the source file itself says: the devices it was saved on, classes that became stand-ins."""
    notes: list[str] = list(checkpoint.notes)
    devices = sorted(device for device in checkpoint.saved_devices if device != "cpu")
    if devices:
        notes.append(f"tensors were saved on {', '.join(devices)}; the output is loadable on the CPU")
    if checkpoint.foreign_globals:
        names = list(checkpoint.foreign_globals)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        classes = plural(len(names), "class", "classes")
        notes.append(f"{classes} from code that is not here became inert stand-ins ({shown}); none was run")
    return notes


def _summary(
    checkpoint: Checkpoint,
    selection: Selection,
    transformed: _Transformed,
    destination: PathLike | None,
    options: ConversionOptions,
) -> ConversionReport:
    """The report of a conversion that has written nothing yet (all a dry run returns)."""
    state, origins = transformed.state, transformed.origins
    transformed.notes.extend(_source_notes(checkpoint))
    if origins is not None and list(origins) == list(state):
        renames = tuple((origins[new], new) for new in state if origins[new] != new)
    elif len(state) == len(selection.weights):
        renames = tuple((old, new) for old, new in zip(selection.weights, state) if old != new)
    else:
        renames = ()
    to, max_shard_size = options.to, options.max_shard_size
    folder_output = destination is not None and is_folder_destination(destination, to, max_shard_size)
    kind = output_format(destination, to, folder=folder_output) if destination is not None else (to or "pt")
    return ConversionReport(
        source=checkpoint.path,
        destination="",
        source_format=checkpoint.format,
        format=kind,
        selected=selection.where,
        steps=tuple(transformed.reports),
        tensors=len(state),
        bytes=sum(ref.nbytes for ref in state.values()),
        foreign_globals=checkpoint.foreign_globals,
        saved_devices=checkpoint.saved_devices,
        notes=(
            *transformed.notes,
            *transformed.coverage,
            *planned_parts(list(state.items()), kind, options.part, max_shard_size),
        ),
        renames=renames[:1000],
    )


def _output_metadata(
    checkpoint: Checkpoint, selection: Selection, transformed: _Transformed, kind: str, options: ConversionOptions
) -> dict[str, MetadataValue]:
    """What travels with the weights: the source's own safetensors metadata, its plain data, the provenance."""
    metadata: dict[str, MetadataValue] = {}
    if checkpoint.format == "safetensors":
        dropped = {"format", *(DECLARATION_KEYS if transformed.dequantized else ())}
        metadata.update(
            {k: v for k, v in checkpoint.metadata.items() if not k.startswith("ckptconv.") and k not in dropped}
        )
    entries = checkpoint_metadata(checkpoint.tree, selection)
    if kind == "safetensors":
        metadata.update(encode_entries(entries, "checkpoint."))
        if transformed.quantization_config is not None:  # so that the file says how to read it back
            metadata["quantization_config"] = json.dumps(transformed.quantization_config)
    if options.provenance:
        fit_plan = list(transformed.fit_report.plan) if transformed.fit_report else []
        provenance = {
            "ckptconv.version": __version__,
            "ckptconv.source": _file_name(checkpoint.path),
            "ckptconv.selected": selection.where,  # "" for the whole file: then left out
            "ckptconv.transforms": json.dumps(options.transforms.describe() + fit_plan + transformed.coverage),
        }
        metadata.update({key: value for key, value in provenance.items() if value})
    return metadata


def _write(
    checkpoint: Checkpoint,
    selection: Selection,
    transformed: _Transformed,
    destination: PathLike,
    options: ConversionOptions,
    summary: ConversionReport,
    reference: str | None,
    progress: Progress,
    carried: model_files.ModelFiles | None = None,
    lock: OutputLock | None = None,
) -> ConversionReport:
    """Write the transformed weights (checking CRC-32s, hashing, verifying beside the write) and the model files a
    model folder carries (refused first when they exist): one transaction (:mod:`ckptconv.writing.transaction`)."""
    state, notes, kind = transformed.state, list(summary.notes), summary.format
    pipeline, fit_to, dequantization = options.transforms, options.fit_to, transformed.dequantization
    metadata = _output_metadata(checkpoint, selection, transformed, kind, options)
    if carried is not None and carried.files:
        inputs = write_policy.Inputs(checkpoint.files or (checkpoint.path,))
        model_files.check(carried, os.path.abspath(as_path(destination)), overwrite=options.overwrite, inputs=inputs)
    extra = None
    if kind == "pt" and options.keep_meta:
        unreadable: dict[str, str] = {}
        extra = checkpoint_metadata(checkpoint.tree, selection, exact=True, unreadable=unreadable)
        notes.extend(f"--keep-meta left out {name!r} ({why})" for name, why in unreadable.items())

    def transform_again(weights: dict[str, TensorRef]) -> Mapping[str, TensorRef]:
        """The same steps, on the weights an independent reader gives."""
        if dequantization is not None:
            weights = dequantization.apply(dataclasses.replace(selection, weights=weights)).weights
        result, _ = pipeline.apply(weights)
        if fit_to is not None:
            from ckptconv.fitting import fit

            result, _ = fit(result, fit_to)
        return cast_like(result, transformed.like) if transformed.like is not None else result

    def check(written: str) -> None:
        from ckptconv.checking.verification import compare, compare_with_reference

        if crcs is not None:
            crcs.result()  # the source's records are what the archive recorded, or nothing appears
        if read_whole:
            check_record_crcs(read_whole, computed=record_crcs)  # reads only a record the write did not
        if reference is None:
            return
        if reference == "torch":
            result = compare_with_reference(checkpoint, selection, open_checkpoint(written), transform=transform_again)
            read_by.append(result.readers)
        else:
            result = compare(state, open_checkpoint(written).select().weights)
        if not result.ok:
            raise VerifyError(f"{result.summary()}; the output was not written")

    # Who read each side under --verify=torch, per file written: torch or safetensors, or ckptconv's reader
    # where they cannot (torch 2.4 reads no uint16 .pt, --keep-meta sets, float8_e8m0fnu ...).
    read_by: list[tuple[str, str]] = []
    give_up = threading.Event()
    digest: concurrent.futures.Future[str] | None = None
    crcs: concurrent.futures.Future[Any] | None = None
    # Records that the write reads whole (a copy or a cast): their CRC-32s come from that read (record_crcs).
    record_crcs: dict[Storage, int] = {}
    read_whole: list[tuple[str, TensorRef]] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as hasher:
        if options.check_crc:
            # The other records' CRC-32s are checked on a thread of their own, not from the sha256's read:
            # interleaved with ISA-L's CRC on one thread, OpenSSL's sha256 ran 0.2 s/GiB slower
            # (1 GiB defaults: 1.07 against 0.90 s on the development VM).
            others: list[tuple[str, TensorRef]] = []
            for item in state.items():
                (read_whole if reads_whole_record(item[1]) else others).append(item)
            crcs = hasher.submit(_cores.in_background(check_record_crcs), others, stop=give_up)
        if options.source_hash and options.provenance:
            digest = hasher.submit(_cores.in_background(source_sha256), checkpoint.path, stop=give_up)
            metadata["ckptconv.source_sha256"] = Deferred(64, digest.result)
        try:
            written = write_state(
                state,
                destination,
                to=kind,
                overwrite=options.overwrite,
                metadata=metadata,
                extra=extra,
                max_shard_size=options.max_shard_size,
                progress=progress,
                inputs=checkpoint.files,
                check=check if (reference is not None or crcs is not None) else None,
                fsync=options.fsync,
                tied=options.tied,
                record_crcs=record_crcs if read_whole else None,
                carried=carried,
                lock=lock,
                output_part=options.part,
            )
        except BaseException:
            give_up.set()  # do not make a failed conversion wait for the hash
            raise
    if carried is not None and carried.files:
        notes.extend(carried.notes)
    notes.extend(written.notes)  # files an --overwrite kept
    if written.aliases:
        notes.append(tied_note(written.aliases, written.path, len(written.files) > 1))
    from ckptconv.checking.reference import CKPTCONV_READER

    fallback = next((pair for pair in read_by if any(r.startswith(CKPTCONV_READER) for r in pair)), None)
    if fallback is not None:
        notes.append(f"--verify=torch read the source with {fallback[0]}, the output with {fallback[1]}")
    return dataclasses.replace(
        summary,
        destination=written.path,
        format=written.format,
        tensors=written.tensors,
        bytes=written.bytes,
        aliases=written.aliases,
        files=written.files,
        notes=tuple(notes),
        verified=True if reference is not None and not written.pending else None,  # --part: the last part checks
        verified_with="ckptconv" if fallback is not None else reference or "",
        source_sha256=digest.result() if digest is not None else None,
    )
