"""The ``ckptconv`` command: a thin layer over the library.

Each command parses its options, makes one library call, and prints the
report. Library errors become a one-line message and exit code 1 in one place
(:class:`_Group`); usage errors exit 2 through click. Set ``CKPTCONV_DEBUG=1``
to see tracebacks.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, Callable, ClassVar, TypeVar

import click

from ._text import plural
from ._text import shown as _shown
from ._version import __version__
from .report import EXIT_FAILED, EXIT_NEGATIVE, EXIT_UNSAFE, human_bytes

F = TypeVar("F", bound=Callable[..., Any])


_EXIT_CODES = """\b
Exit codes:
  0  success
  1  the operation failed (bad input, unsafe file, cannot write, ...)
  2  usage error (unknown option, invalid regular expression, ...)
  3  finished with a negative result (verify/diff found differences,
     fit found no plan, batch items failed, scan found files that are
     not safe: foreign, damaged, not a checkpoint)
  4  scan found at least one unsafe file"""


# ---------------------------------------------------------------------------------------
# Printing: names from files reach the terminal escaped
# ---------------------------------------------------------------------------------------


def _echo(message: str, *, err: bool = False) -> None:
    """One line on stdout (or stderr), escaped; ``--json`` output goes to click.echo unescaped (JSON escapes)."""
    click.echo(_shown(message), err=err)


# ---------------------------------------------------------------------------------------
# Error mapping: the one place library errors meet the terminal
# ---------------------------------------------------------------------------------------


class _Command(click.Command):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # `--verify` takes an optional value (`--verify=torch`); click would take the next
        # word (`--verify SRC DST`) as that value. Only a reference's name is one.
        from .verification import REFERENCES

        args = [
            "--verify=ckptconv" if arg == "--verify" and (i + 1 == len(args) or args[i + 1] not in REFERENCES) else arg
            for i, arg in enumerate(args)
        ]
        return super().parse_args(ctx, args)


class _Group(click.Group):
    command_class = _Command

    def invoke(self, ctx: click.Context) -> Any:
        from .errors import CkptconvError, DestinationError, FitError

        try:
            return super().invoke(ctx)
        except DestinationError as error:  # the options contradict DST: a usage error, exit 2
            if os.environ.get("CKPTCONV_DEBUG"):
                raise
            name = ctx.invoked_subcommand
            command = self.get_command(ctx, name) if name else None
            usage = click.Context(command, info_name=name, parent=ctx) if command else ctx
            raise click.UsageError(str(error), usage) from None
        except CkptconvError as error:
            if os.environ.get("CKPTCONV_DEBUG"):
                raise
            interrupt = _interruption(error)
            if interrupt is not None:
                # An error raised while Ctrl-C or SIGTERM unwound the work (a worker thread's read of a
                # file the unwinding had closed) is a consequence of the interruption, not the failure.
                _echo(f"ckptconv: interrupted{_signal_name(interrupt)}; no output was written", err=True)
                ctx.exit(_interrupted_code(interrupt))
            _echo(f"ckptconv: error: {error}", err=True)
            # A fit that cannot be made is a negative result with a report, not a failure.
            if isinstance(error, FitError) and error.report is not None:
                for line in error.report.details():
                    _echo(f"  {line}", err=True)
                ctx.exit(EXIT_NEGATIVE)
            ctx.exit(EXIT_FAILED)
        except KeyboardInterrupt as interrupt:
            if os.environ.get("CKPTCONV_DEBUG"):
                raise
            _echo(f"ckptconv: interrupted{_signal_name(interrupt)}; no output was written", err=True)
            ctx.exit(_interrupted_code(interrupt))


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that it unwinds like Ctrl-C: every partial output is removed."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def _interruption(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM that ``error`` was raised while handling, if any."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _signal_name(interrupt: BaseException) -> str:
    return " (SIGTERM)" if isinstance(interrupt, Terminated) else ""


def _interrupted_code(interrupt: BaseException) -> int:
    """128 + the signal's number, as shells report it: 130 for Ctrl-C, 143 for SIGTERM."""
    return 143 if isinstance(interrupt, Terminated) else 130


