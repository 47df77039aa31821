"""The commands that write: convert, strip-module, add-module, fit and batch."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import click

from ckptconv._text import human_bytes, plural
from ckptconv.cli.failures import Command, interrupted_code, signal_name
from ckptconv.cli.option_sets import conversion_arguments, conversion_options, sections
from ckptconv.cli.terminal import echo, say, shortened

if TYPE_CHECKING:
    from ckptconv.batching.report import BatchReport


def run_conversion(
    src: str,
    dst: str,
    leading: Sequence[Any],
    options: dict[str, Any],
    fit_to: str | None = None,
    run: Callable[..., Any] | None = None,
) -> None:
    """Convert ``src`` to ``dst`` as the flags say, and print the report (``run``: the library call, when not
    :func:`ckptconv.convert`; it takes convert's arguments)."""
    from ckptconv.conversion import convert

    quiet = options["quiet"]
    conversion = conversion_options(options, leading, fit_to)
    if fit_to is None and os.path.lexists(dst):
        refuse_swapped(src, dst, conversion)
    report = (run or convert)(
        src,
        dst,
        options=conversion,
        dry_run=options["dry_run"],
        progress=not quiet and sys.stderr.isatty(),
    )
    for note in report.notes:  # the steps' notes among them, as the library and batch's manifest have them
        say(quiet, f"note: {note}")
    for step in report.steps:
        counts = ([f"{step.changed} changed"] if step.changed or not step.dropped else []) + (
            [f"{step.dropped} dropped"] if step.dropped else []
        )
        say(quiet, f"{step.step}: {', '.join(counts)}, {step.unchanged} unchanged")
    if options["dry_run"]:
        for old, new in report.renames[:20]:
            echo(f"{old} -> {new}")
        if len(report.renames) > 20:
            echo(f"... and {len(report.renames) - 20} more")
        say(
            quiet,
            f"dry run: would write {plural(report.tensors, 'tensor')} ({human_bytes(report.bytes)}) "
            f"as {report.format}; nothing was written",
        )
        return
    verified = ""
    if report.verified:
        verified = ", verified bit for bit" + (" by torch" if report.verified_with == "torch" else "")
    written = report.destination
    if len(report.files) > 1:  # a folder: its files, by name
        names = [os.path.basename(file) for file in report.files]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        written = f"{dst if dst.endswith(('/', os.sep)) else report.destination}: {shown}"
    say(
        quiet,
        f"wrote {written} ({report.format}, {plural(report.tensors, 'tensor')}, {human_bytes(report.bytes)}{verified})",
    )


def _renamed(keys: Sequence[str], steps: Sequence[Any]) -> int:
    """How many of ``keys`` the key steps (not the casts) rename, run on the names alone."""
    names: dict[str, Any] = {key: key for key in keys}
    for step in steps:
        names, _ = step.apply(names)
    return sum(new != old for new, old in names.items())


def refuse_swapped(src: str, dst: str, conversion: Any) -> None:
    """A usage error when SRC and DST look swapped: the key steps rename nothing in SRC but something in DST,
    an existing checkpoint. Following "pass --overwrite" would replace the original with a copy of the output."""
    from ckptconv.errors import CkptconvError
    from ckptconv.loading import open as open_checkpoint
    from ckptconv.transforms.keys import Cast

    steps = [step for step in conversion.transforms.steps if not isinstance(step, Cast)]
    if not steps:
        return
    try:
        source_keys = list(open_checkpoint(src, trust=conversion.trust).select(conversion.select).weights)
        existing_keys = list(open_checkpoint(dst).select(conversion.select).weights)
        in_source, in_existing = _renamed(source_keys, steps), _renamed(existing_keys, steps)
    except (CkptconvError, OSError):  # DST is no checkpoint (or SRC is not readable: convert says why)
        return
    if in_source == 0 and in_existing:
        described = "; ".join(step.describe() for step in steps)
        command = click.get_current_context().info_name
        raise click.UsageError(
            f"the arguments look swapped: {described} changes no key of {src!r} and {plural(in_existing, 'key')} "
            f"of {dst!r}, which exists; the source comes first: ckptconv {command} {dst} {src}"
        )


@click.command(cls=Command)
@conversion_arguments(
    "convert",
    {
        "Reference": [
            click.option(
                "--like",
                "reference",
                default=None,
                metavar="MODEL_DIR",
                help="Fit the keys to a model folder (or any REF `ckptconv fit` takes) and, for a model folder, carry "
                "its config and tokenizer files, take its dtypes (unless --dtype) and shard like it.",
            )
        ]
    },
)
def convert(src: str, dst: str, reference: str | None, **options: Any) -> None:
    """Convert a checkpoint to .pt, safetensors, a sharded folder or DCP, with optional transforms.

    The weights are found inside training checkpoints automatically (see
    --select). Transforms apply in this order: --canonical, --strip-prefix,
    --rename, --add-prefix, --keep, --drop, --dtype; --keep, --drop and
    --keep-dtype match the output key names. A model folder (config.json
    beside the weights) converts to a model folder when DST is a folder.

    \b
    Example:
      ckptconv convert train_ckpt.pth weights.safetensors
      ckptconv convert model.safetensors model.pt --dtype bf16 --keep-dtype norm
      ckptconv convert hf_model/ hf_model_bf16/ --dtype bf16
      ckptconv convert last.ckpt finetuned/ --like base_model/
    """
    run_conversion(src, dst, [], options, fit_to=reference)


@click.command("strip-module", cls=Command)
@conversion_arguments("strip-module")
def strip_module(src: str, dst: str, **options: Any) -> None:
    """Remove the 'module.' prefix DataParallel and DDP add to every key.

    Only a leading 'module.' component is removed, once, also where it follows
    torch.compile's '_orig_mod.' or Lightning's '_forward_module.' (a note then
    points to --canonical for the wrapper left); keys without it are left
    unchanged and counted ('modules.0' and 'module_list' are never cut).

    \b
    Example:
      ckptconv strip-module dp_model.pkl model.pt
    """
    from ckptconv.transforms.keys import StripPrefix

    run_conversion(src, dst, [StripPrefix("module", under_wrappers=True)], options)


@click.command("add-module", cls=Command)
@conversion_arguments("add-module")
def add_module(src: str, dst: str, **options: Any) -> None:
    """Add the 'module.' prefix, to load into a DataParallel or DDP model.

    \b
    Example:
      ckptconv add-module model.pt dp_model.pt
    """
    from ckptconv.transforms.keys import AddPrefix

    run_conversion(src, dst, [AddPrefix("module")], options)


@click.command(cls=Command)
@conversion_arguments(
    "fit",
    {
        "Reference": [
            click.option(
                "--like",
                "reference",
                required=True,
                metavar="REF",
                help="What the keys must match: a model folder (whose config and tokenizer files are carried, whose "
                "dtypes are taken unless --dtype, and whose sharding is followed), another checkpoint, a text file of "
                "key names, or "
                "'package.module:factory' that builds your nn.Module, or 'package.module:factory(key=value, ...)' "
                "with literal values (this imports your code, found as python -m "
                "would: the current folder first, then installed packages; it needs torch).",
            )
        ]
    },
)
def fit(src: str, dst: str, reference: str, **options: Any) -> None:
    """Rename a checkpoint's keys to match a reference model, then write it.

    Tries removing wrapper prefixes (DataParallel, DDP, compile, FSDP, Lightning),
    stripping a common leading prefix (model., backbone.) and adding the
    reference's own wrappers, and writes the result only if the keys and shapes
    then match exactly; otherwise it prints what is missing, unexpected or of
    the wrong shape and exits 3. Other transform options apply first.

    \b
    Example:
      ckptconv fit lightning.ckpt model.safetensors --like mypkg.models:build_model
      ckptconv fit dp_model.pkl model.pt --like reference.safetensors
      ckptconv fit last.ckpt finetuned/ --like base_model/
    """
    from ckptconv.errors import CkptconvError
    from ckptconv.loading import open as open_checkpoint
    from ckptconv.transforms.keys import Canonicalize, averaging_counters

    leading: list[Any] = []
    if not options["canonical"]:
        try:
            keys = open_checkpoint(src, trust=options["trust"]).select(options["select"]).weights
        except (CkptconvError, OSError):
            keys = {}  # convert says why
        if averaging_counters(keys):  # an AveragedModel (SWA/EMA): its counter set aside, its 'module.' removed
            leading.append(Canonicalize())
    run_conversion(src, dst, leading, options, fit_to=reference)


@click.command(cls=Command)
@click.argument("src", type=click.Path(file_okay=False))
@click.argument("dst", type=click.Path(file_okay=False), required=False)
@sections("batch")
def batch(src: str, dst: str | None, **options: Any) -> None:
    """Convert every checkpoint under a folder, in parallel, with a manifest.

    Checkpoints are found by content and name, recursively; a sharded
    checkpoint (an index and its shards) or a DCP folder counts as one item.
    Outputs mirror the tree under DST with the suffix of --to (safetensors
    unless --to pt): SRC/a/model.pth becomes DST/a/model.safetensors. A model
    folder (config.json beside the weights, a training run's checkpoint-N)
    becomes a model folder, as convert makes it: SRC/hf/pytorch_model.bin
    gives DST/hf/model.safetensors, its config and tokenizer files. When two
    inputs would share an output (x.pt and x.pth), both keep their full name
    (x.pt.safetensors, x.pth.safetensors). The transform options work as for
    convert. Failed items never stop the batch (unless --fail-fast); they are
    listed at the end, and the exit code is 3, or 4 when an item is unsafe (it
    names code-running callables, as scan says: never converted). --json prints
    the report on stdout. Every finished item is recorded
    at once in DST/ckptconv-manifest.jsonl, so --resume can carry on after an
    interruption. --shard INDEX/COUNT splits the items among COUNT processes
    (Slurm array tasks, torchrun ranks: --shard auto) writing into one DST at
    once, each with its own manifest; batch --report DST merges them.

    \b
    Example:
      ckptconv batch zoo/ out/ --to safetensors --dtype bf16 --jobs 4
      ckptconv batch zoo/ out/ --glob '**/*.pth' --resume
      ckptconv batch zoo/ out/ --executor dask --scheduler tcp://host:8786
      ckptconv batch zoo/ out/ --shard auto --resume   # in each task of a Slurm array
      ckptconv batch --report out/
    """
    from ckptconv.batching.flow import batch as run_batch

    quiet = options["quiet"]
    if options["report"]:
        if dst is not None or options["shard"] is not None:
            raise click.UsageError("batch --report takes only DST, the output folder: ckptconv batch --report DST")
        _report_batch(src, options)
        return
    if dst is None:
        raise click.UsageError("Missing argument 'DST'.")
    if options["scheduler"] and options["executor"] != "dask":
        raise click.UsageError("--scheduler needs --executor dask")
    if options["scheduler"] and not options["dry_run"]:
        say(
            quiet,
            f"connecting to the Dask scheduler at {options['scheduler']} (waiting up to "
            f"{options['scheduler_timeout']:g} s for a worker; --scheduler-timeout)",
        )
    try:
        report = run_batch(
            src,
            dst,
            options=conversion_options(options),
            glob=options["globs"],
            jobs=options["jobs"],
            executor=options["executor"],
            scheduler=options["scheduler"],
            scheduler_timeout=options["scheduler_timeout"],
            resume=options["resume"],
            fail_fast=options["fail_fast"],
            dry_run=options["dry_run"],
            progress=not quiet and sys.stderr.isatty(),
            shard=options["shard"],
        )
    except KeyboardInterrupt as interrupt:
        if os.environ.get("CKPTCONV_DEBUG"):
            raise
        # Not the generic message: finished items are recorded, and --resume carries on.
        echo(
            f"ckptconv: interrupted{signal_name(interrupt)}; finished items are recorded in the manifest "
            f"under {dst!r}; run again with --resume to carry on",
            err=True,
        )
        click.get_current_context().exit(interrupted_code(interrupt))
    if options["as_json"]:  # data on stdout; the messages below stay on stderr
        _print_json(report)
    for note in report.notes:
        say(quiet, f"note: {note}")
    if not report.results:
        say(quiet, f"found no checkpoints under {src!r}" + (" matching --glob" if options["globs"] else ""))
        return
    if report.dry_run and not options["as_json"]:
        for plan in report.shards:  # the whole split, then this shard's items
            this = " (this one)" if plan.shard == report.shard else ""
            echo(f"shard {plan.shard}{this}: {plural(len(plan.items), 'item')}, {human_bytes(plan.bytes)}")
            for name in plan.items:
                echo(f"  {name}")
        for result in report.results:
            if result.status == "planned":
                echo(f"{result.source} -> {result.output}")
            elif result.status == "skipped":
                echo(f"{result.source}: converted already, skipped")
            else:
                echo(f"{result.source}: cannot convert: {shortened(result.error)}")
    training_state = [result.source for result in report.skipped if result.error_type == "TrainingStateError"]
    if training_state and not report.dry_run:
        more = len(training_state) - 6
        shown_files = ", ".join(training_state[:6]) + (f" and {more} more" if more > 0 else "")
        say(quiet, f"skipped {plural(len(training_state), 'file')} of training state, not model weights: {shown_files}")
    _say_item_hints(report, quiet)
    _summarize(report, quiet)


def _summarize(report: BatchReport, quiet: bool) -> None:
    """The end of a batch's output, and its exit code: failures, the summary line."""
    for result in report.unsafe:  # errors: shown even with -q
        echo(f"unsafe: {result.source}: {shortened(result.error)}", err=True)
    for result in report.failed:
        echo(f"failed: {result.source}: {shortened(result.error)}", err=True)
    for problem in report.problems:
        echo(f"unfinished: {problem}", err=True)
    if report.cancelled and not report.problems:
        not_started = f"{plural(len(report.cancelled), 'item')} {'was' if len(report.cancelled) == 1 else 'were'}"
        say(quiet, f"stopped after the first failure (--fail-fast); {not_started} not started")
    shard = f" (shard {report.shard})" if report.shard is not None else ""
    manifest = f"; manifest: {report.manifest}" if report.manifest else "; nothing was written"
    say(quiet, report.summary() + shard + manifest)
    click.get_current_context().exit(report.exit_code)


def _print_json(report: BatchReport) -> None:
    """batch --json: the report on stdout."""
    import json

    click.echo(json.dumps(report.to_json(), indent=2))


def _report_batch(dst: str, options: dict[str, Any]) -> None:
    """batch --report DST: the shards' manifests merged into one summary and exit code."""
    from ckptconv.batching.merging import merged_report

    report = merged_report(dst)
    if options["as_json"]:
        _print_json(report)
    _summarize(report, options["quiet"])


# The notes of a converted item that ask something of the user, shown by batch as convert shows them: a wrapper
# left on every key (and the flag that removes it), the training state a model folder's conversion left out.
_ITEM_HINTS = ("left out the training state",)
_MAX_HINTS = 10


def _say_item_hints(report: BatchReport, quiet: bool) -> None:
    from ckptconv.transforms.keys import WRAPPER_NOTE

    hints = [
        f"note: {result.source}: {note}"
        for result in report.converted
        for note in result.notes
        if note.startswith((WRAPPER_NOTE, *_ITEM_HINTS))
    ]
    for line in hints[:_MAX_HINTS]:
        say(quiet, line)
    if len(hints) > _MAX_HINTS:
        say(quiet, f"note: and {len(hints) - _MAX_HINTS} more such notes; the manifest has every item's notes")
