"""A model folder out: the files carried beside the converted weights, and what the conversion rewrites in them.

A conversion whose source is a model folder (``config.json`` and tokenizer beside ``model.safetensors``, an
index and shards, or ``pytorch_model.bin``) and whose destination is a folder writes a model folder: every
file :func:`ckptconv.reading.model_folder.inventory` carries is copied, byte for byte, except what the
conversion changed, which is rewritten in ``config.json``:

* ``dtype`` / ``torch_dtype`` (whichever the config has, in its sub-configs too) name the floating-point dtype
  of the weights written, when they share one (after ``--dtype``, or ``--like``);
* ``quantization_config`` is removed when the weights were dequantized;
* ``tie_word_embeddings`` says what the tensors written hold: True when the head (``lm_head.weight``) is the
  embeddings' tensor as written (the same data and the same cast) or was left out by the conversion, False when
  it is a tensor of its own (set so where the config left it to the model class's default).

:func:`plan` decides (planning, no I/O but the config already read); :func:`check` refuses existing files
before any weight is written; :func:`write` copies through the read policy into atomic outputs the write
policy allows, ``config.json`` last, as a sharded folder's index is written after its shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptconv._text import plural
from ckptconv.errors import OutputExistsError
from ckptconv.quantization import output_check
from ckptconv.reading import read_policy
from ckptconv.reading.model_folder import CONFIG_NAME, Inventory, inventory, read_config
from ckptconv.values.tensor import TensorRef
from ckptconv.writing import write_policy
from ckptconv.writing.atomic import atomic_output
from ckptconv.writing.transaction import enclosing_part

__all__ = [
    "ModelFile",
    "ModelFiles",
    "carry",
    "check",
    "left_out",
    "plan",
    "rewritten_config",
    "weights_stem",
    "write",
]

_DTYPE_FIELDS = ("dtype", "torch_dtype")
_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class ModelFile:
    """One file of the output folder: ``name`` (relative, ``/``-separated) copied from ``source``, or ``content``."""

    name: str
    source: str = ""
    content: bytes | None = None
    root: str = ""  # the source folder the file must stay inside when it is opened again to be copied


@dataclass(frozen=True)
class ModelFiles:
    """The files to carry, in writing order (``config.json`` last), the notes that say what was done, and the stem
    the weights' files are named after (None: ``model``/``pytorch_model``, as transformers names them)."""

    files: tuple[ModelFile, ...] = ()
    notes: tuple[str, ...] = ()
    stem: str | None = None


# The weights' file names in a model folder: model.safetensors, pytorch_model-00001-of-00002.bin, their index,
# adapter_model.safetensors (PEFT), diffusion_pytorch_model.safetensors (diffusers).
_WEIGHTS_NAME = re.compile(r"^(?P<stem>.+?)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?$")
# Stems that name a format's default (transformers writes model.safetensors and pytorch_model.bin).
_DEFAULT_STEMS = ("model", "pytorch_model")


def weights_stem(files: Iterable[str]) -> str | None:
    """The stem the weights' files are named after, when it is not transformers' default (``adapter_model``)."""
    for path in files:
        match = _WEIGHTS_NAME.match(os.path.basename(path))
        if match is not None:
            stem = match.group("stem")
            return None if stem in _DEFAULT_STEMS else stem
    return None


def carry(
    folder: str,
    weights: Sequence[str],
    state: Mapping[str, TensorRef],
    *,
    source_keys: Iterable[str] = (),
    dequantized: bool = False,
    quantization_config: Mapping[str, Any] | None = None,
    file_output: bool = False,
    parts: Sequence[str] = (),
) -> ModelFiles:
    """What the model folder ``folder`` (whose weights are the files ``weights``) carries to a folder output, or,
    for a file output (``file_output``), the notes on what stays behind.

    Raises:
        LoadError: a file of the folder is a link leading out of it, or not a regular file.
        MalformedCheckpointError: its ``config.json`` is not a JSON object.
    """
    found = inventory(folder, weights, parts)
    if not file_output:
        planned = plan(
            found,
            read_config(folder),
            state,
            source_keys=source_keys,
            dequantized=dequantized,
            quantization_config=quantization_config,
        )
        return dataclasses.replace(planned, stem=weights_stem(weights))
    notes = left_out(found, carried=False)
    if found.carried:
        kept = f"{plural(len(found.carried), 'model file')} ({', '.join(found.carried[:3])}"
        kept += " ...)" if len(found.carried) > 3 else ")"
        notes.insert(0, f"{kept} stayed behind: give a folder as DST (out/) to get a model folder")
    return ModelFiles(notes=tuple(notes))