# ---------------------------------------------------------------------------------------
# Parameter types: bad usage exits 2 with a usage message
# ---------------------------------------------------------------------------------------


class _Regex(click.ParamType):  # type: ignore[type-arg]
    name = "REGEX"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            re.compile(value)
        except re.error as error:
            self.fail(f"{value!r} is not a valid regular expression: {error}", param, ctx)
        return str(value)


class _RenameRule(click.ParamType):  # type: ignore[type-arg]
    name = "REGEX=REPL"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str, str]:
        if isinstance(value, tuple):
            return value
        match = re.match(r"^((?:[^=\\]|\\.)*)=(.*)$", value, re.S)
        if not match or not match.group(1):
            self.fail(f"{value!r} is not REGEX=REPLACEMENT (e.g. '^backbone\\.=encoder.')", param, ctx)
        pattern, replacement = match.group(1).replace("\\=", "="), match.group(2)
        try:
            regex = re.compile(pattern)
        except re.error as error:
            self.fail(f"{pattern!r} is not a valid regular expression: {error}", param, ctx)
        for group in re.findall(r"\\(\d+)|\\g<(\w+)>", replacement):
            number, name = group
            known = (
                int(number) <= regex.groups
                if number
                else (name.isdigit() and int(name) <= regex.groups) or name in regex.groupindex
            )
            if not known:
                self.fail(f"replacement {replacement!r} refers to a group {pattern!r} does not have", param, ctx)
        try:
            regex.sub(replacement, "")  # parses the template even where nothing matches: bad escapes such as \\x
        except (re.error, IndexError) as error:
            self.fail(f"replacement {replacement!r} is invalid: {error}", param, ctx)
        return pattern, replacement


class _CastTarget(click.ParamType):  # type: ignore[type-arg]
    name = "fp16|bf16|fp32"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from .dtypes import parse_cast_target

        try:
            return parse_cast_target(value).name
        except ValueError as error:
            self.fail(str(error), param, ctx)


class _Size(click.ParamType):  # type: ignore[type-arg]
    name = "SIZE"
    _UNITS: ClassVar[dict[str, int]] = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).upper() if match else ""
        if not match or unit not in self._UNITS:
            self.fail(f"{value!r} is not a size such as 5GB, 500MB or 2GiB", param, ctx)
        from fractions import Fraction

        size = Fraction(match.group(1)) * self._UNITS[unit]  # exact: 0.1GB is 100000000 bytes
        if size < 1 or size.denominator != 1:
            self.fail(f"{value!r} is not a whole number of bytes of at least 1 (e.g. 5GB, 500MB, 2GiB)", param, ctx)
        return int(size)


class _Prefix(click.ParamType):  # type: ignore[type-arg]
    name = "PREFIX"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        if not str(value).strip(". "):
            self.fail("a prefix must name at least one component, e.g. 'module'", param, ctx)
        return str(value)


# ---------------------------------------------------------------------------------------
# Option sets: the options fields' flags come from ckptconv.options; the rest are shared here
# ---------------------------------------------------------------------------------------


def _compose(*decorators: Callable[[F], F]) -> Callable[[F], F]:
    def apply(function: F) -> F:
        for decorator in reversed(decorators):
            function = decorator(function)
        return function

    return apply


