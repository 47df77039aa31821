"""Option sets: the options fields' flags come from :mod:`ckptconv.options`; the rest are shared here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

import click

from ckptconv.batching.report import SCHEDULER_TIMEOUT_S
from ckptconv.cli.params import CastTarget, PartSpec, Prefix, Regex, RenameRule, ShardSpec, Size

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def compose(*decorators: Decorator) -> Decorator:
    def apply(function: Callable[..., Any]) -> Callable[..., Any]:
        for decorator in reversed(decorators):
            function = decorator(function)
        return function

    return apply


# The help's sections, in the order they are shown; each options field goes to one (new fields: by their group).
SELECTION, TRANSFORMS, OUTPUT, SAFETY, SPEED, RUN = "Selection", "Transforms", "Output", "Safety", "Speed", "Run"
_SECTION_OF_FIELD = {
    "select": SELECTION,
    "trust": SELECTION,
    "overwrite": SAFETY,
    "verify": SAFETY,
    "check_crc": SAFETY,
    "fsync": SPEED,
    "checksums": SPEED,
}
# Commands that write one file of a key transform: no DCP folder (convert --to dcp makes one).
_FILE_COMMANDS = ("batch", "strip-module", "add-module")


def field_options(group: str, command: str, section: str | None = None) -> Decorator:
    """The options of :func:`field_option_list`, as one decorator."""
    return compose(*field_option_list(group, command, section))


def field_option_list(group: str, command: str, section: str | None = None) -> list[Decorator]:
    """The click options of the :class:`~ckptconv.options.ConversionOptions` fields in ``group`` that
    ``command`` offers (only those of the help's ``section``, when given), made from the fields'
    :class:`~ckptconv.options.Flag` metadata. The click parameter takes the field's name, so the values
    go straight into the options object."""
    from ckptconv.options import BATCH_FORMATS, OUTPUT_FORMATS, REFERENCES, flags

    decorators: list[Decorator] = []
    for name, flag in flags():
        if flag.group != group or command not in flag.commands:
            continue
        if (
            section is not None
            and _SECTION_OF_FIELD.get(name, SELECTION if group == "selection" else OUTPUT) != section
        ):
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
                "part": PartSpec(),
                "format": click.Choice(BATCH_FORMATS if command in _FILE_COMMANDS else OUTPUT_FORMATS),
                "count": click.IntRange(min=1),
            }
            if flag.kind == "format" and command in _FILE_COMMANDS and command != "batch":
                help_text = help_text.split(" A folder DST")[0]  # no DCP folder here: convert --to dcp
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
    return decorators


def conversion_options(options: dict[str, Any], leading: Sequence[Any] = (), fit_to: Any = None) -> Any:
    """The :class:`~ckptconv.options.ConversionOptions` a command's flags ask for."""
    from ckptconv.options import ConversionOptions, flags

    values = {name: options[name] for name, _ in flags() if options.get(name) is not None}  # None: not given
    return ConversionOptions(transforms=pipeline(leading, options), fit_to=fit_to, **values)


def _named(flag: str, *args: Any, **kwargs: Any) -> tuple[str, Decorator]:
    return flag, click.option(flag, *args, **kwargs)


_TRANSFORM_OPTIONS = (
    _named(
        "--canonical",
        is_flag=True,
        help="Remove every wrapper prefix, stacked in any order: "
        "module. (DataParallel/DDP), _orig_mod. (torch.compile), _forward_module. (Lightning), "
        "_fsdp_wrapped_module. / _checkpoint_wrapped_module. / _fpw_module. (FSDP, checkpointing).",
    ),
    _named(
        "--strip-prefix",
        "strip_prefixes",
        multiple=True,
        type=Prefix(),
        help="Remove this leading prefix (whole components) from every key that has it. Repeatable.",
    ),
    _named(
        "--rename",
        "renames",
        multiple=True,
        type=RenameRule(),
        help="Rewrite keys with re.sub(REGEX, REPL, key). Repeatable; applied in order.",
    ),
    _named(
        "--add-prefix",
        "add_prefixes",
        multiple=True,
        type=Prefix(),
        help="Put this prefix in front of every key. Repeatable.",
    ),
    _named(
        "--keep",
        "keeps",
        multiple=True,
        type=Regex(),
        help="Keep only keys matching REGEX (after renaming). Repeatable: a key any of them matches is kept.",
    ),
    _named(
        "--drop", "drops", multiple=True, type=Regex(), help="Drop keys matching REGEX (after renaming). Repeatable."
    ),
    _named(
        "--dtype", type=CastTarget(), help="Cast floating-point tensors; integer and bool tensors keep their dtype."
    ),
    _named(
        "--keep-dtype",
        "keep_dtypes",
        multiple=True,
        type=Regex(),
        help="With --dtype: keys matching REGEX keep their dtype (e.g. 'norm'). Repeatable.",
    ),
    _named(
        "--allow-overflow",
        is_flag=True,
        help="With --dtype fp16/bf16: let values beyond the range become inf instead of failing.",
    ),
)
# What a command leaves out of the transforms: strip-module adds no prefix, add-module strips none.
_LEFT_OUT = {"strip-module": ("--add-prefix",), "add-module": ("--strip-prefix",)}


def transforms_of(command: str) -> Decorator:
    """The transform options ``command`` takes, in the order they apply."""
    left_out = _LEFT_OUT.get(command, ())
    return compose(*(option for flag, option in _TRANSFORM_OPTIONS if flag not in left_out))


transform_options = transforms_of("convert")


def run_options(command: str) -> Decorator:
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


_BATCH_OPTIONS = (
    _named(
        "-j",
        "--jobs",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Items converted at once, each in its own worker process (1: in this process).",
    ),
    _named(
        "--glob",
        "globs",
        multiple=True,
        metavar="PATTERN",
        help="Only items whose path under SRC matches, e.g. '**/*.pth' ('**/' spans folders). Repeatable.",
    ),
    _named(
        "--resume",
        is_flag=True,
        help="Skip items the manifest records as converted with the same "
        "options from an unchanged source; convert the rest again.",
    ),
    _named("--fail-fast", is_flag=True, help="Stop starting items after the first failure."),
    _named(
        "--executor",
        type=click.Choice(["local", "dask"]),
        default="local",
        show_default=True,
        help="Where items are converted: local processes, or a Dask cluster (pip install 'ckptconv[dask]').",
    ),
    _named(
        "--scheduler",
        metavar="ADDRESS",
        help="With --executor dask: the scheduler, e.g. "
        "tcp://host:8786 (the workers must see SRC and DST at the same paths). Without it, a "
        "local cluster of --jobs processes is started.",
    ),
    _named(
        "--scheduler-timeout",
        type=click.FloatRange(min=0, min_open=True),
        default=SCHEDULER_TIMEOUT_S,
        show_default=True,
        metavar="SECONDS",
        help="With --executor dask: how long to wait for the scheduler to answer and for a worker to join "
        "it before giving up.",
    ),
    _named(
        "--shard",
        type=ShardSpec(),
        help="Convert only shard INDEX of COUNT (0-based: 0/4 to 3/4), a size-balanced split every shard "
        "computes alike, so COUNT processes (on as many machines) can run into one DST at once; each keeps "
        "DST/ckptconv-manifest.shard-INDEX-of-COUNT.jsonl. 'auto' reads a Slurm array's "
        "SLURM_ARRAY_TASK_ID/_COUNT/_MIN or torchrun's RANK/WORLD_SIZE.",
    ),
    _named(
        "--report",
        is_flag=True,
        help="Convert nothing: merge the manifests in DST (given alone: batch --report DST) into one summary "
        "and exit code, naming shards not run or not finished.",
    ),
    _named(
        "--json",
        "as_json",
        is_flag=True,
        help="Print the report on stdout as one JSON object (counts, exit code, one manifest record per item).",
    ),
)


_BATCH_SECTIONS = {
    "--glob": SELECTION,
    "-j": SPEED,
    "--executor": SPEED,
    "--scheduler": SPEED,
    "--scheduler-timeout": SPEED,
    "--shard": SPEED,
}


def _batch_options(section: str) -> list[Decorator]:
    return [option for flag, option in _BATCH_OPTIONS if _BATCH_SECTIONS.get(flag, RUN) == section]


def sections(command: str, extra: Mapping[str, Sequence[Decorator]] | None = None) -> Decorator:
    """Every option ``command`` takes, grouped in the help's sections (those of ``extra`` first)."""
    import cloup

    batch = command == "batch"
    grouped: dict[str, list[Decorator]] = {title: list(options) for title, options in (extra or {}).items()}
    standard = {
        SELECTION: [*field_option_list("selection", command, SELECTION), *(_batch_options(SELECTION) if batch else [])],
        TRANSFORMS: [transforms_of(command)],
        OUTPUT: field_option_list("output", command, OUTPUT),
        SAFETY: field_option_list("output", command, SAFETY),
        SPEED: [*field_option_list("output", command, SPEED), *(_batch_options(SPEED) if batch else [])],
        RUN: [run_options(command), *(_batch_options(RUN) if batch else [])] if command in _RUNS else [],
    }
    for title, options in standard.items():
        grouped[title] = [*grouped.get(title, []), *options]
    return compose(*(cloup.option_group(title, *options) for title, options in grouped.items() if options))


# The commands that write (and so take --dry-run and --quiet).
_RUNS = ("convert", "strip-module", "add-module", "fit", "batch", "merge-lora")


def conversion_arguments(command: str, extra: Mapping[str, Sequence[Decorator]] | None = None) -> Decorator:
    """Everything a conversion command takes: SRC, DST, the options fields it offers, the transforms."""
    return compose(
        click.argument("src", type=click.Path(dir_okay=True)),
        click.argument("dst", type=click.Path(dir_okay=True)),
        sections(command, extra),
    )


def pipeline(leading: Sequence[Any], options: dict[str, Any]) -> Any:
    from ckptconv.transforms.keys import AddPrefix, Canonicalize, Cast, Drop, Keep, Pipeline, Rename, StripPrefix

    steps: list[Any] = [Canonicalize()] if options["canonical"] else []
    steps += list(leading)
    steps += [StripPrefix(prefix) for prefix in options.get("strip_prefixes", ())]
    steps += [Rename(pattern, replacement) for pattern, replacement in options["renames"]]
    steps += [AddPrefix(prefix) for prefix in options.get("add_prefixes", ())]
    if options["keeps"]:
        steps.append(Keep(tuple(options["keeps"])) if len(options["keeps"]) > 1 else Keep(options["keeps"][0]))
    steps += [Drop(pattern) for pattern in options["drops"]]
    if options["dtype"]:
        steps.append(Cast(options["dtype"], tuple(options["keep_dtypes"]), options["allow_overflow"]))
    elif options["keep_dtypes"] or options["allow_overflow"]:
        raise click.UsageError("--keep-dtype and --allow-overflow need --dtype")
    return Pipeline.of(steps)
