"""How a checkpoint is converted: one frozen object, built once, passed whole.

:class:`ConversionOptions` holds everything that decides what a conversion
does: which weights, which transforms, which output format, and how the output
is written and checked. The CLI builds one from its flags, :func:`ckptconv.convert`
and :func:`ckptconv.batch` accept it (or its fields as keywords), and a batch
hands it unchanged to every worker.

Each field that has a command-line flag says so in its metadata (a :class:`Flag`);
``cli/option_sets.py`` makes the click options from those, so ``convert``, ``batch`` and the
other commands cannot drift apart, and ``batch --help`` lists only what batch
accepts. Adding an option is one field here plus the code that uses it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ckptconv.transforms.keys import Pipeline

__all__ = [
    "BATCH_FORMATS",
    "LAYOUTS",
    "OUTPUT_FORMATS",
    "QUANTIZE_SCHEMES",
    "REFERENCES",
    "TIED",
    "ConversionOptions",
    "Flag",
    "fingerprint_defaults",
    "fingerprint_flags",
    "flags",
]

OUTPUT_FORMATS = ("pt", "safetensors", "dcp", "megatron")
# How safetensors outputs store tied tensors (see ckptconv.save); the first is the default.
TIED = ("dedupe", "copy")
# The schemes --quantize writes (ckptconv/quantization/fp8_quantize.py); the first is the default: none.
QUANTIZE_SCHEMES = ("none", "fp8-block")
# A batch writes one file per item: no folder formats.
BATCH_FORMATS = ("pt", "safetensors")
# --layout's values (ckptconv/architectures/layouts.py); the first is the default: as the source (or --like) has them.
LAYOUTS = ("keep", "fused", "per-expert")
# Whose readers --verify re-reads both sides with (ckptconv.checking.verification); the first is --verify's.
REFERENCES = ("ckptconv", "torch")

# Which commands show a flag.
CONVERSION_COMMANDS = frozenset({"convert", "strip-module", "add-module", "fit", "batch", "merge-lora"})
ONE_FILE_COMMANDS = CONVERSION_COMMANDS - {"batch"}
# The selection flags also say what `inspect` and `verify` read.
SELECTION_COMMANDS = CONVERSION_COMMANDS | {"inspect", "verify"}


@dataclass(frozen=True)
class Flag:
    """How an options field appears on the command line (``cli/option_sets.py`` makes the click option).

    Attributes:
        name: the flag, e.g. ``"--overwrite"``; a flag named ``--no-...`` sets its field to False.
        help: the help text.
        group: ``"selection"`` (also offered by ``inspect``, ``verify``) or ``"output"``.
        commands: the commands that offer it.
        kind: ``"flag"`` (on/off), ``"text"``, ``"format"`` (one of the output
            formats the command can write), ``"size"`` (5GB, 500MB, 2GiB) or
            ``"reference"`` (alone: ckptconv; ``=torch``: torch's readers), ``"count"`` (a positive integer) or
            ``"choice"`` (one of ``choices``; the first is the default).
        metavar: the value's name in ``--help``.
        batch_help: the help text under ``batch``, where it differs.
    """

    name: str
    help: str
    group: str = "output"
    commands: frozenset[str] = CONVERSION_COMMANDS
    kind: str = "flag"
    metavar: str | None = None
    batch_help: str | None = None
    choices: tuple[str, ...] = ()


def _option(default: Any, flag: Flag | None = None, *, fingerprint: bool | str = False) -> Any:
    """A field. ``fingerprint``: the field changes the output's bytes, so an item ``batch --resume``
    skips must have been made with the same value (a string: the name it is recorded under)."""
    return field(default=default, metadata={"flag": flag, "fingerprint": fingerprint})


@dataclass(frozen=True)
class ConversionOptions:
    """How to convert a checkpoint (see :func:`ckptconv.convert` and :func:`ckptconv.batch`).

    Attributes:
        select: where the weights are (``"state_dict_ema"``, ``"ema"``); searched when None.
        trust: unpickle with ``torch.load(weights_only=False)``, running any code
            in the file. Dangerous; see :func:`ckptconv.open`.
        transforms: steps such as :class:`~ckptconv.transforms.keys.StripPrefix` or
            :class:`~ckptconv.transforms.keys.Cast`, applied in order (a sequence of
            steps is made a :class:`~ckptconv.transforms.keys.Pipeline`).
        fit_to: a reference model, checkpoint or key list (see :func:`ckptconv.fit`):
            after ``transforms``, rename the keys to match it, or raise
            :class:`~ckptconv.errors.FitError` with the report and write nothing.
        to: ``"pt"``, ``"safetensors"``, ``"dcp"`` (a folder) or ``"megatron"`` (a Hugging Face model's weights as a
            Megatron-Core ``torch_dist`` folder); None follows the destination's suffix (:func:`ckptconv.batch`:
            safetensors).
        max_shard_size: write a folder of shards of at most this many bytes, with an index.
        part: ``"i/N"``: write only part ``i`` of ``N`` of that folder's shards (:mod:`ckptconv.writing.parts`),
            N processes at once; the last to finish publishes the folder.
        overwrite: replace an existing destination.
        verify: re-read the written output and compare every tensor before it is
            moved into place; a difference raises and leaves no output. ``True`` or
            ``"ckptconv"`` reads both sides with ckptconv's readers, ``"torch"`` with
            ``torch.load(weights_only=True)`` or the safetensors library wherever
            they can read them (see :func:`ckptconv.verify`).
        check_crc: read every zip record the weights use and compare it with the
            CRC-32 the archive records, on a worker thread during the write; a
            mismatch raises and leaves no output. False converts a damaged file's
            bytes as they are (to rescue what can be rescued).
        keep_meta: ``.pt`` output: keep the checkpoint's plain-data entries (epoch,
            step, hyperparameters, args) beside the weights, which then sit under
            ``"state_dict"``. safetensors output always keeps them, as JSON
            strings in its metadata (``checkpoint.<name>``).
        source_hash: record the source's sha256 in the output's provenance; it is
            computed on a second core while the tensors are copied, but a large
            training checkpoint may take longer to hash than to convert.
        provenance: record where the output came from (ckptconv's version, the
            source's name and sha256, the selection, the transforms) in its metadata.
            Without it, safetensors outputs of the same weights are byte-identical
            whatever the source was called (``.pt`` files still carry torch's random
            serialization id).
        fsync: make the output durable before it appears (see :func:`ckptconv.save`).
        tied: safetensors output, keys that share one tensor (tied weights):
            ``"dedupe"`` stores it once, the other names in the file's metadata, as
            Hugging Face does (load with ``safetensors.torch.load_model`` or
            :func:`ckptconv.load`); ``"copy"`` writes it under every name, which
            ``model.load_state_dict(safetensors.torch.load_file(path), strict=True)`` accepts.
        quantize: ``"fp8-block"`` quantizes the weights to DeepSeek-V3's fp8 blocks
            (:mod:`ckptconv.quantization.fp8_quantize`); ``"none"`` (the default) does not.
        layout: a mixture of experts' layout out: ``"fused"``, ``"per-expert"`` or ``"keep"`` (the default: as the
            source, or ``fit_to``'s model folder, has them); see :mod:`ckptconv.architectures.layouts`.
        padded_vocab_size: with ``to="megatron"``, the rows of the embedding and output layer (the rows past the
            config's ``vocab_size`` are zeros); None: ``vocab_size`` rows.
        allow_missing: write a model folder whose weights do not cover its config's model anyway (refused by
            default; see :mod:`ckptconv.architectures.coverage`), the list in the provenance.
        checksums: :func:`ckptconv.batch` only: record the sha256 of every input
            and output in the manifest (one more read of each).
    """

    select: str | None = _option(
        None,
        Flag(
            "--select",
            "Where the weights are in a training checkpoint, e.g. 'state_dict_ema' or 'model.state_dict'; "
            "'ema' picks the EMA copy. Searched when omitted.",
            group="selection",
            commands=SELECTION_COMMANDS,
            kind="text",
            metavar="PATH",
        ),
        fingerprint=True,
    )
    trust: bool = _option(
        False,
        Flag(
            "--trust",
            "DANGEROUS: unpickle with torch.load(weights_only=False), running any code in the file. "
            "Only for files you made yourself.",
            group="selection",
            commands=SELECTION_COMMANDS,
        ),
        fingerprint=True,
    )
    transforms: Pipeline = _option(Pipeline(), fingerprint=True)
    fit_to: Any = _option(None)
    to: str | None = _option(
        None,
        Flag(
            "--to",
            "Output format; by default it follows DST's suffix (.safetensors, or .pt/.pth/.bin/.pkl). "
            "A folder DST gets shards (safetensors by default); 'dcp' writes a torch.distributed.checkpoint folder; "
            "'megatron' writes a Hugging Face model folder's weights as a Megatron-Core torch_dist folder.",
            kind="format",
            batch_help="Output format of every item (default: safetensors).",
        ),
        fingerprint="format",
    )
    max_shard_size: int | None = _option(
        None,
        Flag(
            "--max-shard-size",
            "Write DST as a folder of shards of at most SIZE (5GB, 500MB, 2GiB) with a Hugging Face index.",
            kind="size",
            commands=ONE_FILE_COMMANDS,
        ),
    )
    part: str | None = _option(
        None,
        Flag(
            "--part",
            "With --max-shard-size: write only part INDEX of COUNT (0/4 to 3/4) of the folder's shards, so COUNT "
            "processes write one folder at once; the last to finish checks every shard and publishes the index.",
            kind="part",
            commands=frozenset({"convert"}),
            metavar="INDEX/COUNT",
        ),
    )
    overwrite: bool = _option(
        False, Flag("--overwrite", "Replace DST if it exists.", batch_help="Replace outputs that exist.")
    )
    verify: bool | str = _option(
        False,
        Flag(
            "--verify",
            "Re-read the output and compare every tensor with the source before keeping it. --verify=torch "
            "reads both with torch.load(weights_only=True) / the safetensors library instead of ckptconv's "
            "readers, where they can read them.",
            kind="reference",
        ),
    )
    check_crc: bool = _option(
        True,
        Flag(
            "--no-crc-check",
            "Convert a zip checkpoint whose records do not match their CRC-32 anyway (to rescue a damaged "
            "file: its tensors are copied as their bytes are).",
        ),
    )
    keep_meta: bool = _option(
        False,
        Flag(
            "--keep-meta",
            "For .pt output: keep the checkpoint's plain data (epoch, step, hyperparameters, args) beside the "
            "weights, which then sit under 'state_dict'. safetensors output always keeps it as JSON metadata.",
        ),
        fingerprint=True,
    )
    source_hash: bool = _option(
        True,
        Flag(
            "--no-source-hash",
            "Do not record the source's sha256 in the output (saves hashing the whole source file).",
        ),
        fingerprint=True,
    )
    provenance: bool = _option(
        True,
        Flag(
            "--no-provenance",
            "Do not record where the output came from (ckptconv version, source name and sha256, transforms); "
            "safetensors outputs of the same weights are then identical whatever the source was called.",
        ),
        fingerprint=True,
    )
    fsync: bool = _option(
        True,
        Flag(
            "--no-fsync",
            "Do not wait for the output to reach the disk before renaming it into place "
            "(faster; a power cut may then lose it).",
        ),
    )
    tied: str = _option(
        "dedupe",
        Flag(
            "--tied",
            "safetensors output: store tied weights (one tensor under several names) once, the other names in "
            "the metadata, as Hugging Face does (load with safetensors.torch.load_model or ckptconv.load); or "
            "write a copy under every name, which model.load_state_dict(load_file(DST), strict=True) accepts.",
            kind="choice",
            choices=TIED,
        ),
        fingerprint=True,
    )
    quantize: str = _option(
        "none",
        Flag(
            "--quantize",
            "Quantize the weights: fp8-block writes DeepSeek-V3's layout (float8_e4m3fn weights, a float32 "
            "weight_scale_inv per 128x128 block), bit for bit as transformers' quantizer; embeddings, lm_head, "
            "norms, integer buffers and --keep-dtype matches are left as they are.",
            kind="choice",
            choices=QUANTIZE_SCHEMES,
        ),
        fingerprint=True,
    )
    layout: str = _option(
        "keep",
        Flag(
            "--layout",
            "Mixture-of-experts output: 'fused' (transformers 5's experts.gate_up_proj [E, 2I, H] and "
            "experts.down_proj [E, H, I]) or 'per-expert' (experts.N.*, the Hub's and transformers' default save), "
            "tensor for tensor as transformers writes each; 'keep' leaves them as the source (or --like) has them.",
            kind="choice",
            choices=LAYOUTS,
        ),
        fingerprint=True,
    )
    padded_vocab_size: int | None = _option(
        None,
        Flag(
            "--padded-vocab-size",
            "With --to megatron: give the embedding and output layer N rows, Megatron's vocabulary padded to a "
            "multiple of make_vocab_size_divisible_by; the rows past the config's vocab_size are zeros. "
            "Default: vocab_size rows.",
            kind="count",
            commands=frozenset({"convert"}),
            metavar="N",
        ),
        fingerprint=True,
    )
    allow_missing: bool = _option(
        False,
        Flag(
            "--allow-missing",
            "Write a model folder whose weights lack a parameter of its config's model (or have one it lacks, or "
            "of another shape) anyway; the list goes into the provenance. Refused by default.",
        ),
        fingerprint=True,
    )
    checksums: bool = _option(
        True,
        Flag(
            "--no-checksums",
            "Do not record the sha256 of inputs and outputs in the manifest (saves reading every file once more).",
            commands=frozenset({"batch"}),
        ),
    )

    def __post_init__(self) -> None:
        if not isinstance(self.transforms, Pipeline):
            object.__setattr__(self, "transforms", Pipeline.of(self.transforms))

    def with_changes(self, caller: str = "ConversionOptions", **changes: Any) -> ConversionOptions:
        """A copy with some fields changed; an unknown name is a TypeError naming ``caller``."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
        return dataclasses.replace(self, **changes) if changes else self

    def fingerprint(self) -> dict[str, Any]:
        """The fields that decide the output's bytes, as plain data (what ``batch --resume`` compares).

        A field added later is left out while it has its default value (it then
        changes nothing), so the records of earlier batches still match.
        """
        described: dict[str, Any] = {}
        for option in dataclasses.fields(self):
            name = option.metadata["fingerprint"]
            value = getattr(self, option.name)
            if not name or (option.name not in _FIRST_FINGERPRINT and value == option.default):
                continue
            described[option.name if name is True else name] = (
                value.describe() if isinstance(value, Pipeline) else value
            )
        return described


# The fields the first manifests fingerprinted, always recorded (frozen: a new field never joins).
_FIRST_FINGERPRINT = frozenset({"select", "trust", "transforms", "to", "keep_meta", "source_hash"})


def flags() -> list[tuple[str, Flag]]:
    """``(field name, flag)`` for every field offered on the command line, in declaration order."""
    found = []
    for option in dataclasses.fields(ConversionOptions):
        flag = option.metadata["flag"]
        if flag is not None:
            found.append((option.name, flag))
    return found


def fingerprint_defaults() -> dict[str, Any]:
    """The value an entry of :meth:`ConversionOptions.fingerprint` has when it is left out (its default)."""
    return {
        option.name if option.metadata["fingerprint"] is True else option.metadata["fingerprint"]: option.default
        for option in dataclasses.fields(ConversionOptions)
        if option.metadata["fingerprint"] and option.name not in _FIRST_FINGERPRINT
    }


def fingerprint_flags() -> dict[str, str]:
    """How each entry of :meth:`ConversionOptions.fingerprint` is spelled on the command line
    (its field's name when it has no flag: ``transforms``)."""
    spelled = {}
    for option in dataclasses.fields(ConversionOptions):
        name = option.metadata["fingerprint"]
        if name:
            flag = option.metadata["flag"]
            spelled[option.name if name is True else name] = flag.name if flag is not None else option.name
    return spelled