def _field_options(group: str, command: str) -> Callable[[F], F]:
    """The click options of the :class:`~ckptconv.options.ConversionOptions` fields in ``group`` that
    ``command`` offers, made from the fields' :class:`~ckptconv.options.Flag` metadata. The click
    parameter takes the field's name, so the values go straight into the options object."""
    from .options import BATCH_FORMATS, OUTPUT_FORMATS, flags
    from .verification import REFERENCES

    decorators = []
    for name, flag in flags():
        if flag.group != group or command not in flag.commands:
            continue
        help_text = flag.batch_help if command == "batch" and flag.batch_help else flag.help
        if flag.kind == "flag":
            negated = flag.name.startswith("--no-")  # --no-fsync sets fsync to False
            option = click.option(
                flag.name, name, is_flag=True, flag_value=not negated, default=negated, help=help_text
            )
        elif flag.kind == "reference":  # --verify (ckptconv's readers) or --verify=torch
            option = click.option(
                flag.name, name, type=click.Choice(REFERENCES), is_flag=False, flag_value="ckptconv", help=help_text
            )
        else:
            kinds: dict[str, Any] = {
                "text": click.STRING,
                "size": _Size(),
                "format": click.Choice(BATCH_FORMATS if command == "batch" else OUTPUT_FORMATS),
            }
            if flag.kind == "choice":
                option = click.option(
                    flag.name,
                    name,
                    type=click.Choice(flag.choices),
                    default=flag.choices[0],
                    show_default=True,
                    help=help_text,
                )
            else:
                option = click.option(flag.name, name, type=kinds[flag.kind], metavar=flag.metavar, help=help_text)
        decorators.append(option)
    return _compose(*decorators)


def _conversion_options(options: dict[str, Any], leading: Sequence[Any] = (), fit_to: Any = None) -> Any:
    """The :class:`~ckptconv.options.ConversionOptions` a command's flags ask for."""
    from .options import ConversionOptions, flags

    values = {name: options[name] for name, _ in flags() if options.get(name) is not None}  # None: not given
    return ConversionOptions(transforms=_pipeline(leading, options), fit_to=fit_to, **values)


transform_options = _compose(
    click.option(
        "--canonical",
        is_flag=True,
        help="Remove every wrapper prefix, stacked in any order: "
        "module. (DataParallel/DDP), _orig_mod. (torch.compile), _forward_module. (Lightning), "
        "_fsdp_wrapped_module. / _checkpoint_wrapped_module. / _fpw_module. (FSDP, checkpointing).",
    ),
    click.option(
        "--strip-prefix",
        "strip_prefixes",
        multiple=True,
        type=_Prefix(),
        help="Remove this leading prefix (whole components) from every key that has it. Repeatable.",
    ),
    click.option(
        "--rename",
        "renames",
        multiple=True,
        type=_RenameRule(),
        help="Rewrite keys with re.sub(REGEX, REPL, key). Repeatable; applied in order.",
    ),
    click.option(
        "--add-prefix",
        "add_prefixes",
        multiple=True,
        type=_Prefix(),
        help="Put this prefix in front of every key. Repeatable.",
    ),
    click.option(
        "--keep",
        "keeps",
        multiple=True,
        type=_Regex(),
        help="Keep only keys matching REGEX (after renaming). Repeatable.",
    ),
    click.option(
        "--drop", "drops", multiple=True, type=_Regex(), help="Drop keys matching REGEX (after renaming). Repeatable."
    ),
    click.option(
        "--dtype", type=_CastTarget(), help="Cast floating-point tensors; integer and bool tensors keep their dtype."
    ),
    click.option(
        "--keep-dtype",
        "keep_dtypes",
        multiple=True,
        type=_Regex(),
        help="With --dtype: keys matching REGEX keep their dtype (e.g. 'norm'). Repeatable.",
    ),
    click.option(
        "--allow-overflow",
        is_flag=True,
        help="With --dtype fp16/bf16: let values beyond the range become inf instead of failing.",
    ),
)


def run_options(command: str) -> Callable[[F], F]:
    """Flags about this run, not about the output."""
    dry_run = (
        "List the items and where each output would go, and write nothing (not even the manifest)."
        if command == "batch"
        else "Show what would change (first 20 key renames) and write nothing."
    )
    return _compose(
        click.option("--dry-run", is_flag=True, help=dry_run),
        click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors."),
    )


