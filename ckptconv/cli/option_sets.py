"""Option sets: the options fields' flags come from :mod:`ckptconv.options`; the rest are shared here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, TypeVar

import click

from ckptconv.cli.params import CastTarget, Prefix, Regex, RenameRule, Size

F = TypeVar("F", bound=Callable[..., Any])


def compose(*decorators: Callable[[F], F]) -> Callable[[F], F]:
    def apply(function: F) -> F:
        for decorator in reversed(decorators):
            function = decorator(function)
        return function

    return apply


def field_options(group: str, command: str) -> Callable[[F], F]:
    """The click options of the :class:`~ckptconv.options.ConversionOptions` fields in ``group`` that
    ``command`` offers, made from the fields' :class:`~ckptconv.options.Flag` metadata. The click
    parameter takes the field's name, so the values go straight into the options object."""
    from ckptconv.checking.verification import REFERENCES
    from ckptconv.options import BATCH_FORMATS, OUTPUT_FORMATS, flags

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
                "size": Size(),
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
    return compose(*decorators)


def conversion_options(options: dict[str, Any], leading: Sequence[Any] = (), fit_to: Any = None) -> Any:
    """The :class:`~ckptconv.options.ConversionOptions` a command's flags ask for."""
    from ckptconv.options import ConversionOptions, flags

    values = {name: options[name] for name, _ in flags() if options.get(name) is not None}  # None: not given
    return ConversionOptions(transforms=pipeline(leading, options), fit_to=fit_to, **values)


transform_options = compose(
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
        type=Prefix(),
        help="Remove this leading prefix (whole components) from every key that has it. Repeatable.",
    ),
    click.option(
        "--rename",
        "renames",
        multiple=True,
        type=RenameRule(),
        help="Rewrite keys with re.sub(REGEX, REPL, key). Repeatable; applied in order.",
    ),
    click.option(
        "--add-prefix",
        "add_prefixes",
        multiple=True,
        type=Prefix(),
        help="Put this prefix in front of every key. Repeatable.",
    ),
    click.option(
        "--keep",
        "keeps",
        multiple=True,
        type=Regex(),
        help="Keep only keys matching REGEX (after renaming). Repeatable: a key any of them matches is kept.",
    ),
    click.option(
        "--drop", "drops", multiple=True, type=Regex(), help="Drop keys matching REGEX (after renaming). Repeatable."
    ),
    click.option(
        "--dtype", type=CastTarget(), help="Cast floating-point tensors; integer and bool tensors keep their dtype."
    ),
    click.option(
        "--keep-dtype",
        "keep_dtypes",
        multiple=True,
        type=Regex(),
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
    return compose(
        click.option("--dry-run", is_flag=True, help=dry_run),
        click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors."),
    )


batch_options = compose(
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
    return compose(
        click.argument("src", type=click.Path(dir_okay=True)),
        click.argument("dst", type=click.Path(dir_okay=True)),
        field_options("selection", command),
        transform_options,
        field_options("output", command),
        run_options(command),
    )


def pipeline(leading: Sequence[Any], options: dict[str, Any]) -> Any:
    from ckptconv.transforms.keys import AddPrefix, Canonicalize, Cast, Drop, Keep, Pipeline, Rename, StripPrefix

    steps: list[Any] = [Canonicalize()] if options["canonical"] else []
    steps += list(leading)
    steps += [StripPrefix(prefix) for prefix in options["strip_prefixes"]]
    steps += [Rename(pattern, replacement) for pattern, replacement in options["renames"]]
    steps += [AddPrefix(prefix) for prefix in options["add_prefixes"]]
    if options["keeps"]:
        steps.append(Keep(tuple(options["keeps"])) if len(options["keeps"]) > 1 else Keep(options["keeps"][0]))
    steps += [Drop(pattern) for pattern in options["drops"]]
    if options["dtype"]:
        steps.append(Cast(options["dtype"], tuple(options["keep_dtypes"]), options["allow_overflow"]))
    elif options["keep_dtypes"] or options["allow_overflow"]:
        raise click.UsageError("--keep-dtype and --allow-overflow need --dtype")
    return Pipeline.of(steps)
