"""The commands that only read: verify, diff, inspect and scan."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

import click
import cloup

from ckptconv._text import human_bytes, plural, shown
from ckptconv.batching.report import EXIT_NEGATIVE, EXIT_UNSAFE
from ckptconv.cli.failures import Command
from ckptconv.cli.option_sets import SAFETY, SELECTION, TRANSFORMS, field_options, pipeline, sections, transforms_of
from ckptconv.cli.terminal import echo, printable, shortened

if TYPE_CHECKING:
    from ckptconv.checking.inspection import ModelInfo


@click.command(cls=Command)
@click.argument("src", type=click.Path(dir_okay=True))
@click.argument("dst", type=click.Path(dir_okay=True))
@sections(
    "verify",
    {
        SAFETY: [
            click.option(
                "--reference",
                type=click.Choice(["ckptconv", "torch"]),
                default="ckptconv",
                show_default=True,
                help="Who reads the tensors: ckptconv's readers, or torch.load(weights_only=True) and the "
                "safetensors library (where they can read the file; the result line says who read what).",
            )
        ]
    },
)
def verify(src: str, dst: str, select: str | None, trust: bool, reference: str, **options: Any) -> None:
    """Prove DST holds SRC's weights after the given transforms, bit for bit.

    Pass the transform options the conversion used. Compares keys, dtypes,
    shapes and every byte (after the cast, if one was applied). Exits 0 when
    they match and 3 when they do not. With --reference torch, a bug in
    ckptconv's own readers cannot hide behind itself: use it to check a
    conversion independently, or when a file looks odd.

    \b
    Example:
      ckptconv verify dp_model.pkl model.pt --strip-prefix module
      ckptconv verify model.pt model_bf16.safetensors --dtype bf16
      ckptconv verify model.pt model.safetensors --reference torch
    """
    from ckptconv.checking.verification import prefix_difference
    from ckptconv.checking.verification import verify as verify_files

    transforms = pipeline([], options).steps
    result = verify_files(src, dst, select=select, transforms=transforms, trust=trust, reference=reference)
    summary = result.summary()
    found = prefix_difference(result.missing, result.unexpected)
    if found is not None:
        # Only a prefix apart: what matters is how the tensors compare once the flag is passed.
        what, flag, step = found
        again = verify_files(src, dst, select=select, transforms=[*transforms, step], trust=trust, reference=reference)
        if not (again.missing or again.unexpected):
            outcome = again.summary().removeprefix("verified: ").removeprefix("verification failed: ")
            summary = f"verification failed: the keys differ only by {what}; with {flag} {outcome}"
            result = again
    echo(summary)
    if summary.startswith("verification failed"):
        for key in result.missing[:20]:
            echo(f"  missing: {key}")
        for key in result.unexpected[:20]:
            echo(f"  unexpected: {key}")
        for key, reason in result.mismatched[:20]:
            echo(f"  differs: {key}: {reason}")
        sys.exit(EXIT_NEGATIVE)


@click.command(cls=Command)
@click.argument("a", type=click.Path(dir_okay=True))
@click.argument("b", type=click.Path(dir_okay=True))
@cloup.option_group(
    SELECTION,
    click.option("--select-a", metavar="PATH", help="Where the weights are in A (searched when omitted)."),
    click.option("--select-b", metavar="PATH", help="Where the weights are in B (searched when omitted)."),
    click.option("--trust", is_flag=True, help="DANGEROUS: unpickle with torch.load(weights_only=False)."),
)
@cloup.option_group(TRANSFORMS, transforms_of("diff"))
@cloup.option_group(
    "Output", click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout.")
)
def diff(
    a: str, b: str, select_a: str | None, select_b: str | None, trust: bool, as_json: bool, **options: Any
) -> None:
    """Compare the weights of two checkpoints.

    Lists keys only in A or only in B, dtype and shape mismatches, and the
    largest absolute difference of every tensor whose values differ. The
    transform options apply to A first, as convert applies them; when the keys
    differ only by a wrapper prefix, one line says so and names the flag. Exits
    0 when the weights are identical and 3 when they differ.

    \b
    Example:
      ckptconv diff epoch10.pt epoch11.pt
      ckptconv diff dp_model.pkl model.pt --strip-prefix module
      ckptconv diff model.pt model.safetensors --json
    """
    from ckptconv.checking.verification import diff as diff_files
    from ckptconv.checking.verification import prefix_difference

    transforms = pipeline([], options).steps
    result = diff_files(a, b, select_a=select_a, select_b=select_b, trust=trust, transforms=transforms)
    found = None if as_json else prefix_difference(result.only_in_a, result.only_in_b)
    if found is not None:
        what, flag, step = found
        again = diff_files(a, b, select_a=select_a, select_b=select_b, trust=trust, transforms=[*transforms, step])
        if not (again.only_in_a or again.only_in_b):
            echo(
                f"different only by {what}: with {flag}, {plural(again.same, 'tensor')} identical, "
                f"{len(again.differences)} differ"
            )
            sys.exit(EXIT_NEGATIVE)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        for key in result.only_in_a:
            echo(f"only in A: {key}")
        for key in result.only_in_b:
            echo(f"only in B: {key}")
        not_compared = "not compared as numbers (packed, opaque or quantized elements)"
        for item in result.differences:
            # Between integer tensors the difference is an exact int, printed whole (``:g`` would round it).
            exact = isinstance(item.max_abs_diff, int)
            largest = str(item.max_abs_diff) if exact else f"{item.max_abs_diff:g}"
            if item.reason == "values":
                amount = f"max abs difference {largest}" if item.compared else not_compared
                echo(f"values differ: {item.key}: {amount}")
            elif item.reason == "dtype":
                amount = f"max abs difference {largest} ({'compared exactly' if exact else 'compared in float64'})"
                echo(f"dtype differs: {item.key}: {item.a} vs {item.b}; {amount if item.compared else not_compared}")
            else:
                echo(f"{item.reason} differs: {item.key}: {item.a} vs {item.b}")
        verdict = "identical" if result.identical else "different"
        echo(
            f"{verdict}: {plural(result.same, 'tensor')} identical, {len(result.differences)} differ, "
            f"{len(result.only_in_a)} only in A, {len(result.only_in_b)} only in B"
        )
    if not result.identical:
        sys.exit(EXIT_NEGATIVE)


def print_devices(as_json: bool) -> None:
    from ckptconv.gpu.devices import visible_devices

    devices = visible_devices()
    if as_json:
        click.echo(json.dumps([vars(device) for device in devices], indent=2))
        return
    if not devices:
        echo("no GPU is visible to this process (torch.cuda.is_available() is False); loads go to the CPU")
        return
    for device in devices:
        echo(
            f"{device.name}  physical {device.physical}  {device.model}  "
            f"{human_bytes(device.free_bytes)} free of {human_bytes(device.total_bytes)}"
            + (f"  pci {device.pci_bus_id}" if device.pci_bus_id else "")
        )


@click.command(cls=Command)
@click.argument("src", type=click.Path(dir_okay=True), required=False)
@field_options("selection", "inspect")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout.")
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=None,
    help="Show at most this many tensors in the table (default: all).",
)
@click.option(
    "--devices",
    "show_devices",
    is_flag=True,
    help="List the GPUs this process sees (logical and physical numbers, free memory) instead.",
)
def inspect(
    src: str | None, select: str | None, trust: bool, as_json: bool, limit: int | None, show_devices: bool
) -> None:
    """Describe a checkpoint without reading its tensor data.

    Shows the format, the devices it was saved on, classes that became
    stand-ins, its top-level contents, where the weights are, and every tensor.
    With --devices, lists the GPUs a load could target instead (cuda:N is
    torch's logical number; "physical" is the matching CUDA_VISIBLE_DEVICES entry).

    \b
    Example:
      ckptconv inspect train_ckpt.pth
      ckptconv inspect train_ckpt.pth --json | jq .selected
      ckptconv inspect --devices
    """
    from ckptconv.checking.inspection import inspect as inspect_checkpoint

    if show_devices:
        print_devices(as_json)
        return
    if src is None:
        raise click.UsageError("give a checkpoint to inspect, or --devices")

    info = inspect_checkpoint(src, select=select, trust=trust)
    if as_json:
        click.echo(json.dumps(info.to_dict(), indent=2))
        return
    # A format that records no device (safetensors) says nothing of one.
    devices = f", saved on {', '.join(info.saved_devices)}" if info.saved_devices else ""
    echo(f"{info.path}: {info.format}, {human_bytes(info.size)}{devices}")
    if info.model is not None:
        _echo_model(info.model)
    if info.foreign_globals:
        echo("stand-ins (classes from code that is not here; nothing was run):")
        for name, count in info.foreign_globals.items():
            echo(f"  {name}" + (f" ({plural(count, 'object')})" if count else ""))
    if info.metadata:
        echo("metadata:")
        for key, value in info.metadata.items():
            echo(f"  {key}: {value if len(value) <= 100 else value[:97] + '...'}")
    echo("contents:")
    width = min(max((len(shown(key)) for key, _ in info.outline), default=0), 40)
    for key, text in info.outline:
        echo(f"  {shown(key):<{width}}  {text}" if key else f"  {text}")
    if info.selection_error:
        echo(f"weights: not selected: {info.selection_error}")
        return
    where = repr(info.selected) if info.selected else "the whole file"
    dtypes = ", ".join(f"{name}: {count}" for name, count in info.dtypes.items())
    echo(
        f"weights: {where}: {plural(len(info.tensors), 'tensor')}, {info.parameters:,} elements, "
        f"{human_bytes(info.tensor_bytes)} ({dtypes})"
    )
    if info.selection_note:
        echo(f"note: {info.selection_note}")
    if info.quantization:
        echo(f"quantized: {info.quantization}")
    for note in info.notes:
        echo(f"note: {note}")
    if info.adapter:
        echo(f"adapter: {info.adapter}")
    listed = info.tensors if limit is None else info.tensors[:limit]
    if listed:
        key_width = min(max(len(shown(t.key)) for t in listed), 60)
        echo(f"  {'key':<{key_width}}  {'dtype':<9}  shape")
        for tensor in listed:
            extra = ""
            if tensor.shares_with:
                more = tensor.shares_count - len(tensor.shares_with[:3])
                extra = f"  shares storage with {', '.join(tensor.shares_with[:3])}" + (
                    f" and {more} more" if more else ""
                )
            elif tensor.is_view:
                extra = "  view"
            echo(f"  {shown(tensor.key):<{key_width}}  {tensor.dtype:<9}  {list(tensor.shape)}{extra}")
    if limit is not None and len(info.tensors) > limit:
        echo(f"  ... and {len(info.tensors) - limit} more")


def _echo_model(model: ModelInfo) -> None:
    """What model a folder is: its kind and architecture, then what its config and files say."""
    what = f" ({model.architecture})" if model.architecture else ""
    echo(f"model: {model.kind}{what}")
    lines = [
        ("ties", model.ties),
        ("experts", "" if model.experts is None else f"{model.experts} (as config.json says)"),
        ("quantization", model.quantization and f"{model.quantization} (as config.json says)"),
        ("training state beside it", ", ".join(model.training_state)),
        ("model folders in it", ", ".join(f"{part}/" for part in model.parts)),
        ("weights", model.layout),
    ]
    for name, text in lines:
        if text:
            echo(f"  {name}: {text}")


def _as_typed(path: str, given: tuple[str, ...]) -> str:
    """``path``, found under one of the folders the user gave, spelled from that folder as they typed it."""
    for folder in given:
        root = os.path.abspath(folder)
        if path.startswith(root + os.sep):
            return os.path.join(folder, path[len(root) + 1 :])
    return path


@click.command(cls=Command)
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout.")
@click.option("-q", "--quiet", is_flag=True, help="Print only the items that are not safe, and the summary.")
def scan(paths: tuple[str, ...], as_json: bool, quiet: bool) -> None:
    """Say which checkpoints are safe to load, without running anything from them.

    Every pickle opcode is interpreted by ckptconv itself, nothing is imported
    or called. Each item gets one verdict: safe (only tensors, containers and
    plain data), foreign (also names classes from code that is not here:
    torch.load(weights_only=False) would import and run that code), unsafe
    (names something that runs code, touches files, sockets or processes,
    imports, compiles or loads further pickles, or is built to be read
    differently by CPython than by a scanner), damaged, not-a-checkpoint or
    unreadable. Folders are searched as batch does (a sharded or DCP
    checkpoint is one item). Exits 0 when every item is safe, 3 when some are
    not but none is unsafe, 4 when one is unsafe.

    \b
    Example:
      ckptconv scan downloads/
      ckptconv scan model.bin other.pt --json | jq '.items[] | select(.verdict=="unsafe")'
    """
    from ckptconv.checking.scanning import SAFE, UNSAFE, scan_many

    summary = scan_many(paths)
    if as_json:
        click.echo(json.dumps(summary.to_dict(), indent=2))
    else:
        for report in summary.reports:
            if quiet and report.verdict == SAFE:
                continue
            click.echo(printable(f"{report.verdict:<16}  {_as_typed(report.path, paths)}: {shortened(report.reason)}"))
        click.echo(summary.summary(), err=True)
    worst = summary.worst
    if worst == UNSAFE:
        sys.exit(EXIT_UNSAFE)
    if worst != SAFE:
        sys.exit(EXIT_NEGATIVE)