batch_options = _compose(
    click.option(
        "-j",
        "--jobs",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Items converted at once, each in its own worker process (1: in this process).",
    ),
    click.option(
        "--glob",
        "globs",
        multiple=True,
        metavar="PATTERN",
        help="Only items whose path under SRC matches, e.g. '**/*.pth' ('**/' spans folders). Repeatable.",
    ),
    click.option(
        "--resume",
        is_flag=True,
        help="Skip items the manifest records as converted with the same "
        "options from an unchanged source; convert the rest again.",
    ),
    click.option("--fail-fast", is_flag=True, help="Stop starting items after the first failure."),
    click.option(
        "--executor",
        type=click.Choice(["local", "dask"]),
        default="local",
        show_default=True,
        help="Where items are converted: local processes, or a Dask cluster (pip install 'ckptconv[dask]').",
    ),
    click.option(
        "--scheduler",
        metavar="ADDRESS",
        help="With --executor dask: the scheduler, e.g. "
        "tcp://host:8786 (the workers must see SRC and DST at the same paths). Without it, a "
        "local cluster of --jobs processes is started.",
    ),
)


def conversion_arguments(command: str) -> Callable[[F], F]:
    """Everything a conversion command takes: SRC, DST, the options fields it offers, the transforms."""
    return _compose(
        click.argument("src", type=click.Path(dir_okay=True)),
        click.argument("dst", type=click.Path(dir_okay=True)),
        _field_options("selection", command),
        transform_options,
        _field_options("output", command),
        run_options(command),
    )


def _pipeline(leading: Sequence[Any], options: dict[str, Any]) -> Any:
    from .transforms import AddPrefix, Canonicalize, Cast, Drop, Keep, Pipeline, Rename, StripPrefix

    steps: list[Any] = [Canonicalize()] if options["canonical"] else []
    steps += list(leading)
    steps += [StripPrefix(prefix) for prefix in options["strip_prefixes"]]
    steps += [Rename(pattern, replacement) for pattern, replacement in options["renames"]]
    steps += [AddPrefix(prefix) for prefix in options["add_prefixes"]]
    steps += [Keep(pattern) for pattern in options["keeps"]]
    steps += [Drop(pattern) for pattern in options["drops"]]
    if options["dtype"]:
        steps.append(Cast(options["dtype"], tuple(options["keep_dtypes"]), options["allow_overflow"]))
    elif options["keep_dtypes"] or options["allow_overflow"]:
        raise click.UsageError("--keep-dtype and --allow-overflow need --dtype")
    return Pipeline.of(steps)


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        _echo(message, err=True)


def _run_conversion(
    src: str, dst: str, leading: Sequence[Any], options: dict[str, Any], fit_to: str | None = None
) -> None:
    from .conversion import convert

    quiet = options["quiet"]
    report = convert(
        src,
        dst,
        options=_conversion_options(options, leading, fit_to),
        dry_run=options["dry_run"],
        progress=not quiet and sys.stderr.isatty(),
    )
    for note in report.notes:
        _say(quiet, f"note: {note}")
    for step in report.steps:
        _say(quiet, f"{step.step}: {step.changed} changed, {step.unchanged} unchanged")
    if options["dry_run"]:
        for old, new in report.renames[:20]:
            _echo(f"{old} -> {new}")
        if len(report.renames) > 20:
            _echo(f"... and {len(report.renames) - 20} more")
        _say(
            quiet,
            f"dry run: would write {plural(report.tensors, 'tensor')} ({human_bytes(report.bytes)}) "
            f"as {report.format}; nothing was written",
        )
        return
    verified = ""
    if report.verified:
        verified = ", verified bit for bit" + (" by torch" if report.verified_with == "torch" else "")
    _say(
        quiet,
        f"wrote {report.destination} ({report.format}, {plural(report.tensors, 'tensor')}, "
        f"{human_bytes(report.bytes)}{verified})",
    )


# ---------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]}, epilog=_EXIT_CODES)
@click.version_option(__version__, "--version", prog_name="ckptconv")
def cli() -> None:
    """Open any PyTorch checkpoint safely on the CPU and convert it.

    Nothing in a checkpoint is ever executed: classes from code you do not
    have become inert stand-ins, and files that reach for code-running
    functions are refused. GPU-saved files load on any machine, and every
    output is CPU-tagged.
    """