def _listed(names: Sequence[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _float_dtype(state: Mapping[str, TensorRef]) -> str | None:
    kinds = {ref.out_dtype.name for ref in state.values() if ref.out_dtype.kind == "float"}
    return kinds.pop() if len(kinds) == 1 else None


def _shares_data(state: Mapping[str, TensorRef], key: str) -> bool:
    """True when another key holds the same tensor as ``key`` as written: the same view of the same storage and
    the same pending cast (the test the writer stores tied tensors once by). A head kept in float32 by
    ``--keep-dtype`` beside an embedding cast to bfloat16 views the same bytes but holds other values."""
    ref = state[key]
    return any(other == ref for name, other in state.items() if name != key)


def _rewrite_dtype(config: dict[str, Any], dtype: str, changes: list[str], where: str = "") -> None:
    for field in _DTYPE_FIELDS:
        if isinstance(config.get(field), str) and config[field] != dtype:
            changes.append(f"{where}{field} {config[field]} -> {dtype}")
            config[field] = dtype
    for name, value in config.items():
        if isinstance(value, dict) and name.endswith("_config") and name != "quantization_config":
            _rewrite_dtype(value, dtype, changes, f"{where}{name}.")


def _tie(
    config: dict[str, Any], state: Mapping[str, TensorRef], source_keys: Iterable[str], changes: list[str]
) -> None:
    tied = config.get("tie_word_embeddings")
    if tied is not None and not isinstance(tied, bool):
        return
    heads = [key for key in state if key.endswith(_HEAD)]
    if heads:
        consistent = all(_shares_data(state, key) for key in heads)
    elif any(key.endswith(_HEAD) for key in source_keys):
        consistent = True  # the conversion left the head out: only a tied head loads
    else:
        return
    if tied is None and not consistent:  # a head of its own, where the model class may tie by default (GPT-2)
        changes.append("tie_word_embeddings set to false (the head written is a tensor of its own)")
        config["tie_word_embeddings"] = False
    elif tied is not None and consistent != tied:
        changes.append(f"tie_word_embeddings {str(tied).lower()} -> {str(consistent).lower()}")
        config["tie_word_embeddings"] = consistent


def rewritten_config(
    config: Mapping[str, Any],
    state: Mapping[str, TensorRef],
    *,
    source_keys: Iterable[str] = (),
    dequantized: bool = False,
    quantization_config: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """``config`` as the weights written need it, and the changes made (``"dtype float32 -> bfloat16"``)."""
    result: dict[str, Any] = json.loads(json.dumps(dict(config)))  # a deep copy of plain JSON
    changes: list[str] = []
    dtype = _float_dtype(state)
    if dtype is not None:
        _rewrite_dtype(result, dtype, changes)
    for declaration in ("quantization_config", "compression_config") if dequantized else ():
        if declaration in result:
            del result[declaration]
            changes.append(f"{declaration} removed (the weights were dequantized)")
    if quantization_config is not None:
        result["quantization_config"] = dict(quantization_config)
        method = quantization_config.get("quant_method")
        changes.append(f"quantization_config set ({method}: the weights were quantized)")
    _tie(result, state, source_keys, changes)
    output_check.check_config(result, state)  # quantization_config there exactly when quantized tensors are
    return result, changes


def plan(
    inventory: Inventory,
    config: Mapping[str, Any] | None,
    state: Mapping[str, TensorRef],
    *,
    source_keys: Iterable[str] = (),
    dequantized: bool = False,
    quantization_config: Mapping[str, Any] | None = None,
) -> ModelFiles:
    """The files a folder output gets beside its weights, and the notes on what was carried, rewritten and left out."""
    files: list[ModelFile] = []
    notes: list[str] = []
    last: ModelFile | None = None
    for name in inventory.carried:
        if name == CONFIG_NAME and config is not None:
            rewritten, changes = rewritten_config(
                config,
                state,
                source_keys=source_keys,
                dequantized=dequantized,
                quantization_config=quantization_config,
            )
            if changes:
                content = (json.dumps(rewritten, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
                last = ModelFile(name, inventory.path(name), content, inventory.folder)
                notes.append(f"rewrote {CONFIG_NAME}: {'; '.join(changes)}")
                continue
            last = ModelFile(name, inventory.path(name), root=inventory.folder)
            continue
        files.append(ModelFile(name, inventory.path(name), root=inventory.folder))
    if last is not None:
        files.append(last)
    if files:
        names = [file.name for file in files]
        notes.insert(0, f"carried {plural(len(names), 'model file')} beside the weights ({_listed(names)})")
    return ModelFiles(tuple(files), tuple(notes + left_out(inventory)))


def left_out(inventory: Inventory, *, carried: bool = True) -> list[str]:
    """The notes on what a model folder holds that the output does not get (``carried``: the unknown files
    copied are named too)."""
    notes: list[str] = []
    if inventory.unknown and carried:
        notes.append(
            f"copied {plural(len(inventory.unknown), 'file')} ckptconv does not interpret verbatim "
            f"({_listed(inventory.unknown)}); check that they still describe the converted weights"
        )
    if inventory.training_state:
        held = [f"{name} ({what})" for name, what in inventory.training_state]
        notes.append(f"left out the training state beside the model, which is not weights: {_listed(held)}")
    if inventory.unsafe:
        one = len(inventory.unsafe) == 1
        notes.append(
            f"left out {_listed(list(inventory.unsafe))}, which {'is' if one else 'are'} unsafe: "
            f"{'it names' if one else 'they name'} code-running callables (ckptconv scan says which); not converted, "
            "and never to be opened with torch.load(weights_only=False)"
        )
    if inventory.other_weights:
        notes.append(
            f"left out weights ckptconv did not convert ({_listed(list(inventory.other_weights))}); convert them on "
            "their own"
        )
    if inventory.other_folders:
        notes.append(
            f"left out {plural(len(inventory.other_folders), 'folder')} holding another model's weights "
            f"({_listed(list(inventory.other_folders))}); convert them on their own"
        )
    if inventory.too_large:
        notes.append(
            f"left out {_listed(list(inventory.too_large))}: larger than a model folder's files are; copy it yourself"
        )
    return notes


def check(files: ModelFiles, folder: str, *, overwrite: bool, inputs: write_policy.Inputs) -> None:
    """Refuse, before any weight is written, files that exist in ``folder`` (without ``overwrite``) or are inputs.

    Raises:
        OutputExistsError: one exists and ``overwrite`` is False.
        WriteError: one is a file the conversion reads.
    """
    targets = [os.path.join(folder, *file.name.split("/")) for file in files.files]
    for target in targets:
        inputs.check_file(target, action="replace")
    existing = [file.name for file, target in zip(files.files, targets) if os.path.lexists(target)]
    if existing and not overwrite:
        raise OutputExistsError(
            f"{folder!r} already holds {_listed(existing, 4)}; pass --overwrite to replace them", path=folder
        )


def write(
    files: ModelFiles,
    folder: str,
    *,
    inputs: write_policy.Inputs,
    fsync: bool,
    made: Sequence[str] = (),
) -> tuple[str, ...]:
    """Write ``files`` into ``folder``, each atomically; on a failure those written are removed again, and the
    folders ``made`` for them: a model folder is whole, or not written.

    Raises:
        LoadError: a source file is no longer a regular file inside its folder.
        WriteError: a file cannot be written, or a subfolder of ``folder`` is a link.
    """
    written: list[str] = []
    created: list[str] = []
    try:
        for file in files.files:
            target = os.path.join(folder, *file.name.split("/"))
            if "/" in file.name:
                created += write_policy.make_folders(os.path.dirname(target), root=folder)
            with atomic_output(target, overwrite=True, fsync=fsync, inputs=inputs) as output:
                if file.content is not None:
                    output.write(file.content)
                else:
                    with read_policy.open_file(file.source, folder=file.root or None) as source:
                        shutil.copyfileobj(source, output, 1 << 20)
            written.append(target)
    except BaseException:
        for path in written:
            with contextlib.suppress(OSError):
                os.unlink(path)
        write_policy.remove_folders([*made, *created])
        raise
    return tuple(written)


def write_alone(
    folder: str, destination: str | None, parts: Sequence[str], *, overwrite: bool, fsync: bool
) -> tuple[ModelFiles, tuple[str, ...]]:
    """The top of a folder of models that holds no weights of its own (diffusers: ``model_index.json``,
    ``scheduler/``, ``tokenizer/``), carried into ``destination`` (created); its ``parts`` are converted apart.
    Returns what was carried and the files written (none when ``destination`` is None: a dry run).

    Raises:
        OutputExistsError, WriteError: see :func:`check` and :func:`write`.
    """
    carried = carry(folder, (), {}, parts=parts)
    if destination is None:
        return carried, ()
    target = os.path.abspath(destination)
    inputs = write_policy.Inputs(file.source for file in carried.files)
    inputs.check_folder(target)
    check(carried, target, overwrite=overwrite, inputs=inputs)
    part = enclosing_part(target)  # the top of a folder of models: staged with its parts, published with them
    if part is not None:
        return carried, tuple(part.final(path) for path in write(carried, part.path, inputs=inputs, fsync=fsync))
    made = [] if os.path.isdir(target) else write_policy.make_folders(destination)
    return carried, write(carried, target, inputs=inputs, fsync=fsync, made=made)