@cli.command()
@conversion_arguments("convert")
def convert(src: str, dst: str, **options: Any) -> None:
    """Convert a checkpoint to .pt, safetensors, a sharded folder or DCP, with optional transforms.

    The weights are found inside training checkpoints automatically (see
    --select). Transforms apply in this order: --canonical, --strip-prefix,
    --rename, --add-prefix, --keep, --drop, --dtype; --keep, --drop and
    --keep-dtype match the output key names.

    \b
    Example:
      ckptconv convert train_ckpt.pth weights.safetensors
      ckptconv convert model.safetensors model.pt --dtype bf16 --keep-dtype norm
    """
    _run_conversion(src, dst, [], options)


@cli.command("strip-module")
@conversion_arguments("strip-module")
def strip_module(src: str, dst: str, **options: Any) -> None:
    """Remove the 'module.' prefix DataParallel and DDP add to every key.

    Only a leading 'module.' component is removed, once; keys without it are
    left unchanged and counted ('modules.0' and 'module_list' are never cut).

    \b
    Example:
      ckptconv strip-module dp_model.pkl model.pt
    """
    from .transforms import StripPrefix

    _run_conversion(src, dst, [StripPrefix("module")], options)


@cli.command("add-module")
@conversion_arguments("add-module")
def add_module(src: str, dst: str, **options: Any) -> None:
    """Add the 'module.' prefix, to load into a DataParallel or DDP model.

    \b
    Example:
      ckptconv add-module model.pt dp_model.pt
    """
    from .transforms import AddPrefix

    _run_conversion(src, dst, [AddPrefix("module")], options)


@cli.command()
@conversion_arguments("fit")
@click.option(
    "--like",
    "reference",
    required=True,
    metavar="REF",
    help="What the keys must match: another checkpoint, a text file of key names, or "
    "'package.module:factory' that builds your nn.Module (this imports your code, found as python -m "
    "would: the current folder first, then installed packages).",
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
    """
    _run_conversion(src, dst, [], options, fit_to=reference)


@cli.command()
@click.argument("src", type=click.Path(dir_okay=True))
@click.argument("dst", type=click.Path(dir_okay=True))
@_field_options("selection", "verify")
@transform_options
@click.option(
    "--reference",
    type=click.Choice(["ckptconv", "torch"]),
    default="ckptconv",
    show_default=True,
    help="Who reads the tensors: ckptconv's readers, or torch.load(weights_only=True) and the "
    "safetensors library (where they can read the file; the result line says who read what).",
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
    from .verification import verify as verify_files

    result = verify_files(src, dst, select=select, transforms=_pipeline([], options), trust=trust, reference=reference)
    _echo(result.summary())
    if not result.ok:
        for key in result.missing[:20]:
            _echo(f"  missing: {key}")
        for key in result.unexpected[:20]:
            _echo(f"  unexpected: {key}")
        for key, reason in result.mismatched[:20]:
            _echo(f"  differs: {key}: {reason}")
        sys.exit(EXIT_NEGATIVE)


@cli.command()
@click.argument("a", type=click.Path(dir_okay=True))
@click.argument("b", type=click.Path(dir_okay=True))
@click.option("--select-a", metavar="PATH", help="Where the weights are in A (searched when omitted).")
@click.option("--select-b", metavar="PATH", help="Where the weights are in B (searched when omitted).")
@click.option("--trust", is_flag=True, help="DANGEROUS: unpickle with torch.load(weights_only=False).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout.")
def diff(a: str, b: str, select_a: str | None, select_b: str | None, trust: bool, as_json: bool) -> None:
    """Compare the weights of two checkpoints.

    Lists keys only in A or only in B, dtype and shape mismatches, and the
    largest absolute difference of every tensor whose values differ. Exits 0
    when the weights are identical and 3 when they differ.

    \b
    Example:
      ckptconv diff epoch10.pt epoch11.pt
      ckptconv diff model.pt model.safetensors --json
    """
    from .verification import diff as diff_files

    result = diff_files(a, b, select_a=select_a, select_b=select_b, trust=trust)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        for key in result.only_in_a:
            _echo(f"only in A: {key}")
        for key in result.only_in_b:
            _echo(f"only in B: {key}")
        for item in result.differences:
            if item.reason == "values":
                _echo(f"values differ: {item.key}: max abs difference {item.max_abs_diff:g}")
            elif item.reason == "dtype":
                _echo(
                    f"dtype differs: {item.key}: {item.a} vs {item.b}; max abs difference {item.max_abs_diff:g} "
                    "(compared in float64)"
                )
            else:
                _echo(f"{item.reason} differs: {item.key}: {item.a} vs {item.b}")
        verdict = "identical" if result.identical else "different"
        _echo(
            f"{verdict}: {plural(result.same, 'tensor')} identical, {len(result.differences)} differ, "
            f"{len(result.only_in_a)} only in A, {len(result.only_in_b)} only in B"
        )
    if not result.identical:
        sys.exit(EXIT_NEGATIVE)


def _print_devices(as_json: bool) -> None:
    from .devices import visible_devices

    devices = visible_devices()
    if as_json:
        click.echo(json.dumps([vars(device) for device in devices], indent=2))
        return
    if not devices:
        _echo("no GPU is visible to this process (torch.cuda.is_available() is False); loads go to the CPU")
        return
    for device in devices:
        _echo(
            f"{device.name}  physical {device.physical}  {device.model}  "
            f"{human_bytes(device.free_bytes)} free of {human_bytes(device.total_bytes)}"
            + (f"  pci {device.pci_bus_id}" if device.pci_bus_id else "")
        )


@cli.command()
@click.argument("src", type=click.Path(dir_okay=True), required=False)
@_field_options("selection", "inspect")
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
    from .inspection import inspect as inspect_checkpoint

    if show_devices:
        _print_devices(as_json)
        return
    if src is None:
        raise click.UsageError("give a checkpoint to inspect, or --devices")

    info = inspect_checkpoint(src, select=select, trust=trust)
    if as_json:
        click.echo(json.dumps(info.to_dict(), indent=2))
        return
    devices = ", ".join(info.saved_devices) or "n/a"
    _echo(f"{info.path}: {info.format}, {human_bytes(info.size)}, saved on {devices}")
    if info.foreign_globals:
        _echo("stand-ins (classes from code that is not here; nothing was run):")
        for name, count in info.foreign_globals.items():
            _echo(f"  {name}" + (f" ({plural(count, 'object')})" if count else ""))
    if info.metadata:
        _echo("metadata:")
        for key, value in info.metadata.items():
            _echo(f"  {key}: {value if len(value) <= 100 else value[:97] + '...'}")
    _echo("contents:")
    width = min(max((len(_shown(key)) for key, _ in info.outline), default=0), 40)
    for key, text in info.outline:
        _echo(f"  {_shown(key):<{width}}  {text}" if key else f"  {text}")
    if info.selection_error:
        _echo(f"weights: not selected: {info.selection_error}")
        return
    where = repr(info.selected) if info.selected else "the whole file"
    dtypes = ", ".join(f"{name}: {count}" for name, count in info.dtypes.items())
    _echo(
        f"weights: {where}: {plural(len(info.tensors), 'tensor')}, {info.parameters:,} elements, "
        f"{human_bytes(info.tensor_bytes)} ({dtypes})"
    )
    if info.selection_note:
        _echo(f"note: {info.selection_note}")
    shown = info.tensors if limit is None else info.tensors[:limit]
    if shown:
        key_width = min(max(len(_shown(t.key)) for t in shown), 60)
        _echo(f"  {'key':<{key_width}}  {'dtype':<9}  shape")
        for tensor in shown:
            extra = ""
            if tensor.shares_with:
                extra = f"  shares storage with {', '.join(tensor.shares_with[:3])}"
            elif tensor.is_view:
                extra = "  view"
            _echo(f"  {_shown(tensor.key):<{key_width}}  {tensor.dtype:<9}  {list(tensor.shape)}{extra}")
    if limit is not None and len(info.tensors) > limit:
        _echo(f"  ... and {len(info.tensors) - limit} more")


def _printable(text: str) -> str:
    """``text`` with control and invisible characters escaped (names come from the file)."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


@cli.command()
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
    from .scanning import SAFE, UNSAFE, scan_many

    summary = scan_many(paths)
    if as_json:
        click.echo(json.dumps(summary.to_dict(), indent=2))
    else:
        for report in summary.reports:
            if quiet and report.verdict == SAFE:
                continue
            click.echo(_printable(f"{report.verdict:<16}  {report.path}: {report.reason}"))
        click.echo(summary.summary(), err=True)
    worst = summary.worst
    if worst == UNSAFE:
        sys.exit(EXIT_UNSAFE)
    if worst != SAFE:
        sys.exit(EXIT_NEGATIVE)


@cli.command()
@click.argument("src", type=click.Path(file_okay=False))
@click.argument("dst", type=click.Path(file_okay=False))
@_field_options("selection", "batch")
@transform_options
@_field_options("output", "batch")
@run_options("batch")
@batch_options
def batch(src: str, dst: str, **options: Any) -> None:
    """Convert every checkpoint under a folder, in parallel, with a manifest.

    Checkpoints are found by content and name, recursively; a sharded
    checkpoint (an index and its shards) or a DCP folder counts as one item.
    Outputs mirror the tree under DST with the suffix of --to (safetensors
    unless --to pt): SRC/a/model.pth becomes DST/a/model.safetensors. When two
    inputs would share an output (x.pt and x.pth), both keep their full name
    (x.pt.safetensors, x.pth.safetensors). The transform options work as for
    convert. Failed items never stop the batch (unless --fail-fast); they are
    listed at the end, and the exit code is 3. Every finished item is recorded
    at once in DST/ckptconv-manifest.jsonl, so --resume can carry on after an
    interruption.

    \b
    Example:
      ckptconv batch zoo/ out/ --to safetensors --dtype bf16 --jobs 4
      ckptconv batch zoo/ out/ --glob '**/*.pth' --resume
      ckptconv batch zoo/ out/ --executor dask --scheduler tcp://host:8786
    """
    from .batching import batch as run_batch

    quiet = options["quiet"]
    if options["scheduler"] and options["executor"] != "dask":
        raise click.UsageError("--scheduler needs --executor dask")
    try:
        report = run_batch(
            src,
            dst,
            options=_conversion_options(options),
            glob=options["globs"],
            jobs=options["jobs"],
            executor=options["executor"],
            scheduler=options["scheduler"],
            resume=options["resume"],
            fail_fast=options["fail_fast"],
            dry_run=options["dry_run"],
            progress=not quiet and sys.stderr.isatty(),
        )
    except KeyboardInterrupt as interrupt:
        if os.environ.get("CKPTCONV_DEBUG"):
            raise
        # Not the generic message: finished items are recorded, and --resume carries on.
        _echo(
            f"ckptconv: interrupted{_signal_name(interrupt)}; finished items are recorded in the manifest "
            f"under {dst!r}; run again with --resume to carry on",
            err=True,
        )
        click.get_current_context().exit(_interrupted_code(interrupt))
    for note in report.notes:
        _say(quiet, f"note: {note}")
    if not report.results:
        _say(quiet, f"found no checkpoints under {src!r}" + (" matching --glob" if options["globs"] else ""))
        return
    if report.dry_run:
        for result in report.results:
            if result.status == "planned":
                _echo(f"{result.source} -> {result.output}")
            elif result.status == "skipped":
                _echo(f"{result.source}: converted already, skipped")
            else:
                _echo(f"{result.source}: cannot convert: {result.error}")
    for result in report.failed:  # errors: shown even with -q
        _echo(f"failed: {result.source}: {result.error}", err=True)
    if report.cancelled:
        not_started = f"{plural(len(report.cancelled), 'item')} {'was' if len(report.cancelled) == 1 else 'were'}"
        _say(quiet, f"stopped after the first failure (--fail-fast); {not_started} not started")
    manifest = f"; manifest: {report.manifest}" if report.manifest else "; nothing was written"
    _say(quiet, report.summary() + manifest)
    click.get_current_context().exit(report.exit_code)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``ckptconv`` console script and ``python -m ckptconv``.

    SIGTERM (``kill``, a job scheduler's time limit) is handled like Ctrl-C:
    partial outputs are removed and the exit code is 143.
    """
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    cli.main(args=list(argv) if argv is not None else None, prog_name="ckptconv")
